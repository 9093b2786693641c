"""Context parallelism in the model: every row's tokens split over the `context` mesh axis (the run's rules map the
logical axis `seq` to it), each device holding T/C tokens of each of its rows.

Everything but attention works token by token (embeddings, norms, MLPs, the loss) and needs nothing here.
Attention needs the keys of the whole row: `all_gather` gathers each layer's K and V (and the keys' positions and
documents) over `context`, puts them in position order and attends the rank's own queries to them with
models/kernels/flash_blocks.py, causality and documents by position, not by index, skipping the key tiles that
causality hides; its backward gathers K and V again and reduce-scatters dK and dV back. `all_to_all`
trades the sequence split for a split of the heads for attention (Ulysses) and back; `ring` passes each rank's K/V
block around the ring of context ranks and never holds the row's K/V (models/context_parallel/ring.py).

Causal load balancing (`order`): with the row split in C contiguous chunks, rank C-1's queries see every key and
rank 0's only its own; the trainer reorders each row once, at the step's start, so that rank i holds the chunks i and
2C-1-i of 2C (Megatron-LM's and torchtitan's head-tail order): every rank then sees as many keys. RoPE and the masks
take the tokens' original positions; the loss is a sum over tokens, so its order does not matter.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.context_parallel.blockwise import Q, KV, blockwise
from models.kernels import flash_blocks as fb
from models.kernels.flash_cpu import sink_grad, sunk

STRATEGIES = ("all_gather", "all_to_all", "ring")


def order(T: int, ranks: int, balance: bool) -> np.ndarray:
    """The original index of each token in the reordered row (T,) int32: rank i's T/C tokens are chunks i and
    2C-1-i of 2C where `balance`, else the row as it is."""
    if not balance or ranks == 1:
        return np.arange(T, dtype=np.int32)
    chunks = np.arange(T, dtype=np.int32).reshape(2 * ranks, T // (2 * ranks))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * ranks - 1 - i]]) for i in range(ranks)])


class ContextPlan(NamedTuple):
    """How the model runs under context parallelism (models/layers.py Placement.context): the context ranks, the
    attention strategy (STRATEGIES) and the original index of each token of the reordered row (`order`)."""
    ranks: int
    strategy: str
    order: tuple

    def positions(self, collectives, T: int):
        """The original indices (float32) of the T tokens the code holds: the whole row's where it sees all of
        it (the compiler partitions `context`), else this rank's chunk (manual over `context`)."""
        full = jnp.asarray(np.asarray(self.order, np.float32))
        if T == len(self.order):
            return full
        return jax.lax.dynamic_slice_in_dim(full, collectives.axis_index("seq") * T, T)

    def attention(self, kernel, collectives, positions_T):
        """The attention strategy (LayerCall.attention) for this plan, `kernel` (models/kernels/attention.py `attention`
        with the model's options) inside: all_gather (each rank's queries against the gathered keys, by position,
        with models/kernels/flash_blocks.py), ring (models/context_parallel/ring.py) or all_to_all (whole rows of a
        group of heads on each rank, by index, with `kernel`)."""
        balanced = self.order != tuple(range(len(self.order)))
        if self.strategy == "all_to_all":
            return all_to_all(kernel, collectives, np.asarray(self.order, np.int64))
        if self.strategy == "ring":
            from models.context_parallel.ring import ring
            return ring(kernel, collectives, positions_T, balanced=balanced)
        return all_gather(kernel, collectives, positions_T, np.asarray(self.order, np.int64))


def _runs(perm) -> tuple:
    """perm (n,) as its maximal runs of consecutive values ((start, length), ...): x[perm] is the runs' slices of x
    concatenated (2C slices for the balanced order, one for the row as it is: no gather)."""
    perm = np.asarray(perm)
    return tuple((int(r[0]), len(r)) for r in np.split(perm, np.flatnonzero(np.diff(perm) != 1) + 1))


def _take(x, runs, axis: int):
    if x is None or runs == ((0, x.shape[axis]),):
        return x
    return jnp.concatenate([jax.lax.slice_in_dim(x, s, s + n, axis=axis) for s, n in runs], axis)


def _row(coll, runs, k, v, pos, seg):
    """The row's K, V (B, K, T, E), positions and documents: gathered over `context`, in position order."""
    g = lambda x, axis: None if x is None else _take(coll.all_gather(x, "seq", axis), runs[0], axis)  # noqa: E731
    return g(k, 2), g(v, 2), g(pos, 0), g(seg, 1)


