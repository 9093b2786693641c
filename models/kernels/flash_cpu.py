"""The whole-row causal attention of models/kernels/fast_cpu.py for long rows, as loops (FlashAttention's order).

Unrolled over its query blocks (fast_cpu's `_attention`), XLA:CPU gives every block's scores buffers of their own
(T^2 / 2 floats per head and array: at T=8192 with 12 heads, 6 GB more than these loops) and runs slower. Here a loop
over query tiles runs, in each, a loop over the key tiles it sees (causality and the window skip the rest, their
ranges traced), merged by an online softmax; the backward loops over key tiles and, in each, over the query tiles
that see it: the tile's dK and dV accumulate in the loop's carry, dQ in place in the row's. The same residuals as
`_attention` (q, k, v, the output and the log-sum-exp), the same arithmetic per tile. Measured (forward and backward,
12 heads of 64, tiles of 256, against the unrolled kernel with blocks of 128): 1.39x its time at T=512, 0.99x at
1024, 0.83x at 2048, 0.44x at 8192 (docs/performance.md); hence loops from LOOPS_FROM tokens on.
Letters as fast_cpu: q (B, K, G, T, E) grouped by kv head, k and v (B, K, T, E), segments (B, T).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

LOOPS_FROM, TILE = 2048, 256


def _scores(qa, kb, scale, a, b, seg_a, seg_b, window):
    """Scores (B, K, G, n, n) float32 of the query tile at a against the key tile at b (traced starts: the mask is
    made in the loop, a tile's own), -inf where a query may not see a key."""
    s = jnp.einsum("bkgte,bkse->bkgts", qa, kb, preferred_element_type=jnp.float32) * scale
    ahead = (a + jnp.arange(qa.shape[3]))[:, None] - (b + jnp.arange(kb.shape[2]))[None, :]
    keep = ahead >= 0
    if window:
        keep = keep & (ahead < window)
    keep = keep[None, None, None]
    if seg_a is not None:
        keep = keep & (seg_a[:, None, None, :, None] == seg_b[:, None, None, None, :])
    return jnp.where(keep, s, -jnp.inf)


def _tile(x, i, n, axis):
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, i * n, n, axis)


def online(state, s, vb):
    """One key tile into an online softmax: state (running max m, sum l, output accumulator acc), the tile's
    scores s (-inf where masked) and values vb (B, K, S, F)."""
    m, l, acc = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    base = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # a query that has seen no key yet keeps 0
    p = jnp.exp(s - base[..., None])
    keep = jnp.exp(jnp.where(jnp.isneginf(m), -jnp.inf, m - base))
    acc = acc * keep[..., None] + jnp.einsum("bkgts,bksf->bkgtf", p.astype(vb.dtype), vb,
                                             preferred_element_type=jnp.float32)
    return m_new, l * keep + jnp.sum(p, axis=-1), acc


