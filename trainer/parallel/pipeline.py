"""Table-driven pipeline executor (GPipe, circular GPipe, 1F1B, interleaved 1F1B): loss and
gradients in one scan, no autodiff through it.

The schedule is a static table (trainer/parallel/schedules.py): at each tick a stage runs the forward of a
microbatch (storing its input in a buffer slot), the backward of one (`jax.vjp` of the stage body
recomputed from the stored input, with the cotangent received from the next stage), or nothing.
Every tick each stage sends its output to the next stage and its input cotangent to the previous
one by `ppermute`; the receiver files them in the slots the table assigned. So a stage holds only
the inputs between a microbatch's forward and backward (at most S for 1F1B, against M for GPipe).

Stage 0 embeds the microbatch's tokens itself and accumulates the embedding gradient; the last
stage applies the head and cross-entropy as it finishes a microbatch's forward and seeds its
backward with the gradient of the microbatch's loss sum (loss_weight x token loss) over the step's
counted tokens (trainer/step.py): the head runs once per microbatch, on one stage. Every batch
field is split into microbatches alike (trainer/parallel/microbatch.py).
Layer gradients accumulate per stage, in the stored (L/S, ...) layout (circular blocks map back
through the vjp of `circular_blocks`).

The shard_map is manual over `stage` and the batch axes (`data` x `context`; tensor parallelism over `model` stays
with the compiler): each data shard accumulates the gradients of its own rows over all ticks, and the data-parallel sync
(the run's gradient decision, trainer/parallel/reduction.py, with train.grad_sync's reducer) runs once per step
after the scan: an all-reduce for ZeRO 0/1, a reduce-scatter that keeps the gradient sharded for ZeRO 2/3, nothing
for a leaf the rules split over `data` (each rank holds and trains its own slice). ZeRO-3
weights arrive sharded and the stage's whole slice of layers (and the embedding and head) is
all-gathered once per step before the scan, not per layer: a stage holds its L/S layers unsharded
for the step, the price of a tick loop that runs any layer block at any tick.

The pieces, outermost first: `loss_and_grads` (the shard_map over the decision's manual specs) -> `synced` (the
data-parallel side, `DataSync`) -> `stage_grads` (one stage's blocks, `Stage`) -> `scan_ticks` -> `tick`: the forward branches
(`idle`, `fwd`, `fwd_embed`), then `loss_step`, `bwd_step` and `bwd_embed_step`, each under `run_if`; all of them
read the step's static facts from `Pipe` and run `stage_body`. The eval step runs the same stages through the
forward table alone (trainer/parallel/pipeline_eval.py).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshes import STAGE
from models.objectives.objective import aux_cotangents, head_fields, head_objective, scales, zero_parts
from models.spec import family, stacks
from models.transformer import aux_zeros, embed, head, layer_stack
from trainer.parallel import schedules
from trainer.parallel.circular import circular_blocks
from trainer.parallel.microbatch import split_microbatches


@functools.lru_cache(maxsize=None)
def table_plan(schedule: str, stages: int, microbatches: int, repeats: int):
    """(table, plan) of a schedule; cached since every trace of the step asks again."""
    table = schedules.build(schedule, stages, microbatches, repeats)
    return table, schedules.plan(table, repeats)


def put(buf, i, x):
    """buf[i] = x in place, nothing where i == len(buf) (a scatter's mode="drop" is a while loop on CPU)."""
    j = jnp.minimum(i, buf.shape[0] - 1)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(i < buf.shape[0], x, buf[j]), j, 0)


# the forward conditional's branch for each table branch: 0 idle, 1 fwd, 2 fwd_embed
FORWARD_BRANCH = np.array([{schedules.FWD: 1, schedules.FWD_LOSS: 1, schedules.FWD_EMBED: 2}.get(b, 0)
                           for b in range(6)], np.int32)
PLAN_ROWS = ("branch", "m", "v", "slot", "cot_slot", "loss_slot", "recv_act", "recv_cot")


