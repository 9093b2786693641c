"""Pipeline parallelism over `stage`: GPipe with microbatches, and the circular (interleaved) schedule.

Stage s owns layer blocks s, s+S, s+2S, ... (V blocks of L/(S*V) layers; V = 1 is plain GPipe
with L/S consecutive layers). The stacked layer weights are stored as (V, L/V, ...) when V > 1,
whose row-major order is the logical layer order, so sharding the second axis over `stage` gives
exactly the circular assignment with an ordinary NamedSharding.

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
from models.transformer import cross_entropy, embed, head, layer_stack


def split_microbatches(batch, m: int):
    """(B, ...) -> (M, B/M, ...); microbatch j takes rows j, j+M, ... so each spans every data shard."""
    b = batch.shape[0]
    return batch.reshape(b // m, m, *batch.shape[1:]).swapaxes(0, 1)


def num_ticks(stages: int, microbatches: int, repeats: int = 1) -> int:
    return microbatches * repeats + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle share of each stage's ticks: (S-1) / (M*V + S-1)."""
    return (stages - 1) / num_ticks(stages, microbatches, repeats)


def describe(stages: int, microbatches: int, repeats: int) -> str:
    kind = "GPipe" if repeats == 1 else f"circular x{repeats}"
    return (f"pipeline {kind}: {stages} stages, {microbatches} microbatches, "
            f"{num_ticks(stages, microbatches, repeats)} ticks, bubble "
            f"{100 * bubble_fraction(stages, microbatches, repeats):.1f}%")


def pipeline_layers(c, layers, x_MBTD, mesh, repeats: int = 1):
    """Run microbatched activations (M, b, T, D) through the layer stack, pipelined over `stage`."""
    S, M, V = mesh.shape["stage"], x_MBTD.shape[0], repeats
    rules = without_axes(RULES, {"stage"})
    constrain = constrainer(mesh, rules)
    layer_spec = P("stage") if V == 1 else P(None, "stage")

    def stage_body(blocks, v, h):
        """This stage's layers of repeat v applied to h; rematerialised in the backward pass."""
        p = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, v, 0, keepdims=False), blocks)
        return layer_stack(c, p, h, constrain=constrain, remat="none")

    stage_body = jax.checkpoint(stage_body, policy=jax.checkpoint_policies.nothing_saveable,
                                prevent_cse=False)

    def local(blocks, x):
        if V == 1:
            blocks = jax.tree.map(lambda w: w[None], blocks)
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

    fn = jax.shard_map(local, mesh=mesh, in_specs=(layer_spec, P()), out_specs=P("stage"),
                       axis_names={"stage"}, check_vma=False)
    return fn(layers, x_MBTD)[S - 1]


def pipeline_loss(s, params, batch):
    """Mean next-token loss of a (B, T+1) batch with the layer stack pipelined over `stage`."""
    c, m = s.model, s.cfg.train.microbatches
    constrain = constrainer(s.mesh)
    tokens, targets = batch[:, :-1], batch[:, 1:]
    x = embed(c, params, tokens, s.dtype, constrain)
    x_MBTD = jax.lax.with_sharding_constraint(split_microbatches(x, m), P(None, "data"))
    y = pipeline_layers(c, params["layers"], x_MBTD, s.mesh, c.pipeline_repeats)
    logits = head(c, params, y.reshape((-1,) + y.shape[2:]), constrain)
    return cross_entropy(logits, split_microbatches(targets, m).reshape(logits.shape[:2]))
