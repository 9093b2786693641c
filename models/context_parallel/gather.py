"""Context parallelism in the model: every row's tokens split over the `context` mesh axis (the run's rules map the
logical axis `seq` to it), each device holding T/C tokens of each of its rows.

Everything but attention works token by token (embeddings, norms, MLPs, the loss) and needs nothing here.
Attention needs the keys of the whole row: `all_gather` gathers each layer's K and V (and the keys' positions and
documents) over `context` and attends the rank's own queries to them, causality and documents by position
(models/kernels/attention.py `positions`), not by index. Its transpose reduce-scatters dK and dV back. `all_to_all`
trades the sequence split for a split of the heads for attention (Ulysses) and back; `ring` passes each rank's K/V
block around the ring of context ranks and never holds the row's K/V (models/context_parallel/ring.py).

Causal load balancing (`order`): with the row split in C contiguous chunks, rank C-1's queries see every key and
rank 0's only its own; the trainer reorders each row once, at the step's start, so that rank i holds the chunks i and
2C-1-i of 2C (Megatron-LM's and torchtitan's head-tail order): every rank then sees as many keys. RoPE and the masks
take the tokens' original positions; the loss is a sum over tokens, so its order does not matter.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Q, KV = ("batch", "seq", "heads", "head_dim"), ("batch", "seq", "kv_heads", "head_dim")
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
        with the model's options) inside: all_gather (each rank's queries against the gathered keys, by position)
        or all_to_all (whole rows of a group of heads on each rank, by index)."""
        if self.strategy == "all_to_all":
            return all_to_all(kernel, collectives, np.asarray(self.order, np.int64))
        if self.strategy == "ring":
            from models.context_parallel.ring import ring
            return ring(kernel, collectives, positions_T, balanced=self.order != tuple(range(len(self.order))))
        return all_gather(kernel, collectives, positions_T)


def all_gather(kernel, coll, positions_T):
    """(q, k, v, segments=) -> o: K, V, the keys' positions and documents gathered over `context`, the rank's
    queries attended to them by position; in a region manual over every mesh axis."""
    def attend(q_BTHE, k_BTKE, v_BTKE, segments=None, **options):  # options: a family's window, softcap, scale
        def rank(q, k, v, pos_q, *seg):
            pos_k = coll.all_gather(pos_q, "seq", 0)
            k_all, v_all = coll.all_gather(k, "seq", 1), coll.all_gather(v, "seq", 1)
            pair = (seg[0], coll.all_gather(seg[0], "seq", 1)) if seg else None
            return kernel(q, k_all, v_all, segments=pair, positions=(pos_q, pos_k), **options)
        args, axes = (q_BTHE, k_BTKE, v_BTKE, positions_T), (Q, KV, KV, ("seq",))
        if segments is not None:
            args, axes = args + (segments,), axes + (("batch", "seq"),)
        # manual over every axis: a collective over `context` whose operand the compiler partitions over `model` is
        # replicated over it first (XLA gathered every kv head over `model`, then ran every rank's attention on all
        # of them), and with any axis automatic (`stage` of size 1 too) the reduce-scatter's reduction holds a
        # sharding annotation that XLA:CPU's bfloat16 promotion aborts on; each rank's heads attend alone
        return coll.region(rank, axes, Q)(*args)
    return attend


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

    def attend(q_BTHE, k_BTKE, v_BTKE, segments=None, **options):
        def rank(q, k, v, *seg):
            C = coll.axis_size("seq")
            k, v = _repeat_for(k, C), _repeat_for(v, C)
            # block j of the heads to rank j; each rank's chunk arrives as block i of the row: the reordered row
            q, k, v = (coll.all_to_all(x, "seq", 2, 1)[:, back] for x in (q, k, v))
            whole = coll.all_gather(seg[0], "seq", 1)[:, back] if seg else None
            o = kernel(q, k, v, segments=whole, **options)
            return coll.all_to_all(o[:, order_T], "seq", 1, 2)
        args, axes = (q_BTHE, k_BTKE, v_BTKE), (Q, KV, KV)
        if segments is not None:
            args, axes = args + (segments,), axes + (("batch", "seq"),)
        return coll.region(rank, axes, Q)(*args)
    return attend
