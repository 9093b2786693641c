"""models/kernels/flash_blocks.py against attention written out densely (a numpy softmax over a (Tq, S) mask built
from the positions here), forward and gradients: positions in a balanced rank's order (two increasing chunks),
documents, a window, Gemma's soft-cap, a scale of its own and a value width other than the key's; two key blocks
merged by their log-sum-exps equal the row's attention."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.kernels import flash_blocks as fb

B, K, G, E, F = 2, 2, 2, 8, 12


def _dense(q, k, v, pq, pk, sq, sk, window, softcap, scale):
    """Attention in float64 numpy: q (B, K, G, Tq, E), k (B, K, S, E), v (B, K, S, F)."""
    s = np.einsum("bkgte,bkse->bkgts", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    ahead = pq[:, None] - pk[None, :]
    keep = (ahead >= 0) & ((ahead < window) if window else True)
    keep = keep[None, None, None] & (sq[:, None, None, :, None] == sk[:, None, None, None, :])
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)
    p = np.exp(s - m)
    return np.einsum("bkgts,bksf->bkgtf", p / np.maximum(p.sum(-1, keepdims=True), 1e-300), v)


def _attend(mask, scale, softcap, tile):
    """The row's attention through the kernel's forward and backward (as context parallelism with one block)."""
    @jax.custom_vjp
    def f(q, k, v):
        return fb.forward(q, k, v, mask, scale, softcap, tile)[0]

    def f_fwd(q, k, v):
        o, lse = fb.forward(q, k, v, mask, scale, softcap, tile)
        return o, (q, k, v, o, lse)

    def f_bwd(res, do):
        q, k, v, o, lse = res
        return fb.backward(q, k, v, mask, scale, lse, do, jnp.sum(do * o, axis=-1), softcap, tile=tile)
    f.defvjp(f_fwd, f_bwd)
    return f


def _case(T, balanced, docs, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(B, K, G, T, E)), rng.normal(size=(B, K, T, E))
    v = rng.normal(size=(B, K, T, F))
    if balanced:  # a balanced rank's order: two increasing chunks with a gap (rank 0 of 2: chunks 0 and 3 of 4)
        pos = np.concatenate([np.arange(T // 2), np.arange(T // 2) + T]).astype(np.float64)
    else:
        pos = np.arange(T, dtype=np.float64)
    seg = np.sort(rng.integers(0, docs, size=(B, T)), axis=1) if docs > 1 else np.zeros((B, T), np.int32)
    return q, k, v, pos, seg


CASES = {  # window, softcap, scale, documents, balanced
    "causal": (None, None, None, 1, False),
    "balanced-documents": (None, None, None, 3, True),
    "window": (5, None, None, 1, False),
    "softcap-scale-window-documents": (9, 2.0, 0.3, 4, True),
}


@pytest.mark.parametrize("name", CASES)
def test_forward_and_gradients_equal_dense_attention(name):
    window, softcap, scale, docs, balanced = CASES[name]
    T = 32
    q, k, v, pos, seg = _case(T, balanced, docs)
    scale = E ** -0.5 if scale is None else scale
    mask = fb.Mask(jnp.asarray(pos, jnp.float32), jnp.asarray(pos, jnp.float32), jnp.asarray(seg), jnp.asarray(seg),
                   window)
    f = _attend(mask, scale, softcap, tile=8)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    want = _dense(q, k, v, pos, pos, seg, seg, window, softcap, scale)
    np.testing.assert_allclose(np.asarray(f(*args)), want, rtol=1e-5, atol=1e-5)
    # gradients of a weighted sum, against finite differences of the dense float64 attention along a random direction
    w = np.random.default_rng(1).normal(size=want.shape)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(*args)
    rng = np.random.default_rng(2)
    for i, g in enumerate(grads):
        d = rng.normal(size=g.shape)
        x = [q, k, v]
        up = [a + 1e-6 * d if j == i else a for j, a in enumerate(x)]
        dn = [a - 1e-6 * d if j == i else a for j, a in enumerate(x)]
        numeric = (np.sum(_dense(*up, pos, pos, seg, seg, window, softcap, scale) * w)
                   - np.sum(_dense(*dn, pos, pos, seg, seg, window, softcap, scale) * w)) / 2e-6
        assert abs(float(np.sum(np.asarray(g) * d)) - numeric) <= 1e-4 * max(1.0, abs(numeric)), (i, numeric)


def test_blocks_merged_by_their_log_sum_exps_equal_the_row():
    """Keys in two blocks (as two ring steps): each block's (output, lse), merged, is the row's attention; a query
    that sees no key of a block gets lse -inf from it and the merge keeps the other block's output."""
    T = 32
    q, k, v, pos, seg = _case(T, True, 3, seed=3)
    pf, sj = jnp.asarray(pos, jnp.float32), jnp.asarray(seg)
    qj, kj, vj = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    h = T // 2
    o1, l1 = fb.forward(qj, kj[:, :, :h], vj[:, :, :h], fb.Mask(pf, pf[:h], sj, sj[:, :h], None), E ** -0.5, tile=8)
    o2, l2 = fb.forward(qj, kj[:, :, h:], vj[:, :, h:], fb.Mask(pf, pf[h:], sj, sj[:, h:], None), E ** -0.5, tile=8)
    assert bool(jnp.all(jnp.isneginf(l2[..., :h])))  # the first chunk's queries see nothing of the second's keys
    o, _ = fb.merge(o1, l1, o2, l2)
    np.testing.assert_allclose(np.asarray(o), _dense(q, k, v, pos, pos, seg, seg, None, None, E ** -0.5),
                               rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _trip_counts(window):
    """The key tiles each query tile visits (forward), by running the loop bounds the kernel computes."""
    T, n = 64, 8
    pos = jnp.arange(T, dtype=jnp.float32)
    lo, hi = fb._ends(pos, n)
    return [int(jnp.sum(lo <= hi[i]) - (0 if window is None else jnp.sum(hi <= lo[i] - window))) for i in range(T // n)]


def test_causality_and_the_window_skip_whole_tiles():
    """Tiles of 8 over 64 positions: query tile i visits i + 1 key tiles causally; with a window of 10 (a query at
    16 sees 7..16: tiles 0 to 2) at most 3, and with 9 (8..16) at most 2."""
    assert _trip_counts(None) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert _trip_counts(10) == [1, 2, 3, 3, 3, 3, 3, 3]
    assert _trip_counts(9) == [1, 2, 2, 2, 2, 2, 2, 2]
