"""Ring attention over `context` (train.context_attention=ring; models/context_parallel/gather.py): each rank's K/V block travels
the ring of context ranks by `shift` (a ppermute), C - 1 times, and the rank's queries attend to each block as it
passes with models/kernels/flash_blocks.py (tile by tile, no (T/C, T/C) array), merged by their log-sum-exps; a rank
holds its own block and the one passing, never the row's K/V.

What the causal order hides is not computed. Balanced (rank r holds chunks r and 2C-1-r of 2C), a block from a source
s < r is seen by every query of the rank in its first chunk and in none of its second; from s > r, only the rank's
second chunk sees it, all of it. So each step after the first attends (T/C) x (T/2C) query-key pairs: the first half
of the keys or the second half of the queries, a lax.cond on the blocks' first positions choosing (the permute stays
outside it: every rank sends every step). Unbalanced, a block from a later rank is skipped. Inside a block the kernel
skips the tiles that causality or a window hides; documents mask within a tile.

Its own backward (a custom VJP): the K/V blocks travel the ring again with their float32 dK/dV accumulators, which
come home with one more step (in K's dtype); the forward keeps only the rank's q, k, v, output and log-sum-exp
(autodiff through the ring would keep every block that passed). Gemma's soft-cap and a family's own score scale
apply per tile. Letters as models/kernels/fast_cpu.py: q (B, K, G, T, E) grouped by kv head, k and v (B, K, T, E).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models.context_parallel.blockwise import blockwise
from models.kernels import flash_blocks as fb
from models.kernels.flash_cpu import sink_grad, sunk


def _shift(coll, xs):
    return tuple(None if x is None else coll.shift(x, "seq") for x in xs)


def _half(x, axis, second):
    """The first or second half of x along `axis` (None stays None)."""
    if x is None:
        return None
    h = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, h if second else 0, x.shape[axis] if second else h, axis=axis)


def _steps(n: int, body, carry):
    """body(carry) n times, in a while loop rather than a scan: differentiating a layer inlines the custom VJP's
    forward, and JAX's partial evaluation would split a scan's constants out of it and keep them stacked per step
    (the zeros each step's kernel starts from: f32[7, 1, 32, 1, 16384, 128] at 131,072 tokens over 8 ranks, 1.9 GB
    for a 7B; models/kernels/flash_blocks.py `_loop`)."""
    if n < 1:
        return carry
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[1])), (jnp.int32(0), carry))[1]


def _attend(opts, q, block, pos, seg, window, own=False):
    """(output (B, K, G, T, F) float32, log-sum-exp (B, K, G, T)) of the rank's queries against one K/V block."""
    scale, softcap, tile, balanced = opts
    kb, vb, pb, sb = block
    skip = window is not None  # off the diagonal causality hides nothing inside what is attended; a window may

    def whole(skip=skip):
        return fb.forward(q, kb, vb, fb.Mask(pos, pb, seg, sb, window), scale, softcap, tile, skip)
    if own:  # the diagonal block: causal inside, by position
        return whole(skip=True)
    nothing = (jnp.zeros(q.shape[:4] + vb.shape[-1:], jnp.float32), jnp.full(q.shape[:4], -jnp.inf, jnp.float32))
    before = pb[0] < pos[0]  # the block's first chunk precedes the rank's
    if not balanced:
        return jax.lax.cond(before, whole, lambda: nothing)

    def head():  # s < r: every query against the source's first chunk
        return fb.forward(q, _half(kb, 2, False), _half(vb, 2, False),
                          fb.Mask(pos, _half(pb, 0, False), seg, _half(sb, 1, False), window), scale, softcap, tile, skip)

    def tail():  # s > r: the rank's second chunk against the whole block
        o, lse = fb.forward(_half(q, 3, True), kb, vb, fb.Mask(_half(pos, 0, True), pb, _half(seg, 1, True), sb, window),
                            scale, softcap, tile, skip)
        return (jnp.concatenate([_half(nothing[0], 3, False), o], axis=3),
                jnp.concatenate([_half(nothing[1], 3, False), lse], axis=3))
    return jax.lax.cond(before, head, tail)


def _forward(coll, opts, q, k, v, pos, seg, window):
    """(output (B, K, G, T, E) in q's dtype, log-sum-exp (B, K, G, T) float32)."""
    block = (k, v, pos, seg)
    o, lse = _attend(opts, q, block, pos, seg, window, own=True)

    def step(carry):
        (o, lse), block = carry
        block = _shift(coll, block)
        return fb.merge(o, lse, *_attend(opts, q, block, pos, seg, window)), block
    (o, lse), _ = _steps(coll.axis_size("seq") - 1, step, ((o, lse), block))
    return o.astype(q.dtype), lse


