"""Attention sinks (gpt-oss: a learned logit per head that joins every query's softmax denominator and takes no
value), models/kernels/attention.py `attention(..., sinks=)`, against a reference written here: for each query,
p_j = exp(s_j) / (sum over its visible keys of exp(s_k) + exp(sink_h)), out = sum_j p_j v_j, with packed documents,
a sliding window and grouped KV heads; forward (checked position by position in NumPy, float64) and the gradients
of q, k, v and the sinks (against the same formula in jnp) within 1e-5: XLA's path (the softmax with the sink's
column), the CPU fast path's causal blocks and the loops kernel for long rows, each with its own backward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.kernels.attention import attention

B, T, H, K, E = 2, 12, 4, 2, 8
SEG = np.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])  # packed documents; padding (0) at the end of row 1


def _inputs():
    r = np.random.default_rng(0)
    q, k, v = (r.normal(size=(B, T, n, E)).astype(np.float32) for n in (H, K, K))
    sinks = np.array([-1.0, 0.5, 2.0, 0.0], np.float32)
    return q, k, v, sinks


def _visible(window, seg=SEG):
    """(B, T, T) whether query t sees key s: causal, same document, inside the window."""
    n = seg.shape[1]
    t, s = np.arange(n)[:, None], np.arange(n)[None, :]
    keep = (t >= s) & ((t - s) < window if window else True)
    return keep[None] & (seg[:, :, None] == seg[:, None, :])


def _by_hand(q, k, v, sinks, window, seg=SEG):
    """The forward query by query (float64)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    out, seen = np.zeros(q.shape), _visible(window, seg)
    for b in range(q.shape[0]):
        for t in range(T):
            for h in range(H):
                kv = h // (H // K)
                keys = np.flatnonzero(seen[b, t])
                s = np.array([q[b, t, h] @ k[b, j, kv] for j in keys]) / np.sqrt(E)
                w = np.exp(s) / (np.exp(s).sum() + np.exp(float(sinks[h])))
                out[b, t, h] = sum(wi * v[b, j, kv] for wi, j in zip(w, keys))
    return out


