"""Pipeline parallelism over `stage`: GPipe with microbatches, and the circular (interleaved) schedule.

Stage s runs layer blocks s, s+S, s+2S, ... (V blocks of L/(S*V) layers; V = 1 is plain GPipe
with L/S consecutive layers). The layer weights (and their optimizer state) are stored (L, ...)
whatever the schedule, sharded over `stage` in contiguous slices of L/S layers, so a checkpoint
restores onto any mesh and V. With V > 1 the step re-lays the stage's slice out into its circular
blocks (`circular_blocks`) once per step, before the schedule; the gradients go back the same
way.

The schedule is one `lax.scan` over M*V + S - 1 ticks inside a shard_map that is manual over
`stage` only (data and tensor parallelism stay with the compiler). At tick t stage s works on
item i = t - s (microbatch i mod M, repeat i div M); activations hop to stage s+1 by
`ppermute`, and the last stage's output wraps around to stage 0, which buffers it until its next
repeat needs it (M >= S guarantees it arrives in time). Backward is autodiff through the scan;
each stage body is rematerialised, so a stage keeps only its input per tick (M*V + S - 1 layer
boundaries), not the activations inside its layers.

The embedding and the output head are replicated over `stage` and run outside the pipeline:
they are small next to the layer stack (vocab and head are split over `model` instead), and
keeping them out of the schedule leaves every stage with identical work per tick.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshes.rules import RULES, constrainer, without_axes
from models.transformer import embed, head_loss, layer_stack


def split_microbatches(batch, m: int):
    """(B, ...) -> (M, B/M, ...); microbatch j takes rows j, j+M, ... so each spans every data shard."""
    b = batch.shape[0]
    return batch.reshape(b // m, m, *batch.shape[1:]).swapaxes(0, 1)


def num_ticks(stages: int, microbatches: int, repeats: int = 1) -> int:
    return microbatches * repeats + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle share of each stage's ticks: (S-1) / (M*V + S-1)."""
    return (stages - 1) / num_ticks(stages, microbatches, repeats)


def bubble_overhead(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle time per unit of busy time: (S-1) / (M*V) = bubble / (1 - bubble)."""
    return (stages - 1) / (microbatches * repeats)


def describe(stages: int, microbatches: int, repeats: int, schedule: str = "gpipe") -> str:
    if schedule != "gpipe":  # the table-driven schedules: ticks and idle share read off the table
        from trainer.schedules import build, idle_fraction
        table = build(schedule, stages, microbatches, repeats)
        return (f"pipeline {schedule} x{repeats}: {stages} stages, {microbatches} microbatches, "
                f"{len(table)} ticks, bubble {100 * idle_fraction(table):.1f}%")
    kind = "GPipe" if repeats == 1 else f"circular x{repeats}"
    return (f"pipeline {kind}: {stages} stages, {microbatches} microbatches, "
            f"{num_ticks(stages, microbatches, repeats)} ticks, bubble "
            f"{100 * bubble_fraction(stages, microbatches, repeats):.1f}%")


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
    V, s = w.shape[0], jax.lax.axis_index("stage")
    # a spare row V takes the write of a stage that receives nothing in a group: `out` is never read
    # (reading it made XLA keep copies: 3.5 slices of scratch instead of 2 for S=4, V=2)
    out = jnp.zeros((V + 1,) + w.shape[1:], w.dtype)
    for (k, _), moves in sorted(groups.items()):
        src_row, dst_row = [0] * stages, [V] * stages
        for src, dst, r_src, r_dst in moves:
            src_row[src], dst_row[dst] = r_src, r_dst
        blk = jax.lax.dynamic_index_in_dim(w, jnp.array(src_row)[s], 0, keepdims=False)
        if k:
            blk = jax.lax.ppermute(blk, "stage", [(src, dst) for src, dst, _, _ in moves])
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


def pipeline_layers(c, layers, x_MBTD, mesh, repeats: int = 1):
    """Run microbatched activations (M, b, T, D) through the (L, ...) layer stack, pipelined over `stage`."""
    S, M, V = mesh.shape["stage"], x_MBTD.shape[0], repeats
    rules = without_axes(RULES, {"stage"})
    constrain = constrainer(mesh, rules)

    def stage_body(blocks, v, h):
        """This stage's layers of repeat v applied to h; rematerialised in the backward pass."""
        p = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, v, 0, keepdims=False), blocks)
        return layer_stack(c, p, h, constrain=constrain, remat="none")

    stage_body = jax.checkpoint(stage_body, policy=jax.checkpoint_policies.nothing_saveable,
                                prevent_cse=False)

    def local(blocks, x):
        if V == 1:
            blocks = jax.tree.map(lambda w: w[None], blocks)
        else:
            blocks = jax.tree.map(lambda w: circular_blocks(w, S, V), blocks)
        s = jax.lax.axis_index("stage")
        ring = [(j, (j + 1) % S) for j in range(S)]

        def tick(carry, t):
            state, buf, out = carry
            v = jnp.clip((t - s) // M, 0, V - 1)
            y = stage_body(blocks, v, state)
            # the item the last stage just finished, and whether it was its final repeat
            i_last = t - (S - 1)
            m_last, v_last = jnp.mod(i_last, M), i_last // M
            done = (s == S - 1) & (i_last >= 0) & (v_last == V - 1)
            out = out.at[m_last].set(jnp.where(done, y, out[m_last]))
            recv = jax.lax.ppermute(y, "stage", ring)
            wrap = (s == 0) & (i_last >= 0) & (v_last < V - 1)
            buf = buf.at[m_last].set(jnp.where(wrap, recv, buf[m_last]))
            m_next, v_next = jnp.mod(t + 1, M), (t + 1) // M
            first = jnp.where(v_next == 0, x[m_next], buf[m_next])
            return (jnp.where(s == 0, first, recv), buf, out), None

        init = jnp.where(s == 0, x[0], jnp.zeros_like(x[0]))
        carry = (init, jnp.zeros_like(x), jnp.zeros_like(x))
        (_, _, out), _ = jax.lax.scan(tick, carry, jnp.arange(num_ticks(S, M, V)))
        return out[None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P("stage"),
                       axis_names={"stage"}, check_vma=False)
    return fn(layers, x_MBTD)[S - 1]


def pipeline_loss(s, params, batch):
    """Mean next-token loss of a (B, T+1) batch with the layer stack pipelined over `stage`."""
    c, m = s.model, s.cfg.train.microbatches
    constrain = constrainer(s.mesh)
    tokens, targets = batch[:, :-1], batch[:, 1:]
    x = embed(c, params, tokens, s.dtype, constrain)
    x_MBTD = jax.lax.with_sharding_constraint(split_microbatches(x, m), P(None, "data"))
    y = pipeline_layers(c, params["layers"], x_MBTD, s.mesh, s.cfg.train.pipeline_repeats)
    y = y.reshape((-1,) + y.shape[2:])
    return head_loss(c, params, y, split_microbatches(targets, m).reshape(y.shape[:2]), constrain)