@dataclasses.dataclass(frozen=True, eq=False)
class Pipe:
    """What every piece of a pipelined step reads and the trace fixes: the model, the schedule's plan, the layout."""
    model: Any  # the model config
    stages: int  # S
    microbatches: int  # M
    repeats: int  # V
    plan: schedules.Plan
    rows: dict  # the plan's per-(tick, stage) arrays (PLAN_ROWS), scanned over tick by tick
    constrain: Callable  # activation constraints, manual over `stage` and the batch axes
    dtype: Any  # the compute dtype
    placement: Any
    remat: str
    fwd_pairs: list  # the activations' hop, stage to stage (the last to the first where V > 1)
    bwd_pairs: list  # the cotangents' hop back
    keep_logits: bool

    @classmethod
    def of(cls, s, keep_logits: bool, forward_only: bool = False) -> Pipe:
        c, t = s.model, s.cfg.train
        S, M, V = s.mesh.shape[STAGE], t.microbatches, t.pipeline_repeats
        _, pl = table_plan(schedules.FORWARD if forward_only else t.pipeline_schedule, S, M, V)
        rows = {k: jnp.asarray(getattr(pl, k)) for k in PLAN_ROWS}
        fwd_pairs = [(j, j + 1) for j in range(S - 1)] + ([(S - 1, 0)] if V > 1 else [])
        # a backward recomputes its stage body from the stored input: per-layer full/dots remat would
        # recompute it again for nothing with one layer per stage; sublayer halves the vjp's working set
        remat = "sublayer" if c.remat == "sublayer" else "none"
        constrain = s.layout.constrainer(manual={STAGE, *s.reduction.axes})
        return cls(c, S, M, V, pl, rows, constrain, s.dtype, s.placement, remat, fwd_pairs,
                   [(b, a) for a, b in fwd_pairs], keep_logits)


@dataclasses.dataclass(frozen=True, eq=False)
class Stage:
    """What one stage's tick loop reads, inside the shard_map (one stage of one data shard)."""
    pipe: Pipe
    blocks: dict  # the stage's layers as its V blocks, each leaf (V, L/(S*V), ...)
    index: Any  # (V, L/(S*V)): each of those layers' index in the whole stack
    top: dict  # the parameters other than the layers (embedding, final norm, head)
    mbs: dict  # this data shard's microbatches, each field (M, B/M, T)
    scale: dict  # the objective's scales (models/objectives/objective.py `scales`)
    aux0: dict  # the layers' aux outputs (their sums), zero
    # each aux sum's cotangent: its scale (known before the backward, as the token loss's)
    aux_cot: dict
    me: Any  # this stage's index on `stage`


def add_tree(acc, d):
    return jax.tree.map(jnp.add, acc, d)


def stage_body(st: Stage, blocks, v, h, docs):
    """(h, aux) of the stage's block v of layers (blocks: (weights, global layer indices))."""
    p, idx = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, v, 0, keepdims=False), blocks)
    return layer_stack(st.pipe.model, p, h, constrain=st.pipe.constrain, remat=st.pipe.remat, documents=docs,
                       index=idx, placement=st.pipe.placement)


def embed_microbatch(st: Stage, top, m):
    """(microbatch m's tokens embedded by `top`'s embedding, and run through the first layers where the family has
    a stack of them (models/spec.py `stacks`: they ride with the embedding on the first stage), their aux)."""
    pipe = st.pipe
    x = embed(pipe.model, top, st.mbs["tokens"][m], pipe.dtype, pipe.constrain)
    if "first_layers" not in top:
        return x, st.aux0
    return layer_stack(pipe.model, top["first_layers"], x, constrain=pipe.constrain, remat=pipe.remat,
                       documents=documents(st, m), placement=pipe.placement, stack="first_layers")


def documents(st: Stage, m):
    """Microbatch m's (segment_ids, positions) where the model keeps to documents, else None."""
    return (st.mbs["segment_ids"][m], st.mbs["positions"][m]) if st.pipe.model.documents else None


def microbatch_objective(st: Stage, y, top, m):
    """(microbatch m's term of the objective from the last stage's output y, its parts: the head's term and DPO's
    statistics, models/objectives/objective.py `head_objective`; the layers' aux enter through `aux_cotangents`)."""
    pipe = st.pipe
    mb = {k: st.mbs[k][m] for k in head_fields(pipe.model)}
    return head_objective(pipe.model, top, y, {}, mb, st.scale, pipe.constrain, pipe.placement)


# The forward runs in a conditional (output only), one of these three branches. The steps that add to
# the gradient sums run as while loops of 0 or 1 trips (run_if): XLA updates a while's carry in place,
# where a conditional copies every sum it passes through (twice per tick: into the branch's output and
# back into the scan's carry), and adding a branch's zeros costs as much.
def idle(st: Stage, h, m, v):
    return h, st.aux0


def fwd(st: Stage, h, m, v):
    return stage_body(st, (st.blocks, st.index), v, h, documents(st, m))