def _gathered_fwd(coll, opts, runs, q, k, v, pos, seg, window, z):
    scale, softcap, tile = opts
    kk, vv, pk, sk = _row(coll, runs, k, v, pos, seg)
    o, lse = fb.forward(q, kk, vv, fb.Mask(pos, pk, seg, sk, window), scale, softcap, tile)
    o = o.astype(q.dtype)
    if z is not None:  # the sinks join each query's softmax once, over the whole row's keys
        o, lse = sunk(o, lse, z)
    # the rank's own q, k, v, output and log-sum-exp: the backward gathers K and V again (autodiff would keep the
    # row's)
    return o, (q, k, v, o, lse, pos, seg, window, z)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _gathered(coll, opts, runs, q, k, v, pos, seg, window, z):
    return _gathered_fwd(coll, opts, runs, q, k, v, pos, seg, window, z)[0]


def _gathered_bwd(coll, opts, runs, res, do):
    q, k, v, o, lse, pos, seg, window, z = res
    scale, softcap, tile = opts
    kk, vv, pk, sk = _row(coll, runs, k, v, pos, seg)
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    # dK and dV of the row in K's and V's dtype (each key tile's whole sum is made in float32 in one call), back in
    # the ranks' order and reduce-scattered: each rank's block summed over every rank's queries
    dq, dk, dv = fb.backward(q, kk, vv, fb.Mask(pos, pk, seg, sk, window), scale, lse, do, d, softcap, tile=tile)
    dk, dv = (coll.reduce_scatter(_take(x, runs[1], 2), "seq", 2) for x in (dk, dv))
    zeros = lambda x: None if x is None else jnp.zeros_like(x)  # noqa: E731
    dz = None if z is None else sink_grad(o, lse, z, do)
    return dq.astype(q.dtype), dk, dv, zeros(pos), zeros(seg), zeros(window), dz


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def all_gather(kernel, coll, positions_T, order_T):
    """(q, k, v, segments=) -> o: K, V, the keys' positions and documents gathered over `context` and put in
    position order (slices of the gathered row, `order_T` being the ranks' order of the row), the rank's queries
    attending to them with models/kernels/flash_blocks.py (key tiles after a query tile's last position, or before
    its window, are skipped: a balanced rank attends about 1/C of the row's pairs); its backward gathers K and V
    again and reduce-scatters dK and dV."""
    runs = (_runs(np.argsort(order_T)), _runs(order_T))  # the gathered row into position order, and back

    def core(opts, q, k, v, pos, seg, window, z):
        return _gathered(coll, opts, runs, q, k, v, pos, seg, window, z)
    return blockwise(kernel, coll, positions_T, core)


def _repeat_for(k, ranks: int):
    """k (B, T, K, E) with each kv head repeated so that the ranks split the heads evenly and each rank's kv heads
    stay those of its query heads: r = ranks / gcd(K, ranks) copies, side by side (r = 1: as it is)."""
    r = ranks // np.gcd(k.shape[2], ranks)
    return k if r == 1 else jnp.repeat(k, r, axis=2)


def all_to_all(kernel, coll, order_T):
    """(q, k, v, segments=) -> o, DeepSpeed-Ulysses' form: an all-to-all over `context` turns each rank's chunk of
    every head into whole rows of its group of heads (kv heads repeated where their count does not split), the row
    put back in its original order (load balancing reordered it) and attended by `kernel` as a whole row (by
    index: any kernel, documents and windows included), then reordered and turned back by the reverse all-to-all.
    Needs each rank's heads to split over the context ranks (config validation)."""
    back = np.argsort(order_T)  # the reordered row's index of each original position

    def attend(q_BTHE, k_BTKE, v_BTKE, segments=None, sinks=None, **options):
        traced = options.get("window") is not None and not isinstance(options["window"], int)

        def rank(q, k, v, *more):
            seg, z = (more[0] if segments is not None else None), (more[-1] if sinks is not None else None)
            if traced:  # a stack whose layers differ in window: this layer's, an argument (a closure's tracer
                options["window"] = more[1 if segments is not None else 0]  # belongs to the mesh outside)
            C = coll.axis_size("seq")
            k, v = _repeat_for(k, C), _repeat_for(v, C)
            # block j of the heads to rank j; each rank's chunk arrives as block i of the row: the reordered row
            q, k, v = (coll.all_to_all(x, "seq", 2, 1)[:, back] for x in (q, k, v))
            whole = coll.all_gather(seg, "seq", 1)[:, back] if seg is not None else None
            if z is not None:  # the sinks of the rank's block of heads
                options["sinks"] = z.reshape(C, -1)[coll.axis_index("seq")]
            o = kernel(q, k, v, segments=whole, **options)
            return coll.all_to_all(o[:, order_T], "seq", 1, 2)
        args, axes = (q_BTHE, k_BTKE, v_BTKE), (Q, KV, KV)
        if segments is not None:
            args, axes = args + (segments,), axes + (("batch", "seq"),)
        if traced:
            args, axes = args + (options["window"],), axes + ((),)
        if sinks is not None:
            args, axes = args + (sinks,), axes + (("heads",),)
        return coll.region(rank, axes, Q)(*args)
    return attend