def _forward(q, k, v, scale, n, seg, window):
    """(output, log-sum-exp (B, K, G, T) float32) in tiles of n."""
    B, K, G, T, E = q.shape

    def query_tile(i, out):
        qa, sa = _tile(q, i, n, 3), _tile(seg, i, n, 1)

        def key_tile(j, state):
            s = _scores(qa, _tile(k, j, n, 2), scale, i * n, j * n, sa, _tile(seg, j, n, 1), window)
            return online(state, s, _tile(v, j, n, 2))
        first = 0 if not window else jnp.maximum(0, i * n - window + 1) // n
        m, l, acc = jax.lax.fori_loop(first, i + 1, key_tile, (
            jnp.full((B, K, G, n), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, n), jnp.float32),
            jnp.zeros((B, K, G, n, E), jnp.float32)))
        put = lambda whole, x: jax.lax.dynamic_update_slice_in_dim(whole, x, i * n, 3)  # noqa: E731
        return put(out[0], (acc / l[..., None]).astype(q.dtype)), put(out[1], m + jnp.log(l))
    return jax.lax.fori_loop(0, T // n, query_tile, (jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:4], jnp.float32)))


def with_backward(forward, backward):
    """f(q, k, v, scale, block, seg, window) -> forward's output, whose backward is backward(scale, block, window,
    (q, k, v, o, lse, seg), do): what both whole-row kernels keep (no T x T array)."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 6))
    def f(q, k, v, scale, block, seg, window):
        return forward(q, k, v, scale, block, seg, window)[0]

    def f_fwd(q, k, v, scale, block, seg, window):
        o, lse = forward(q, k, v, scale, block, seg, window)
        return o, (q, k, v, o, lse, seg)
    f.defvjp(f_fwd, backward)
    return f


def sunk(o, lse, z):
    """(o', L') of a row's attention output o and log-sum-exp L (B, K, G, T) with each head's sink logit z (K, G)
    joining every query's softmax: L' = logaddexp(L, z), o' = o exp(L - L'). A backward that takes (o', L') for
    (o, L) is the sinked softmax's (its P = exp(S - L') holds the sink in the denominator)."""
    out = jnp.logaddexp(lse, z.astype(jnp.float32)[None, :, :, None])
    return (o.astype(jnp.float32) * jnp.exp(lse - out)[..., None]).astype(o.dtype), out


def sink_grad(o, lse, z, do):
    """The sinks' gradient (K, G) from (o', L') and the output's cotangent: -sum over rows and queries of
    exp(z - L') rowsum(dO o') (d o' / d z = -p_sink o')."""
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(z.astype(jnp.float32)[None, :, :, None] - lse) * d, axis=(0, 3)).astype(z.dtype)


def with_sinks(forward, backward):
    """f(q, k, v, sinks (K, G), scale, block, seg, window) of a whole-row kernel pair (`with_backward`'s): each head's
    sink logit joins every query's softmax denominator. The kernel's output o and log-sum-exp L become
    o' = o exp(L - L') and L' = logaddexp(L, sink), and its own backward on (o', L') is the sinked softmax's: P' =
    exp(S - L') holds the sink in its denominator, dS = P' (dP - rowsum(dO o')). The sink's gradient is
    -sum over rows and queries of exp(sink - L') rowsum(dO o') (d o' / d sink = -p_sink o')."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 7))
    def f(q, k, v, z, scale, block, seg, window):
        return f_fwd(q, k, v, z, scale, block, seg, window)[0]

    def f_fwd(q, k, v, z, scale, block, seg, window):
        o, lse = sunk(*forward(q, k, v, scale, block, seg, window), z)
        return o, (q, k, v, o, lse, seg, z)

    def f_bwd(scale, block, window, res, do):
        q, k, v, o, lse, seg, z = res
        dq, dk, dv, dseg = backward(scale, block, window, (q, k, v, o, lse, seg), do)
        return dq, dk, dv, sink_grad(o, lse, z, do), dseg
    f.defvjp(f_fwd, f_bwd)
    return f


def _backward(scale, n, window, res, do):
    q, k, v, o, lse, seg = res
    tiles = q.shape[3] // n
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)

    def key_tile(j, grads):
        kb, vb, sb = _tile(k, j, n, 2), _tile(v, j, n, 2), _tile(seg, j, n, 1)

        def query_tile(i, state):
            dk, dv, dq = state
            qa, doa = _tile(q, i, n, 3), _tile(do, i, n, 3)
            s = _scores(qa, kb, scale, i * n, j * n, _tile(seg, i, n, 1), sb, window)
            p = jnp.exp(s - _tile(lse, i, n, 3)[..., None])
            dv = dv + jnp.einsum("bkgts,bkgte->bkse", p.astype(do.dtype), doa, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgte,bkse->bkgts", doa, vb, preferred_element_type=jnp.float32)
            ds = (p * (dp - _tile(d, i, n, 3)[..., None]) * scale).astype(q.dtype)
            dqa = _tile(dq, i, n, 3) + jnp.einsum("bkgts,bkse->bkgte", ds, kb, preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bkgts,bkgte->bkse", ds, qa, preferred_element_type=jnp.float32)
            return dk, dv, jax.lax.dynamic_update_slice_in_dim(dq, dqa, i * n, 3)
        last = tiles if not window else jnp.minimum(tiles, (j * n + n - 1 + window - 1) // n + 1)
        zeros = jnp.zeros(kb.shape, jnp.float32)
        dk, dv, dq = jax.lax.fori_loop(j, last, query_tile, (zeros, zeros, grads[0]))
        put = lambda whole, x: jax.lax.dynamic_update_slice_in_dim(whole, x, j * n, 2)  # noqa: E731
        return dq, put(grads[1], dk), put(grads[2], dv)
    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    dq, dk, dv = jax.lax.fori_loop(0, tiles, key_tile, (zeros(q), zeros(k), zeros(v)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None if seg is None else jnp.zeros_like(seg)


# causal attention (B, K, G, T, E) of T a multiple of the tile n; as fast_cpu's `_attention`; with sinks
flash = with_backward(_forward, _backward)
flash_sinks = with_sinks(_forward, _backward)