def fwd_embed(st: Stage, h, m, v):
    x, first = embed_microbatch(st, st.top, m)
    y, aux = stage_body(st, (st.blocks, st.index), v, x, documents(st, m))
    return y, add_tree(first, aux)


# the steps that add to the sums read their inputs as `ins`: see run_if
def loss_step(st: Stage, ins, gbuf, dtop, loss, aux, *out):
    """The last stage's loss of microbatch m: its cotangent filed in gbuf's slot, the head's gradient added, its
    statistics added to aux."""
    top, y, m, slot = ins
    (_, parts), (dy, dt) = jax.value_and_grad(functools.partial(microbatch_objective, st), argnums=(0, 1),
                                              has_aux=True)(y, top, m)
    ls, stats = parts["loss"], parts["aux"]
    gbuf = put(gbuf, slot, dy.astype(y.dtype))
    if out:  # keep_logits: microbatch m's logits, filed in its row
        out = (put(out[0], m, head(st.pipe.model, top, y, st.pipe.constrain).astype(jnp.float32)),)
    return gbuf, add_tree(dtop, dt), loss + ls, {**aux, **add_tree({k: aux[k] for k in stats}, stats)}, *out


def bwd_step(st: Stage, ins, dblk, dh):
    """The backward of block v from its stored input h and cotangent g: its gradient added, dh the input's."""
    blk, h, g, v, *m = ins  # m: the microbatch, passed where its documents are read
    _, vjp = jax.vjp(lambda w, x: stage_body(st, (w, st.index), v, x, documents(st, *m) if m else None), blk, h)
    db, dh = vjp((g, st.aux_cot))
    return add_tree(dblk, db), dh


def bwd_embed_step(st: Stage, ins, dblk, dtop):
    """The first stage's backward of block v of microbatch m, through the embedding."""
    blk, top, g, m, v = ins
    own = [k for k in ("embed", "first_layers") if k in top]  # what the first stage's embedding step reads

    def run(w, e):
        x, first = embed_microbatch(st, {**top, **e}, m)
        y, aux = stage_body(st, (w, st.index), v, x, documents(st, m))
        return y, add_tree(first, aux)
    _, vjp = jax.vjp(run, blk, {k: top[k] for k in own})
    db, de = vjp((g, st.aux_cot))
    return add_tree(dblk, db), {**dtop, **add_tree({k: dtop[k] for k in own}, de)}


def run_if(st: Stage, pred, f, ins, *state):
    """f(st, ins, *state) if pred else state, as a while loop of 0 or 1 trips. The inputs pass a
    barrier with the trip counter: otherwise XLA hoists what depends only on them (the
    recomputed forward of a backward) out of the loop, to run every tick."""
    def step(carry):
        i, x = jax.lax.optimization_barrier((carry[0], ins))
        return (i + 1, *f(st, x, *carry[1:]))
    # the loop's ops are scoped by f's name: the HLO reader (trainer/plan/hlo.py) counts each
    # step's trips from that, whatever XLA shares between the loops' bodies
    with jax.named_scope(f.__name__):
        return jax.lax.while_loop(lambda c: c[0] < pred.astype(jnp.int32), step, (jnp.int32(0), *state))[1:]


def forward(st: Stage, r, h):
    """(y, aux) of this tick's forward branch (r: the tick's row of the plan on this stage; h: its stored input)."""
    branches = [functools.partial(f, st) for f in (idle, fwd, fwd_embed)]
    return jax.lax.switch(jnp.asarray(FORWARD_BRANCH)[r["branch"]], branches, h, r["m"], r["v"])