def _formula(q, k, v, sinks, window, seg=SEG):
    """The same in jnp, for the gradients: exp of the scores less their max, the sink's term in the denominator."""
    kk, vv = (jnp.repeat(a, H // K, axis=2) for a in (k, v))
    s = jnp.einsum("bthe,bshe->bhts", q, kk) / np.sqrt(E)
    seen = jnp.asarray(_visible(window, seg))[:, None]
    m = jnp.maximum(jnp.max(jnp.where(seen, s, -jnp.inf), -1, keepdims=True), sinks[None, :, None, None])
    e = jnp.where(seen, jnp.exp(s - m), 0.0)
    p = e / (e.sum(-1, keepdims=True) + jnp.exp(sinks[None, :, None, None] - m))
    return jnp.einsum("bhts,bshe->bthe", p, vv)


def _loops(q, k, v, z, segments, window):
    """The CPU loops kernel for long rows (models/kernels/flash_cpu.py), in tiles of 4."""
    from models.kernels.fast_cpu import causal_attention
    return causal_attention(q, k, v, segments=segments, window=window, sinks=z, loops=4)


KERNELS = {"xla": lambda q, k, v, z, seg, w: attention(q, k, v, impl="xla", segments=seg, window=w, sinks=z),
           # the CPU fast path, causal blocks of 4 with its hand-written backward
           "manual": lambda q, k, v, z, seg, w: attention(q, k, v, impl="manual", block=4, segments=seg, window=w,
                                                          sinks=z),
           "loops": _loops}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("window", [pytest.param(None, marks=pytest.mark.slow), 4])  # the window's in the default run
def test_sinks_equal_the_softmax_written_out(kernel, window):
    q, k, v, sinks = _inputs()
    ours = lambda q, k, v, z: KERNELS[kernel](q, k, v, z, jnp.asarray(SEG), window)  # noqa: E731
    got = np.asarray(ours(q, k, v, sinks))
    np.testing.assert_allclose(got, _by_hand(q, k, v, sinks, window), atol=1e-5)
    assert np.abs(got - np.asarray(ours(q, k, v, None))).max() > 1e-2  # the sinks matter here
    cot = jnp.asarray(np.random.default_rng(1).normal(size=got.shape), jnp.float32)
    grads = jax.grad(lambda *a: jnp.sum(ours(*a) * cot), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    want = jax.grad(lambda *a: jnp.sum(_formula(*a, window) * cot), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, w, name in zip(grads, want, ("q", "k", "v", "sinks")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, err_msg=name)
    assert np.abs(np.asarray(grads[3])).min() > 1e-4  # every head's sink gets a gradient


@pytest.mark.parametrize("window", [pytest.param(None, marks=pytest.mark.slow), 3])
def test_decoding_with_a_cache_keeps_the_sinks(window):
    """models/decode.py's attention against a cache in position order: a prefill of 8 tokens, then one token at a
    time, each output the whole row's (by the hand reference above) at its position."""
    from models.config import from_preset
    from models.decode import position_cache
    q, k, v, sinks = _inputs()
    q, k, v = q[:1], k[:1], v[:1]  # row 0 as one document
    want = _by_hand(q, k, v, sinks, window, np.ones((1, T), np.int64))[0]
    c = from_preset("tiny", n_heads=H, n_kv_heads=K, head_dim=E)
    cache_k, cache_v = jnp.zeros((1, T, K, E)), jnp.zeros((1, T, K, E))
    pos = 0
    for n in (8, 1, 1, 1, 1):
        _, attend = position_cache(c, (1, n), pos, T, jnp.float32)
        o, cache_k, cache_v = attend(q[:, pos:pos + n], k[:, pos:pos + n], v[:, pos:pos + n], cache_k, cache_v,
                                     window, None, None, jnp.asarray(sinks))
        np.testing.assert_allclose(np.asarray(o[0]), want[pos:pos + n], atol=1e-5)
        pos += n


@pytest.mark.parametrize("strategy", [pytest.param("all_gather", marks=pytest.mark.slow), "ring", "all_to_all"])
def test_context_parallel_sinks_enter_each_softmax_once(strategy):
    """Rows of 16 split over 4 context ranks, balanced (each rank two chunks), documents and a window: each
    strategy's output and gradients (the sinks' summed over the ranks) equal the hand formula; the ring merges its
    blocks first and adds the sink once."""
    import functools
    from jax.sharding import NamedSharding, PartitionSpec as P
    from meshes import RULES, Collectives, build_mesh
    from models.context_parallel.gather import ContextPlan, order
    n = 16
    seg = np.array([[1] * 6 + [2] * 10, [1] * 11 + [2] * 5])
    mesh = build_mesh(jax.devices()[:4], data=1, context=4)
    coll = Collectives(RULES.replace(seq="context"), mesh)
    perm = order(n, 4, True)
    plan = ContextPlan(4, strategy, tuple(int(i) for i in perm))
    kernel = functools.partial(attention, impl="manual", block=4, platform="cpu", window=5)
    r = np.random.default_rng(2)
    q, k, v, ct = (jnp.asarray(r.normal(size=sh), jnp.float32) for sh in
                   ((B, n, H, E), (B, n, K, E), (B, n, K, E), (B, n, H, E)))
    sinks = jnp.asarray([-1.0, 0.5, 2.0, 0.0], jnp.float32)
    split = NamedSharding(mesh, P(None, "context"))

    def chunked(q, k, v, z):
        args = [jax.lax.with_sharding_constraint(a[:, perm], split) for a in (q, k, v)]
        s = jax.lax.with_sharding_constraint(jnp.asarray(seg)[:, perm], split)
        o = plan.attention(kernel, coll, plan.positions(coll, n))(*args, segments=s, sinks=z)
        return jnp.zeros_like(o).at[:, perm].set(o)

    with jax.set_mesh(mesh):
        got = jax.jit(chunked)(q, k, v, sinks)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(chunked(*a) * ct), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    want = _formula(q, k, v, sinks, 5, seg)
    want_g = jax.grad(lambda *a: jnp.sum(_formula(*a, 5, seg) * ct), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    for g, w, name in zip(grads, want_g, ("q", "k", "v", "sinks")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, err_msg=name)


def test_cudnn_with_sinks_runs_the_manual_kernel():
    """cuDNN's fused kernel takes no sink: asked for it with sinks (as a GPU's bfloat16 auto does), the blockwise
    manual kernel runs instead (here on CPU, where cuDNN could not run at all), exact by the hand formula."""
    q, k, v, sinks = _inputs()
    got = attention(q, k, v, impl="cudnn", block=4, segments=jnp.asarray(SEG), window=4, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), _by_hand(q, k, v, sinks, 4), atol=1e-5)
