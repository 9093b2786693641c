"""Blockwise attention of a block of queries against a block of keys by the tokens' positions (FlashAttention's order),
for context parallelism: the ring attends each passing K/V block with it, merging the blocks' outputs by their
log-sum-exps (an online softmax over blocks), and the all-gather the row's gathered keys; its backward takes the row's
output and log-sum-exp, as FlashAttention's does, and returns the block's dQ, dK and dV.

Tiles of nq queries and nk keys: a query tile loops over the key tiles it can see, found from the tiles' smallest and
largest positions, so causality and a window skip whole tiles and documents mask inside one; the backward loops over
key tiles and, in each, over the query tiles that see it. Each block's positions must increase along it, as a context
rank's do (a balanced rank holds chunk i and the later chunk 2C-1-i). Only one tile pair's scores exist at a time:
no (Tq, S) array of scores or masks. The softmax scale is a parameter and the value width F need not be the key's E.

Letters: q (B, K, G, Tq, E) grouped by kv head, k (B, K, S, E), v (B, K, S, F); positions pq (Tq,) and pk (S,);
segments sq (B, Tq) and sk (B, S), or None; window (tokens a query sees back, itself included) and softcap, or None.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.kernels.attention import position_mask
from models.kernels.flash_cpu import _tile as _cut, online

TILE = 512


class Mask(NamedTuple):
    """What decides which key a query sees: positions, documents (segments) and the window."""
    pq: jax.Array
    pk: jax.Array
    sq: jax.Array | None
    sk: jax.Array | None
    window: jax.Array | int | None  # the strategies pass a float32 scalar (a stack's layers may trace it)


def tile_for(n: int, tile: int = TILE) -> int:
    """The largest divisor of n up to `tile`."""
    return max(d for d in range(1, min(n, tile) + 1) if n % d == 0)


def _loop(first, last, tiles: int, body, init):
    """body(i, carry) for i in first..last-1, over at most `tiles` tiles; over one, its body once, no loop: the bounds
    only skip work (a tile nothing sees computes nothing: -inf scores, p = 0), and a loop costs compile time.

    A while loop whatever the bounds, never a scan (fori_loop's form for static bounds): differentiating a layer
    that calls this kernel's custom VJP inlines its forward, and JAX's partial evaluation splits a scan into what
    depends on the positions only (every tile's mask) and the rest, running the first as a loop of its own and
    keeping its outputs stacked for the second: the ring's step at 131,072 tokens over 8 v5p chips kept
    pred[7, 8, 16, 1, 12, 1, 1024, 1024] of masks (11 GB; XLA:TPU temp 33 GB for the 125m). A while loop is not
    split. Constant bounds still give XLA its trip count."""
    if tiles == 1:
        return body(0, init)
    out = jax.lax.while_loop(lambda c: c[0] < last, lambda c: (c[0] + 1, body(c[0], c[1])),
                             (jnp.asarray(first, jnp.int32), init))
    return out[1]


def _ends(p, n):
    """Each tile's smallest and largest position (positions increase along the block)."""
    t = p.reshape(-1, n)
    return t[:, 0], t[:, -1]


def _scores(qa, kb, scale, softcap, mask: Mask, pa, pb, sa, sb):
    """(scores (B, K, G, nq, nk) float32, -inf where a query may not see a key (models/kernels/attention.py
    `position_mask`); the soft-capped scores before masking, for the soft-cap's derivative, or None)."""
    s = jnp.einsum("bkgte,bkse->bkgts", qa, kb, preferred_element_type=jnp.float32) * scale
    capped = None
    if softcap is not None:
        s = capped = softcap * jnp.tanh(s / softcap)
    keep = position_mask((pa, pb), None if sa is None else (sa, sb), mask.window)
    return jnp.where(keep, s, -jnp.inf), capped


def forward(q, k, v, mask: Mask, scale: float, softcap=None, tile: int = TILE, skip: bool = True):
    """(output (B, K, G, Tq, F) float32, log-sum-exp (B, K, G, Tq) float32) of q against this block's keys; a query
    that sees none of them has output 0 and log-sum-exp -inf. skip=False: every tile pair, in loops of a fixed
    length (a caller that knows every query may see every key: the ring's half blocks)."""
    B, K, G, Tq, _ = q.shape
    S, F = k.shape[2], v.shape[-1]
    nq, nk = tile_for(Tq, tile), tile_for(S, tile)
    q_lo, q_hi = _ends(mask.pq, nq)
    k_lo, k_hi = _ends(mask.pk, nk)

    def query_tile(i, out):
        qa, pa, sa = _cut(q, i, nq, 3), _cut(mask.pq, i, nq, 0), _cut(mask.sq, i, nq, 1)

        def key_tile(j, state):
            s, _ = _scores(qa, _cut(k, j, nk, 2), scale, softcap, mask, pa, _cut(mask.pk, j, nk, 0), sa,
                           _cut(mask.sk, j, nk, 1))
            return online(state, s, _cut(v, j, nk, 2))
        # the key tiles this query tile sees: from the first whose last key is inside the window to the last whose
        # first key is not after the tile's last query
        last = jnp.sum(k_lo <= q_hi[i]) if skip else S // nk
        first = 0 if mask.window is None or not skip else jnp.sum(k_hi <= q_lo[i] - mask.window)
        m, l, acc = _loop(first, last, S // nk, key_tile, (
            jnp.full((B, K, G, nq), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, nq), jnp.float32),
            jnp.zeros((B, K, G, nq, F), jnp.float32)))
        seen = l > 0
        o = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        put = lambda whole, x: jax.lax.dynamic_update_slice_in_dim(whole, x, i * nq, 3)  # noqa: E731
        return put(out[0], o), put(out[1], lse)
    return _loop(0, Tq // nq, Tq // nq, query_tile, (jnp.zeros((B, K, G, Tq, F), jnp.float32),
                                                     jnp.full((B, K, G, Tq), -jnp.inf, jnp.float32)))