def tick(st: Stage, carry, row):
    """One tick of the table on this stage: its forward branch, loss step and backward steps, and the two hops."""
    xbuf, gbuf, dblk, dtop, loss, aux, *out = carry
    r = {k: a[st.me] for k, a in row.items()}
    br, m, v = r["branch"], r["m"], r["v"]
    h = xbuf[r["slot"]]
    y, aux_y = forward(st, r, h)
    aux = {**aux, **add_tree({k: aux[k] for k in aux_y}, aux_y)}  # the layers' aux; DPO's: loss_step
    gbuf, dtop, loss, aux, *out = run_if(st, br == schedules.FWD_LOSS, loss_step, (st.top, y, m, r["loss_slot"]),
                                         gbuf, dtop, loss, aux, *out)
    # read after the loss step's write (never on a backward's tick), which then needs no copy
    g = gbuf[r["cot_slot"]]
    # the writes nobody reads, such as what a stage sends on a tick it has nothing to send (any
    # array of the shape: no zeros kept), go to slot n_act (n_cot), one past the end: dropped,
    # where a spare row to take them would cost a stage input (cotangent) of memory. The output
    # is sent before the backward, whose input cotangent then takes its buffer.
    xbuf = put(xbuf, r["recv_act"], jax.lax.ppermute(y, STAGE, st.pipe.fwd_pairs))
    ins = (st.blocks, h, g, v) + ((m,) if st.pipe.model.documents else ())
    dblk, dh = run_if(st, br == schedules.BWD, bwd_step, ins, dblk, y)
    dblk, dtop = run_if(st, br == schedules.BWD_EMBED, bwd_embed_step, (st.blocks, st.top, g, m, v), dblk, dtop)
    gbuf = put(gbuf, r["recv_cot"], jax.lax.ppermute(dh, STAGE, st.pipe.bwd_pairs))
    return (xbuf, gbuf, dblk, dtop, loss, aux, *out), None


def scan_ticks(st: Stage):
    """(loss, aux, d blocks, d top, logits): every tick of the table on this stage, from empty buffers and sums
    (logits: [(M, B/M, T, V)] with keep_logits, else [])."""
    pipe = st.pipe
    h0 = jax.eval_shape(functools.partial(embed_microbatch, st), st.top, 0)[0]
    rows = lambda n: jnp.zeros((max(n, 1),) + h0.shape, h0.dtype)  # noqa: E731
    out = [jnp.zeros((pipe.microbatches,) + h0.shape[:-1] + (pipe.model.vocab_size,), jnp.float32)
           ] if pipe.keep_logits else []
    carry = (rows(pipe.plan.n_act), rows(pipe.plan.n_cot), jax.tree.map(jnp.zeros_like, st.blocks),
             jax.tree.map(jnp.zeros_like, st.top), jnp.zeros((), jnp.float32), zero_parts(pipe.model)["aux"], *out)
    (_, _, dblk, dtop, loss, aux, *out), _ = jax.lax.scan(functools.partial(tick, st), carry, pipe.rows)
    return loss, aux, dblk, dtop, out


def stage_blocks(layers, stages: int, repeats: int):
    """(blocks, back): the stage's stored layers (L/S, ...) as its V blocks (V, L/(S*V), ...), and the map of
    the blocks' gradient back to the stored layout (through the vjp of `circular_blocks` where V > 1)."""
    if repeats == 1:
        return jax.tree.map(lambda w: w[None], layers), lambda d: jax.tree.map(lambda w: w[0], d)
    blocks, vjp_blocks = jax.vjp(lambda ws: jax.tree.map(lambda w: circular_blocks(w, stages, repeats), ws), layers)
    return blocks, lambda d: vjp_blocks(d)[0]


def make_stage(pipe: Pipe, layers, top, mbs, scale):
    """(Stage, back): this stage's view of the step, inside the shard_map, and `stage_blocks`' map back."""
    c, S, V = pipe.model, pipe.stages, pipe.repeats
    blocks, back = stage_blocks(layers, S, V)
    # each layer's index in the whole stack: row r of this stage holds block r*S + stage (trainer/parallel/
    # circular.py; V = 1: the stage's L/S consecutive layers)
    n, first = stacks(c)["layers"] // (S * V), family(c.family).first_layers(c)  # (after the first layers)
    index = first + (jnp.arange(V)[:, None] * S + jax.lax.axis_index(STAGE)) * n + jnp.arange(n)[None, :]
    aux0 = aux_zeros(c)  # the layers' own sums
    aux_cot = aux_cotangents(aux0, scale)
    return Stage(pipe, blocks, index, top, mbs, scale, aux0, aux_cot, jax.lax.axis_index(STAGE)), back


def stage_grads(pipe: Pipe, layers, top, mbs, scale):
    """(parts, d top, d layers, *logits) of this data shard's rows: the schedule run on this stage, the parts,
    the top gradient and the logits summed over `stage`."""
    st, back = make_stage(pipe, layers, top, mbs, scale)
    loss, aux, dblk, dtop, out = scan_ticks(st)
    parts = jax.lax.psum({"loss": loss, "aux": aux}, STAGE)
    return parts, jax.lax.psum(dtop, STAGE), back(dblk), *(jax.lax.psum(o, STAGE) for o in out)


