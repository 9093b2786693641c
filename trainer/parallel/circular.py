"""Circular pipeline schedules (V > 1 repeats): the stage's stored layers re-laid out into its blocks.

Stage s runs layer blocks s, s+S, s+2S, ... (V blocks of L/(S*V) layers; V = 1 is plain GPipe
with L/S consecutive layers). The layer weights (and their optimizer state) are stored (L, ...)
whatever the schedule, sharded over `stage` in contiguous slices of L/S layers, so a checkpoint
restores onto any mesh and V. With V > 1 the step re-lays the stage's slice out into its circular
blocks (`circular_blocks`) once per step, before the schedule; the gradients go back the same
way.

Every schedule (GPipe, circular GPipe, 1F1B, interleaved 1F1B) runs from its static table
(trainer/parallel/schedules.py) in the executor of trainer/parallel/pipeline.py: stage 0 embeds, the last
stage applies the head and loss per microbatch. A forward pass of the circular schedule takes
M*V + S - 1 ticks (microbatch i mod M, repeat i div M at tick i + s on stage s), its backward as
many; the idle share of each stage is (S-1) / (M*V + S-1).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshes import STAGE


def circular_moves(stages: int, repeats: int) -> dict:
    """{(shift, j): [(src, dst, src_row, dst_row), ...]}: the block moves from the stored placement
    to the circular one, grouped so that in a group every stage sends and receives at most once.

    Block b (layers [b*L/(S*V), (b+1)*L/(S*V))) is stored on stage b // V, row b % V, and runs on
    stage b % S, row b // S. A group is the j-th block each stage sends `shift` stages on.
    """
    S, V = stages, repeats
    groups, sent = {}, {}
    for b in range(S * V):
        src, dst, r_src, r_dst = b // V, b % S, b % V, b // S
        k = (dst - src) % S
        j = sent[src, k] = sent.get((src, k), -1) + 1
        groups.setdefault((k, j), []).append((src, dst, r_src, r_dst))
    return groups


def _move_blocks(w, stages: int, groups: dict):
    """Rows of w (V, ...) moved between stages as `groups` says, one ppermute per group."""
    V, s = w.shape[0], jax.lax.axis_index(STAGE)
    # a spare row V takes the write of a stage that receives nothing in a group: `out` is never read
    # (reading it made XLA keep copies: 3.5 slices of scratch instead of 2 for S=4, V=2)
    out = jnp.zeros((V + 1,) + w.shape[1:], w.dtype)
    for (k, _), moves in sorted(groups.items()):
        src_row, dst_row = [0] * stages, [V] * stages
        for src, dst, r_src, r_dst in moves:
            src_row[src], dst_row[dst] = r_src, r_dst
        blk = jax.lax.dynamic_index_in_dim(w, jnp.array(src_row)[s], 0, keepdims=False)
        if k:
            blk = jax.lax.ppermute(blk, STAGE, [(src, dst) for src, dst, _, _ in moves])
        out = jax.lax.dynamic_update_index_in_dim(out, blk, jnp.array(dst_row)[s], 0)
    return out[:V]


def circular_blocks(w, stages: int, repeats: int):
    """This stage's stored slice (L/S, ...) -> its circular blocks (V, L/(S*V), ...); inside a
    shard_map manual over `stage`.

    No sharding of the (L, ...) axis gives a stage the strided blocks s, s+S, ... (a sharding
    tiles an axis into one contiguous slice per device), and storing them in that order would tie
    the checkpoint to V. So the blocks move here, once per step and not per tick: each stage
    sends only the blocks it stores but does not run (S=2, V=2: half of them, S=4, V=2: 3/4; their
    gradients come back by the transposed ppermutes), block by block: memory stays O(L/S), about
    two more copies of the stage's layers (the circular ones and their gradient). (Resharding
    `reshape(V, L/V, ...)` by a sharding constraint instead lets XLA choose: an all-to-all where S or V divides the other, but an all-gather of the whole stack,
    O(L) per device, otherwise, e.g. S=2, V=3.)
    """
    w = w.reshape((repeats, w.shape[0] // repeats) + w.shape[1:])
    return _move_blocks(w, stages, circular_moves(stages, repeats))