# the window is an argument, not an option: a stack whose layers differ in window (Gemma's) traces it, and a
# custom_vjp's non-differentiable arguments may hold no tracer
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(coll, opts, q, k, v, pos, seg, window, z):
    return _ring_fwd(coll, opts, q, k, v, pos, seg, window, z)[0]


def _ring_fwd(coll, opts, q, k, v, pos, seg, window, z):
    o, lse = _forward(coll, opts, q, k, v, pos, seg, window)
    if z is not None:  # the sinks join the merged softmax once, after every block
        o, lse = sunk(o, lse, z)
    return o, (q, k, v, o, lse, pos, seg, window, z)


def _grads(opts, q, block, pos, seg, window, lse, do, d, dq, own=False):
    """The rank's queries' part of one block's gradients, added in place: (dq, the block's dK and dV accumulators)."""
    scale, softcap, tile, balanced = opts
    kb, vb, pb, sb, dkb, dvb = block
    skip = window is not None

    def whole(skip=skip):
        return fb.backward(q, kb, vb, fb.Mask(pos, pb, seg, sb, window), scale, lse, do, d, softcap, (dq, dkb, dvb), tile,
                           skip)
    if own:
        return whole(skip=True)
    before = pb[0] < pos[0]
    if not balanced:
        return jax.lax.cond(before, whole, lambda: (dq, dkb, dvb))
    h = kb.shape[2] // 2

    def head():
        first = lambda x: _half(x, 2, False)  # noqa: E731
        dq2, dk, dv = fb.backward(q, first(kb), first(vb), fb.Mask(pos, _half(pb, 0, False), seg, _half(sb, 1, False),
                                                                 window), scale, lse, do, d, softcap,
                                  (dq, first(dkb), first(dvb)), tile, skip)
        return dq2, jax.lax.dynamic_update_slice_in_dim(dkb, dk, 0, 2), jax.lax.dynamic_update_slice_in_dim(dvb, dv, 0, 2)

    def tail():
        second = lambda x, axis=3: _half(x, axis, True)  # noqa: E731
        dq_t, dk, dv = fb.backward(second(q), kb, vb, fb.Mask(second(pos, 0), pb, second(seg, 1), sb, window), scale,
                                   second(lse), second(do), second(d), softcap, (second(dq), dkb, dvb), tile, skip)
        return jax.lax.dynamic_update_slice_in_dim(dq, dq_t, h, 3), dk, dv
    return jax.lax.cond(before, head, tail)


def _ring_bwd(coll, opts, res, do):
    q, k, v, o, lse, pos, seg, window, z = res
    C = coll.axis_size("seq")
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    dq, dk, dv = _grads(opts, q, (k, v, pos, seg, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)),
                        pos, seg, window, lse, do, d, jnp.zeros(q.shape, jnp.float32), own=True)

    def step(carry):
        dq, block = carry
        block = _shift(coll, block)
        dq, dkb, dvb = _grads(opts, q, block, pos, seg, window, lse, do, d, dq)
        return dq, block[:4] + (dkb, dvb)
    if C > 1:
        dq, block = _steps(C - 1, step, (dq, (k, v, pos, seg, dk, dv)))
        # the accumulators home: one more step, in k's dtype (the cast first: half the bytes in bfloat16, the same
        # values)
        dk, dv = _shift(coll, (block[4].astype(k.dtype), block[5].astype(v.dtype)))
    else:
        dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    zeros = lambda x: None if x is None else jnp.zeros_like(x)  # noqa: E731
    dz = None if z is None else sink_grad(o, lse, z, do)
    return dq.astype(q.dtype), dk, dv, zeros(pos), zeros(seg), zeros(window), dz


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring(kernel, coll, positions_T, balanced: bool = False):
    """(q, k, v, segments=, window=, softcap=, scale=) -> o by ring attention, in a region manual over every mesh
    axis (models/context_parallel/blockwise.py: `kernel`'s window and block read, a family's options
    taken). `balanced`: the ranks hold the head-tail order (gather.py `order`), whose halves the steps skip."""

    def core(opts, q, k, v, pos, seg, window, z):
        return _ring(coll, opts + (balanced,), q, k, v, pos, seg, window, z)
    return blockwise(kernel, coll, positions_T, core)
