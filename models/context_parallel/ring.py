"""Ring attention over `context` (train.context_attention=ring; models/context_parallel/gather.py): each rank's K/V block travels
the ring of context ranks by `shift` (a ppermute), C - 1 times, and the rank's queries attend to each block as it
passes, merged by an online softmax; a rank holds its own block and the one passing, never the row's K/V.

Causality, windows and documents by the tokens' original positions (the blocks carry their keys' positions and
documents with them). Its own backward (a custom VJP): the K/V blocks travel the ring again with their float32 dK/dV
accumulators, which come home with one more step (in K's dtype); the forward keeps only the rank's q, k, v, output
and log-sum-exp (autodiff through the ring would keep every block that passed). Gemma's soft-cap and score scale are
applied per block. Letters as models/kernels/fast_cpu.py: q (B, K, G, T, E) grouped by kv head, k and v (B, K, T, E).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models.kernels.attention import position_mask
from models.kernels.fast_cpu import _group, _kv, _ungroup

Q, KV = ("batch", "seq", "heads", "head_dim"), ("batch", "seq", "kv_heads", "head_dim")


def _scores(q, k, scale, pos_q, pos_k, seg_q, seg_k, window, softcap):
    """(scores as the softmax takes them (B, K, G, Tq, S) float32, -inf where a query may not see a key; the
    soft-capped ones before masking, for the soft-cap's derivative (None without one))."""
    s = jnp.einsum("bkgte,bkse->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    capped = None
    if softcap is not None:
        s = capped = softcap * jnp.tanh(s / softcap)
    keep = position_mask((pos_q, pos_k), None if seg_q is None else (seg_q, seg_k), window)
    return jnp.where(keep, s, -jnp.inf), capped


def _shift(coll, xs):
    return tuple(None if x is None else coll.shift(x, "seq") for x in xs)


def _forward(coll, scale, window, softcap, q, k, v, pos, seg):
    """(output (B, K, G, T, E) in q's dtype, log-sum-exp (B, K, G, T) float32)."""
    C = coll.axis_size("seq")

    def attend(state, block):
        m, l, acc = state
        kb, vb, pb, sb = block
        s, _ = _scores(q, kb, scale, pos, pb, seg, sb, window, softcap)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        base = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # a query that has seen no key yet keeps 0
        p = jnp.exp(s - base[..., None])
        keep = jnp.exp(jnp.where(jnp.isneginf(m), -jnp.inf, m - base))
        acc = acc * keep[..., None] + jnp.einsum("bkgts,bkse->bkgte", p.astype(vb.dtype), vb,
                                                 preferred_element_type=jnp.float32)
        return m_new, l * keep + jnp.sum(p, axis=-1), acc

    def step(carry, _):
        state, block = carry
        return (attend(state, block), _shift(coll, block)), None
    state = (jnp.full(q.shape[:4], -jnp.inf, jnp.float32), jnp.zeros(q.shape[:4], jnp.float32),
             jnp.zeros(q.shape, jnp.float32))
    block = (k, v, pos, seg)
    if C > 1:
        (state, block), _ = jax.lax.scan(step, (state, block), None, length=C - 1)
    m, l, acc = attend(state, block)
    return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring(coll, scale, window, softcap, q, k, v, pos, seg):
    return _forward(coll, scale, window, softcap, q, k, v, pos, seg)[0]


def _ring_fwd(coll, scale, window, softcap, q, k, v, pos, seg):
    o, lse = _forward(coll, scale, window, softcap, q, k, v, pos, seg)
    return o, (q, k, v, o, lse, pos, seg)


def _ring_bwd(coll, scale, window, softcap, res, do):
    q, k, v, o, lse, pos, seg = res
    C = coll.axis_size("seq")
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)

    def grads(dq, block):
        kb, vb, pb, sb, dkb, dvb = block
        s, capped = _scores(q, kb, scale, pos, pb, seg, sb, window, softcap)
        p = jnp.exp(s - lse[..., None])
        dvb = dvb + jnp.einsum("bkgts,bkgte->bkse", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgte,bkse->bkgts", do, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - d[..., None])
        if capped is not None:  # through softcap * tanh(s / softcap)
            ds = ds * (1.0 - jnp.square(capped / softcap))
        ds = (ds * scale).astype(q.dtype)
        dq = dq + jnp.einsum("bkgts,bkse->bkgte", ds, kb, preferred_element_type=jnp.float32)
        dkb = dkb + jnp.einsum("bkgts,bkgte->bkse", ds, q, preferred_element_type=jnp.float32)
        return dq, (kb, vb, pb, sb, dkb, dvb)

    def step(carry, _):
        dq, block = grads(*carry)
        return (dq, _shift(coll, block)), None
    block = (k, v, pos, seg, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq = jnp.zeros(q.shape, jnp.float32)
    if C > 1:
        (dq, block), _ = jax.lax.scan(step, (dq, block), None, length=C - 1)
    dq, block = grads(dq, block)
    # the accumulators home: one more step, in k's dtype (the cast first: half the bytes in bfloat16, the same values)
    dk, dv = block[4].astype(k.dtype), block[5].astype(v.dtype)
    dk, dv = _shift(coll, (dk, dv)) if C > 1 else (dk, dv)
    zeros = lambda x: None if x is None else jnp.zeros_like(x)  # noqa: E731
    return dq.astype(q.dtype), dk, dv, zeros(pos), zeros(seg)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring(kernel, coll, positions_T):
    """(q, k, v, segments=) -> o by ring attention, in a region manual over every mesh axis. `kernel`'s window (a
    uniform one, models/layers.py) applies; a family's own window, soft-cap and scale come as options."""
    own = getattr(kernel, "keywords", {}).get("window")

    def attend(q_BTHE, k_BTKE, v_BTKE, segments=None, window=None, softcap=None, scale=None, windows=None):
        window = own if window is None else window

        def rank(q, k, v, pos, *seg):
            K, E = k.shape[2], q.shape[-1]
            o = _ring(coll, E ** -0.5 if scale is None else scale, window or None if isinstance(window, int) else
                      window, softcap, _group(q, K), _kv(k), _kv(v), pos, seg[0] if seg else None)
            return _ungroup(o)
        args, axes = (q_BTHE, k_BTKE, v_BTKE, positions_T), (Q, KV, KV, ("seq",))
        if segments is not None:
            args, axes = args + (segments,), axes + (("batch", "seq"),)
        return coll.region(rank, axes, Q)(*args)
    return attend
