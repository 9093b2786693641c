"""Table-driven pipeline executor (1F1B, interleaved 1F1B): loss and gradients in one scan, no
autodiff through it.

The schedule is a static table (trainer/schedules.py): at each tick a stage runs the forward of a
microbatch (storing its input in a buffer slot), the backward of one (`jax.vjp` of the stage body
recomputed from the stored input, with the cotangent received from the next stage), or nothing.
Every tick each stage sends its output to the next stage and its input cotangent to the previous
one by `ppermute`; the receiver files them in the slots the table assigned. So a stage holds only
the inputs between a microbatch's forward and backward (at most S for 1F1B, against M for GPipe).

Stage 0 embeds the microbatch's tokens itself and accumulates the embedding gradient; the last
stage applies the head and cross-entropy as it finishes a microbatch's forward and seeds its
backward with the loss gradient (scaled 1/M). Layer gradients accumulate per stage, in the
stored (L/S, ...) layout (circular blocks map back through the vjp of `circular_blocks`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshes.rules import RULES, constrainer, without_axes
from models.transformer import head, layer_stack
from trainer import schedules
from trainer.pipeline import circular_blocks, split_microbatches


@functools.lru_cache(maxsize=None)
def table_plan(schedule: str, stages: int, microbatches: int, repeats: int):
    """(table, plan) of a schedule; cached since every trace of the step asks again."""
    table = schedules.build(schedule, stages, microbatches, repeats)
    return table, schedules.plan(table, repeats)


def _embed(c, params, tokens_BT, dtype, constrain):
    """`embed` as a one-hot product: XLA's SPMD partitioner aborts on the gather inside the scan's
    conditional when the vocab is split over `model` (jax 0.10.2, CPU)."""
    onehot = jax.nn.one_hot(tokens_BT, params["embed"].shape[0], dtype=params["embed"].dtype)
    x = jnp.einsum("btv,vd->btd", onehot, params["embed"]).astype(dtype)
    return constrain(x, ("batch", "seq", "embed"))


def _cross_entropy(logits_BTV, targets_BT):
    """`cross_entropy` with the target logit picked by a one-hot sum (no gather, as above)."""
    logz = jax.nn.logsumexp(logits_BTV, axis=-1)
    tgt = jnp.sum(logits_BTV * jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=logits_BTV.dtype), -1)
    return jnp.mean(logz - tgt)


def loss_and_grads(s, params, batch):
    """Mean next-token loss of a (B, T+1) batch and its gradient, pipelined over `stage` by the
    table of train.pipeline_schedule."""
    c, t, mesh = s.model, s.cfg.train, s.mesh
    S, M, V = mesh.shape["stage"], t.microbatches, t.pipeline_repeats
    _, pl = table_plan(t.pipeline_schedule, S, M, V)
    constrain = constrainer(mesh, without_axes(RULES, {"stage"}))
    micro = lambda x: jax.lax.with_sharding_constraint(split_microbatches(x, M), P(None, "data"))  # noqa: E731
    tokens_MbT, targets_MbT = micro(batch[:, :-1]), micro(batch[:, 1:])
    top = {k: v for k, v in params.items() if k != "layers"}
    xs = {k: jnp.asarray(getattr(pl, k)) for k in
          ("branch", "m", "v", "slot", "cot_slot", "loss_slot", "recv_act", "recv_cot")}
    fwd_pairs = [(j, j + 1) for j in range(S - 1)] + ([(S - 1, 0)] if V > 1 else [])
    bwd_pairs = [(b, a) for a, b in fwd_pairs]

    def body(blocks, v, h):
        p = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, v, 0, keepdims=False), blocks)
        return layer_stack(c, p, h, constrain=constrain, remat="none")

    def local(layers, top, tokens, targets):
        if V == 1:
            blocks = jax.tree.map(lambda w: w[None], layers)
            back = lambda d: jax.tree.map(lambda w: w[0], d)  # noqa: E731
        else:
            blocks, vjp_blocks = jax.vjp(lambda ws: jax.tree.map(lambda w: circular_blocks(w, S, V), ws), layers)
            back = lambda d: vjp_blocks(d)[0]  # noqa: E731
        emb = lambda tp, m: _embed(c, tp, tokens[m], s.dtype, constrain)  # noqa: E731
        h0 = jax.eval_shape(emb, top, 0)
        zeros_h = jnp.zeros(h0.shape, h0.dtype)
        add = lambda acc, d: jax.tree.map(jnp.add, acc, d)  # noqa: E731

        def mb_loss(y, tp, m):
            logits = head(c, tp, y, constrain)
            return _cross_entropy(logits, targets[m]) / M

        # branches: (h, g, m, v, (d blocks, d top), gbuf) -> (output, input cotangent, (d blocks, d top),
        # gbuf, loss). The gradient sums and the cotangent buffer go through the branch: a branch that
        # does not change them hands them back, so forward and idle ticks add no stage-sized zeros.
        def idle(h, g, m, v, acc, gbuf):
            return zeros_h, zeros_h, acc, gbuf, jnp.zeros((), jnp.float32)

        def fwd(h, g, m, v, acc, gbuf):
            return body(blocks, v, h), zeros_h, acc, gbuf, jnp.zeros((), jnp.float32)

        def fwd_embed(h, g, m, v, acc, gbuf):
            return body(blocks, v, emb(top, m)), zeros_h, acc, gbuf, jnp.zeros((), jnp.float32)

        def fwd_loss(h, g, m, v, acc, gbuf, slot):
            y = body(blocks, v, h)
            loss, (dy, dtop) = jax.value_and_grad(mb_loss, argnums=(0, 1))(y, top, m)
            gbuf = jax.lax.dynamic_update_index_in_dim(gbuf, dy.astype(y.dtype), slot, 0)
            return y, zeros_h, (acc[0], add(acc[1], dtop)), gbuf, loss

        def bwd(h, g, m, v, acc, gbuf):
            _, vjp = jax.vjp(lambda w, x: body(w, v, x), blocks, h)
            dblk, dh = vjp(g)
            return zeros_h, dh, (add(acc[0], dblk), acc[1]), gbuf, jnp.zeros((), jnp.float32)

        def bwd_embed(h, g, m, v, acc, gbuf):
            _, vjp = jax.vjp(lambda w, e: body(w, v, emb({**top, "embed": e}, m)), blocks, top["embed"])
            dblk, de = vjp(g)
            dtop = {**acc[1], "embed": acc[1]["embed"] + de}
            return zeros_h, zeros_h, (add(acc[0], dblk), dtop), gbuf, jnp.zeros((), jnp.float32)

        me = jax.lax.axis_index("stage")

        def tick(carry, row):
            xbuf, gbuf, acc, loss = carry
            r = {k: a[me] for k, a in row.items()}
            branches = [None] * 6
            for i, f in ((schedules.IDLE, idle), (schedules.FWD, fwd), (schedules.FWD_EMBED, fwd_embed),
                         (schedules.FWD_LOSS, functools.partial(fwd_loss, slot=r["loss_slot"])),
                         (schedules.BWD, bwd), (schedules.BWD_EMBED, bwd_embed)):
                branches[i] = f
            y, dh, acc, gbuf, ls = jax.lax.switch(r["branch"], branches, xbuf[r["slot"]], gbuf[r["cot_slot"]],
                                                  r["m"], r["v"], acc, gbuf)
            # the last row of each buffer is a dummy that takes the writes nobody reads
            xbuf = xbuf.at[r["recv_act"]].set(jax.lax.ppermute(y, "stage", fwd_pairs))
            gbuf = gbuf.at[r["recv_cot"]].set(jax.lax.ppermute(dh, "stage", bwd_pairs))
            return (xbuf, gbuf, acc, loss + ls), None

        acc = (jax.tree.map(jnp.zeros_like, blocks), jax.tree.map(jnp.zeros_like, top))
        carry = (jnp.zeros((pl.n_act + 1,) + h0.shape, h0.dtype), jnp.zeros((pl.n_cot + 1,) + h0.shape, h0.dtype),
                 acc, jnp.zeros((), jnp.float32))
        (_, _, (dblk, dtop), loss), _ = jax.lax.scan(tick, carry, xs)
        return jax.lax.psum(loss, "stage"), jax.lax.psum(dtop, "stage"), back(dblk)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("stage"), P(), P(), P()), out_specs=(P(), P(), P("stage")),
                       axis_names={"stage"}, check_vma=False)
    loss, dtop, dlayers = fn(params["layers"], top, tokens_MbT, targets_MbT)
    return loss, {**dtop, "layers": dlayers}