@dataclasses.dataclass(frozen=True, eq=False)
class DataSync:
    """The data-parallel side of a pipelined step: the run's gradient decision (trainer/parallel/reduction.py:
    each parameter's ZeRO dimension, compute spec and reduction) and train.grad_sync's reducer over its axis."""
    decision: Any
    reducer: Any

    @classmethod
    def of(cls, s) -> DataSync:
        return cls(s.reduction, s.reduction.reducer(s.cfg.train.grad_sync))


def gathered(ds: DataSync, layers, top):
    """(layers, top) as the stage computes with them: ZeRO-3 gathers the stage's weights over `data` (a leaf the
    rules split over it stays split); below ZeRO-3 as they arrive."""
    d = ds.decision
    if d.layout.zero_stage < 3:
        return layers, top
    layers = ds.reducer.all_gather_tree(layers, d.dims["layers"], d.specs["layers"])
    return layers, ds.reducer.all_gather_tree(top, *({n: tree[n] for n in top} for tree in (d.dims, d.specs)))


def synced(pipe: Pipe, ds: DataSync, layers, top, mbs, scale):
    """`stage_grads` on this data shard's rows, its weights `gathered`; the data-parallel sync once, on the step's
    gradients (a leaf the rules split over `data` is not reduced)."""
    d = ds.decision
    parts, dtop, dlayers, *out = stage_grads(pipe, *gathered(ds, layers, top), mbs, scale)
    g = {**dtop, "layers": dlayers}
    if d.size > 1:
        g = d.once(ds.reducer, g)
    # sums over this shard's rows: the step's are their sum over the batch axes
    return jax.lax.psum(parts, d.axes), g, *out


def over_stages(s, local, out_specs, batch):
    """(local as a shard_map manual over `stage` and the batch axes: (layers, top, microbatches, scale) -> out,
    the batch's microbatches, each field (M, B/M, ...) split as the batch's rows, the parameters other than the
    layers' names)."""
    mbs = split_microbatches(batch, s.cfg.train.microbatches)  # each field (M, B/M, T)
    rows = P(None, *s.layout.batch_spec())  # (M, B/M, ...): each microbatch's rows split as the batch's
    mbs = jax.lax.with_sharding_constraint(mbs, rows)
    manual = {STAGE, *s.reduction.axes}  # layers over `stage`; each rank's rows and ZeRO blocks over the batch axes
    p_in = s.reduction.manual_specs("param", manual)
    top = [k for k in p_in if k != "layers"]
    fn = jax.shard_map(local, mesh=s.mesh, in_specs=(p_in["layers"], {n: p_in[n] for n in top}, rows, P()),
                       out_specs=out_specs(manual, rows), axis_names=manual, check_vma=False)
    return fn, mbs, top


def loss_and_grads(s, params, batch, scale, keep_logits: bool = False):
    """(parts, gradient) of the objective (models/objectives/objective.py): scale["loss"] x the loss sum of a batch
    (loss_weight x token loss, models/batch.py) plus each layer aux sum x its scale, summed over the data ranks,
    pipelined over `stage` by the table of train.pipeline_schedule. The stage body returns (h, aux): its forward adds
    the aux sums up, its backward seeds each with its scale (`aux_cotangents`). keep_logits: (parts, gradient,
    logits), the (B, T, V) float32 logits of the hidden states the last stage finished each microbatch with (`step_logits`)."""
    pipe, ds = Pipe.of(s, keep_logits), DataSync.of(s)

    def outs(manual, rows):
        return (P(), s.reduction.manual_specs("grad", manual)) + ((rows,) if keep_logits else ())
    fn, mbs, top = over_stages(s, functools.partial(synced, pipe, ds), outs, batch)
    parts, g, *out = fn(params["layers"], {k: params[k] for k in top}, mbs, scale)
    if not keep_logits:
        return parts, g
    logits = out[0].swapaxes(0, 1)  # (M, B/M, T, V) -> (B, T, V): row j*M + m was microbatch m's row j
    return parts, g, logits.reshape((-1,) + logits.shape[2:])


def step_logits(s, params, batch):
    """(logits, parts) of one step of the pipeline executor (train.pipeline_schedule's table, its forward and
    backward ticks): the head's logits, (B, T, V) float32, of the hidden states each microbatch's last stage feeds
    its loss (taken again beside the loss, which may tile them), and the step's loss and aux parts (the batch's own
    scales). What the pipeline trains on, checked logit by logit (tests/hf_check.py against transformers')."""
    parts, _, logits = loss_and_grads(s, params, batch, scales(s.model, batch), keep_logits=True)
    return logits, parts
