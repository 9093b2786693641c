"""XLA:CPU fast paths: drop-in replacements for the plain functions of models/transformer.py.

Each equals its plain counterpart in exact arithmetic (tests/test_fast_paths.py checks forward
and gradients in float32); each is here because XLA:CPU runs the plain form measurably slower
(docs/performance.md). `models.layers.kernels_for` picks them: by default on CPU only.

  project            shared backward for same-shaped projections (custom VJP)
  silu               x * sigmoid(x) through tanh
  apply_rope         rotate-half without splitting and concatenating the halves
  causal_attention   attention with a hand-written, FlashAttention-style backward (below); from LOOPS_FROM
                     tokens on as loops over tiles (models/kernels/flash_cpu.py)

causal_attention(q, k, v) equals jax.nn.dot_product_attention(q, k, v, is_causal=True) for
q (B, T, H, E) and k, v (B, T, K, E) with H a multiple of K. What differs is what is kept for the
backward pass and how it is computed:

  forward   S = Q K^T / sqrt(E), masked;  m = rowmax S;  P~ = exp(S - m);  l = rowsum P~
            O = (P~ V) / l  (normalised after the product: T x E divides instead of T x T)
            saved: Q, K, V, O and the log-sum-exp L = m + log l  (no T x T array)
  backward  P = exp(S - L) from a recomputed S;  dV = P^T dO;  dP = dO V^T
            D = rowsum(dO * O)  (T x E work, not T x T: rowsum(P * dP) = rowsum(dO * O))
            dS = P * (dP - D);  dQ = dS K / sqrt(E);  dK = dS^T Q / sqrt(E)

With autodiff through the plain softmax, XLA:CPU stores the T x T probabilities of every layer,
zero-fills and slices them through the layer loop, and runs the softmax backward as several
T x T passes; here the backward has one recomputed QK^T and two T x T elementwise passes.
Queries are grouped by their kv head, (B, K, G, T, E), so K/V are never repeated for GQA.
Scores, softmax and L are float32 whatever the input dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.kernels.flash_cpu import LOOPS_FROM, TILE, flash, flash_sinks, with_backward, with_sinks

# ----------------------------------------------------------------------------- projections


@jax.custom_vjp
def projections(h_ND, weights):
    """[h @ w for w in weights] for same-shaped weights (D, ...), with one backward for all.

    The forward runs one matmul per weight. The backward stacks the output gradients on a new
    axis after N, (N, n, ...), and runs two matmuls in all: dh = G W^T over (n, ...) at once,
    and dW = h^T G with an n-times wider output, where XLA:CPU's h^T G with a narrow output
    runs at half its matmul rate. (A new axis rather than a concatenation keeps a
    tensor-parallel split of the last dims where it is.) Under tensor parallelism the group's
    input gradient is also one all-reduce instead of one per weight (docs/plan.md)."""
    return [jnp.einsum("nd,d...->n...", h_ND, w) for w in weights]


def _projections_fwd(h_ND, weights):
    return projections(h_ND, weights), (h_ND, weights)


def _projections_bwd(res, gs):
    h_ND, weights = res
    if len(weights) == 1:
        g, w = gs[0], weights[0]
        dw = jnp.einsum("nd,n...->d...", h_ND, g)
        return jnp.einsum("n...,d...->nd", g, w), (dw,)
    g = jnp.stack(gs, axis=1)  # (N, n, ...)
    w = jnp.stack(weights, axis=1)  # (D, n, ...)
    dh = jnp.einsum("nc...,dc...->nd", g, w)
    dw = jnp.einsum("nd,nc...->dc...", h_ND, g)
    return dh, tuple(dw[:, i] for i in range(len(weights)))


projections.defvjp(_projections_fwd, _projections_bwd)


def project(x_BTD, weights):
    """[x @ w for w in weights] (w of shape (D, ...)) through `projections`, on the tokens
    flattened to N = B*T rows: XLA:CPU runs a 2-D matmul and its weight gradient about 1.5x
    faster than the same einsum with two batch-like dims. Outputs are named "projection":
    a custom_vjp is opaque to the `dots` remat policy, which would otherwise not save them."""
    lead, D = x_BTD.shape[:-1], x_BTD.shape[-1]
    outs = projections(x_BTD.reshape(-1, D), tuple(weights))
    return [checkpoint_name(o, "projection").reshape(lead + o.shape[1:]) for o in outs]


# ----------------------------------------------------------------------------- elementwise

def silu(x):
    """x * sigmoid(x) with sigmoid(x) = (1 + tanh(x/2)) / 2: no exp and no division, which
    XLA:CPU runs as a slow pair of loops."""
    return x * (0.5 + 0.5 * jnp.tanh(0.5 * x))


def apply_rope(x_BTNE, cos_TE2, sin_TE2, offset=0):
    """Rotate pairs (first half, second half) of head_dim, as x * cos + swap(x) * (-sin, +sin)
    with swap = reversing the two halves: one elementwise loop, where splitting and
    concatenating the halves ran as separate, slow concatenate fusions (forward and backward)."""
    B, T, N, E = x_BTNE.shape
    if cos_TE2.ndim == 3:  # (B, T, E/2): each token's own position -> (B, T, 1, 1, E/2)
        cos, sin = cos_TE2[:, :, None, None, :], sin_TE2[:, :, None, None, :]
    else:
        cos = jax.lax.dynamic_slice_in_dim(cos_TE2, offset, T)[:, None, None, :]  # (T, 1, 1, E/2)
        sin = jax.lax.dynamic_slice_in_dim(sin_TE2, offset, T)[:, None, None, :]
    sign = jnp.array([-1.0, 1.0], jnp.float32)[:, None]  # (2, 1): first half gets -x2 sin
    x = x_BTNE.astype(jnp.float32).reshape(B, T, N, 2, E // 2)
    out = x * cos + x[..., ::-1, :] * (sign * sin)
    return out.reshape(B, T, N, E).astype(x_BTNE.dtype)


# ----------------------------------------------------------------------------- attention

def _group(q_BTHE, K):
    B, T, H, E = q_BTHE.shape
    return q_BTHE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, E)


def _ungroup(x_BKGTE):
    B, K, G, T, E = x_BKGTE.shape
    return x_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, E)


def _kv(x_BSKE):
    return x_BSKE.transpose(0, 2, 1, 3)  # (B, K, S, E)


def _scores(q, k, scale, offset, seg_q=None, seg_k=None, lo=0, window=None, pos=None):
    """Scaled scores (B, K, G, Tq, S) in float32 of queries at positions offset.. against keys
    lo..lo+S-1; keys after a query's position are at -inf (only the last Tq keys can be), with a window
    so are keys `window` or more positions before it, and with segments (B, Tq) and (B, S) so are keys of
    another segment (a token always sees itself). `pos` = (the queries' positions (Tq,), the keys' (S,)): the
    positions are those, not the indices (a chunk of a sequence against keys gathered from elsewhere)."""
    s = jnp.einsum("bkgte,bkse->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    Tq, S = s.shape[-2:]
    if pos is None:
        q_pos, k_pos = jnp.arange(Tq)[:, None] + offset, jnp.arange(S)[None, :]
        k_pos = k_pos + lo if lo else k_pos
    else:
        q_pos, k_pos = pos[0][:, None], pos[1][None, :]
    keep = q_pos >= k_pos
    if window:
        keep = keep & (q_pos - k_pos < window)
    if seg_q is not None:
        keep = keep & (seg_q[:, None, None, :, None] == seg_k[:, None, None, None, :])
    return jnp.where(keep, s, -jnp.inf)


def _blocks(T, block, window=None):
    """Query blocks (start, stop, first key): block i needs keys first..stop-1 only (the causal saving; with a
    window, keys before start - window + 1 are skipped too)."""
    if block <= 0 or T % block or T <= block:
        return [(0, T, 0)]
    return [(a, a + block, max(0, a - window + 1) if window else 0) for a in range(0, T, block)]


def _seg(seg, a, b, lo):
    return (None, None) if seg is None else (seg[:, a:b], seg[:, lo:b])


def _forward(q, k, v, scale, block, seg=None, window=None):
    outs, lses = [], []
    for a, b, lo in _blocks(q.shape[3], block, window):
        s = _scores(q[:, :, :, a:b], k[:, :, lo:b], scale, a, *_seg(seg, a, b, lo), lo, window)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("bkgts,bkse->bkgte", p.astype(v.dtype), v[:, :, lo:b],
                       preferred_element_type=jnp.float32) / l
        outs.append(o.astype(q.dtype))
        lses.append((m + jnp.log(l))[..., 0])
    cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=3)  # noqa: E731
    return cat(outs), cat(lses)


def _attention_bwd(scale, block, window, res, do):
    q, k, v, o, lse, seg = res
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    dqs, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for a, b, lo in _blocks(q.shape[3], block, window):
        qa, doa, kb, vb = q[:, :, :, a:b], do[:, :, :, a:b], k[:, :, lo:b], v[:, :, lo:b]
        p = jnp.exp(_scores(qa, kb, scale, a, *_seg(seg, a, b, lo), lo, window) - lse[..., a:b, None])
        dv_b = jnp.einsum("bkgts,bkgte->bkse", p.astype(do.dtype), doa, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgte,bkse->bkgts", doa, vb, preferred_element_type=jnp.float32)
        ds = (p * (dp - d[..., a:b, :]) * scale).astype(q.dtype)
        dqs.append(jnp.einsum("bkgts,bkse->bkgte", ds, kb, preferred_element_type=jnp.float32))
        dk_b = jnp.einsum("bkgts,bkgte->bkse", ds, qa, preferred_element_type=jnp.float32)
        pad = ((0, 0), (0, 0), (lo, k.shape[2] - b), (0, 0))  # keys outside lo..b-1 get nothing from this block
        dk, dv = dk + jnp.pad(dk_b, pad), dv + jnp.pad(dv_b, pad)
    dq = dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=3)
    dseg = None if seg is None else jnp.zeros_like(seg)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dseg


_attention = with_backward(_forward, _attention_bwd)
_attention_sinks = with_sinks(_forward, _attention_bwd)


# ----------------------------------------------------------------------------- a chunk of a row, by position

def _query_blocks(x, block: int, axis: int):
    """x cut into blocks of `block` along `axis`, the blocks stacked first: (n, ...)."""
    n = x.shape[axis] // block
    return jnp.moveaxis(x.reshape(x.shape[:axis] + (n, block) + x.shape[axis + 1:]), axis, 0)


def _from_blocks(x, axis: int):
    """_query_blocks undone: (n, ..., block, ...) -> (..., n x block, ...)."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _chunk_forward(q, k, v, scale, block, seg, window, pos):
    """Each block of `block` queries against all S keys (their positions traced: nothing to skip), one block at a
    time in a scan: one block's scores live, whatever the number of blocks (unrolled, XLA:CPU kept them all)."""
    sk = None if seg is None else seg[1]

    def one(_, xs):
        qa, pa, sa = xs
        s = _scores(qa, k, scale, 0, sa, sk, 0, window, (pa, pos[1]))
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("bkgts,bkse->bkgte", p.astype(v.dtype), v, preferred_element_type=jnp.float32) / l
        return None, (o.astype(q.dtype), (m + jnp.log(l))[..., 0])
    xs = (_query_blocks(q, block, 3), pos[0].reshape(-1, block), None if seg is None else _query_blocks(seg[0], block, 1))
    o, lse = jax.lax.scan(one, None, xs)[1]
    return _from_blocks(o, 3), _from_blocks(lse, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 6))