def backward(q, k, v, mask: Mask, scale: float, lse, do, d, softcap=None, into=None, tile: int = TILE,
             skip: bool = True):
    """(dQ (B, K, G, Tq, E) float32, dK (B, K, S, E), dV (B, K, S, F)) of this block's part of the attention, given
    the row's log-sum-exp `lse` and output gradient `do`, and d = sum(do * o) over F with the row's output o; added to
    `into`'s three accumulators in place where given (in their dtypes), else dK and dV in k's and v's dtype (each
    key tile's sum is whole in one call, made in float32); `skip` as forward's."""
    Tq, S = q.shape[3], k.shape[2]
    nq, nk = tile_for(Tq, tile), tile_for(S, tile)
    q_lo, q_hi = _ends(mask.pq, nq)
    k_lo, k_hi = _ends(mask.pk, nk)
    lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)  # a query that saw no key: p = exp(-inf - inf) = 0

    def key_tile(j, grads):
        kb, vb, pb, sb = _cut(k, j, nk, 2), _cut(v, j, nk, 2), _cut(mask.pk, j, nk, 0), _cut(mask.sk, j, nk, 1)

        def query_tile(i, state):
            dk, dv, dq = state
            qa, doa = _cut(q, i, nq, 3), _cut(do, i, nq, 3)
            s, capped = _scores(qa, kb, scale, softcap, mask, _cut(mask.pq, i, nq, 0), pb, _cut(mask.sq, i, nq, 1),
                                sb)
            p = jnp.exp(s - _cut(lse, i, nq, 3)[..., None])
            dv = dv + jnp.einsum("bkgts,bkgtf->bksf", p.astype(do.dtype), doa, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgtf,bksf->bkgts", doa, vb, preferred_element_type=jnp.float32)
            ds = p * (dp - _cut(d, i, nq, 3)[..., None])
            if capped is not None:  # through softcap * tanh(s / softcap)
                ds = ds * (1.0 - jnp.square(capped / softcap))
            ds = (ds * scale).astype(q.dtype)
            dqa = _cut(dq, i, nq, 3) + jnp.einsum("bkgts,bkse->bkgte", ds, kb, preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bkgts,bkgte->bkse", ds, qa, preferred_element_type=jnp.float32)
            return dk, dv, jax.lax.dynamic_update_slice_in_dim(dq, dqa, i * nq, 3)
        # the query tiles that see this key tile: from the first whose last query is not before its first key to
        # the last whose first query is inside the window of its last key
        first = jnp.sum(q_hi < k_lo[j]) if skip else 0
        last = Tq // nq if mask.window is None or not skip else jnp.sum(q_lo < k_hi[j] + mask.window)
        f32 = lambda x: _cut(x, j, nk, 2).astype(jnp.float32)  # noqa: E731
        dk, dv, dq = _loop(first, last, Tq // nq, query_tile, (f32(grads[1]), f32(grads[2]), grads[0]))
        put = lambda whole, x: jax.lax.dynamic_update_slice_in_dim(whole, x.astype(whole.dtype), j * nk, 2)  # noqa
        return dq, put(grads[1], dk), put(grads[2], dv)
    return _loop(0, S // nk, S // nk, key_tile, into or (jnp.zeros(q.shape, jnp.float32), jnp.zeros_like(k),
                                                          jnp.zeros_like(v)))


def merge(o, lse, o_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys as one: (output, log-sum-exp), float32."""
    new = jnp.logaddexp(lse, lse_b)
    safe = jnp.where(jnp.isneginf(new), 0.0, new)
    w, w_b = jnp.exp(lse - safe), jnp.exp(lse_b - safe)
    return o * w[..., None] + o_b * w_b[..., None], new
