"""A pipeline's evaluation: the eval step's batch through the stages (trainer/parallel/pipeline.py's executor) by
the forward table (schedules.FORWARD, GPipe's forwards), whatever schedule the training runs. Each stage keeps its
layers, as in the train step (an unpipelined eval would move every layer's weights over `stage` on every call); the
last stage adds up each microbatch's evaluation sums, as the unpipelined eval step returns them."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshes import STAGE
from models.objectives.cross_entropy import head_cross_entropy
from models.objectives.objective import dpo_eval_head
from trainer.parallel import schedules
from trainer.parallel.pipeline import (DataSync, Pipe, Stage, add_tree, embed_microbatch, forward, gathered,
                                       make_stage, over_stages, put, run_if)


def microbatch_sums(st: Stage, y, top, m) -> dict:
    """What an evaluation adds up of microbatch m from the last stage's output y: its loss sum (DPO: the sums of
    models/objectives/objective.py `dpo_eval_head`)."""
    c, mb = st.pipe.model, {k: v[m] for k, v in st.mbs.items()}
    if c.dpo is not None:
        return dpo_eval_head(c, top, y, mb, st.pipe.constrain)
    return {"loss": head_cross_entropy(c, top, y, mb["targets"], mb["loss_weight"], st.pipe.constrain)}


def eval_loss_step(st: Stage, ins, sums):
    """The last stage's evaluation sums of microbatch m added to `sums`."""
    top, y, m = ins
    return (add_tree(sums, microbatch_sums(st, y, top, m)),)


def eval_tick(st: Stage, carry, row):
    """One tick of the forward table on this stage: its forward branch, the last stage's sums, the hop forward."""
    xbuf, sums = carry
    r = {k: a[st.me] for k, a in row.items()}
    y, _ = forward(st, r, xbuf[r["slot"]])
    sums, = run_if(st, r["branch"] == schedules.FWD_LOSS, eval_loss_step, (st.top, y, r["m"]), sums)
    return (put(xbuf, r["recv_act"], jax.lax.ppermute(y, STAGE, st.pipe.fwd_pairs)), sums), None


def scan_eval(st: Stage) -> dict:
    """This stage's evaluation sums (`microbatch_sums`, zero but on the last stage): every tick of the forward
    table."""
    h0 = jax.eval_shape(functools.partial(embed_microbatch, st), st.top, 0)[0]
    sums0 = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                         jax.eval_shape(functools.partial(microbatch_sums, st), h0, st.top, 0))
    xbuf = jnp.zeros((max(st.pipe.plan.n_act, 1),) + h0.shape, h0.dtype)
    return jax.lax.scan(functools.partial(eval_tick, st), (xbuf, sums0), st.pipe.rows)[0][1]


def evaluated(pipe: Pipe, ds: DataSync, layers, top, mbs, scale) -> dict:
    """The evaluation sums of the step's whole batch: this data shard's rows through the forward table, summed over
    `stage` (the last stage's) and the batch axes."""
    st, _ = make_stage(pipe, *gathered(ds, layers, top), mbs, scale)
    return jax.lax.psum(scan_eval(st), (STAGE, *ds.decision.axes))


def eval_sums(s, params, batch, scale) -> dict:
    """What an evaluation adds up of a batch (`microbatch_sums`), the stages running the forward table
    (schedules.FORWARD) whatever the training's schedule: each stage's layers stay on it, as in the train step."""
    pipe, ds = Pipe.of(s, False, forward_only=True), DataSync.of(s)
    fn, mbs, top = over_stages(s, functools.partial(evaluated, pipe, ds), lambda manual, rows: P(), batch)
    return fn(params["layers"], {k: params[k] for k in top}, mbs, scale)