def _chunk_attention(q, k, v, scale, block, seg, window, pos):
    return _chunk_forward(q, k, v, scale, block, seg, window, pos)[0]


def _chunk_attention_fwd(q, k, v, scale, block, seg, window, pos):
    o, lse = _chunk_forward(q, k, v, scale, block, seg, window, pos)
    return o, (q, k, v, o, lse, seg, pos)


def _chunk_attention_bwd(scale, block, window, res, do):
    q, k, v, o, lse, seg, pos = res
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    sk = None if seg is None else seg[1]

    def one(carry, xs):
        dk, dv = carry
        qa, doa, la, da, pa, sa = xs
        p = jnp.exp(_scores(qa, k, scale, 0, sa, sk, 0, window, (pa, pos[1])) - la[..., None])
        dv = dv + jnp.einsum("bkgts,bkgte->bkse", p.astype(doa.dtype), doa, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgte,bkse->bkgts", doa, v, preferred_element_type=jnp.float32)
        ds = (p * (dp - da) * scale).astype(q.dtype)
        dk = dk + jnp.einsum("bkgts,bkgte->bkse", ds, qa, preferred_element_type=jnp.float32)
        return (dk, dv), jnp.einsum("bkgts,bkse->bkgte", ds, k, preferred_element_type=jnp.float32)
    blocks = lambda x, axis=3: _query_blocks(x, block, axis)  # noqa: E731
    xs = (blocks(q), blocks(do), blocks(lse), blocks(d), pos[0].reshape(-1, block),
          None if seg is None else blocks(seg[0], 1))
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dk, dv), dq = jax.lax.scan(one, zeros, xs)
    like = lambda x: None if x is None else jax.tree.map(jnp.zeros_like, x)  # noqa: E731
    return _from_blocks(dq, 3).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), like(seg), like(pos)


_chunk_attention.defvjp(_chunk_attention_fwd, _chunk_attention_bwd)


def causal_attention(q_BTHE, k_BTKE, v_BTKE, block: int = 128, segments=None, window=None, positions=None,
                     sinks=None, loops: int | None = None):
    """Causal attention output (B, T, H, E) in causal query blocks of `block`; see the module docstring.
    segments (B, T): each token's document; attention then stays inside it (the same blocks: a block's
    keys of other documents are masked like its future ones). window: a query sees only the keys fewer than
    `window` positions before it, itself included (Mistral's sliding window); a block skips the keys no query of
    it sees. positions = (the queries' (Tq,), the keys' (S,), float32): causality (and the window) by those
    positions, k and v holding S keys, segments then a pair ((B, Tq), (B, S)): every block takes every key (the
    positions are traced: no block can be skipped), the blocks run one at a time in a scan (_chunk_forward).
    sinks (H,): each head's attention sink (flash_cpu.py `with_sinks`), whole rows only for now. `loops`: run the
    loops kernel in tiles of that many (default: from LOOPS_FROM tokens on, in tiles of TILE)."""
    K, E = k_BTKE.shape[2], q_BTHE.shape[-1]
    q, k, v = _group(q_BTHE, K), _kv(k_BTKE), _kv(v_BTKE)
    if positions is None:
        T = q_BTHE.shape[1]
        long = T >= LOOPS_FROM and T % TILE == 0
        n = loops or (TILE if long else block)
        loops = bool(loops) or long
        if sinks is not None:
            z = sinks.reshape(K, -1)
            return _ungroup((flash_sinks if loops else _attention_sinks)(q, k, v, z, 1.0 / E ** 0.5, n, segments,
                                                                        window or None))
        return _ungroup((flash if loops else _attention)(q, k, v, 1.0 / E ** 0.5, n, segments, window or None))
    if sinks is not None:
        raise NotImplementedError("attention sinks on a chunk of a row (context parallelism) are not built yet")
    T = q_BTHE.shape[1]
    block = block if 0 < block < T and T % block == 0 else T
    return _ungroup(_chunk_attention(q, k, v, 1.0 / E ** 0.5, block, segments, window or None, positions))
