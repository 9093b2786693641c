"""The train and eval steps: pure functions of (state, batch), jitted once with explicit shardings.

A batch is a dict of named fields (models/batch.py). The step first counts the batch's counted
tokens N (the sum of loss_weight over the whole step batch) and takes 1/N, its one division (1 where
N is 0), and likewise 1/count for each auxiliary output of the family's layers
(models/objectives/objective.py `scales`; docs/models.md). Every path below then sums loss_weight x token loss / N
(plus each aux sum / its count), and its gradient, over its microbatches, data ranks and pipeline microbatches:
the loss is one mean over the step's counted tokens whatever the layout, and a step with none has loss 0 and zero
gradients. (1/N scales the loss where its backward starts, so the gradients need no pass of their own to be divided.)

Gradients come from the path the gradient decision names (s.reduction.where, trainer/parallel/reduction.py,
which also says how each leaf is reduced: a leaf the rules split over `data` never is):
  compiler  (grad_sync=auto, ZeRO 0/1, one microbatch): plain jit; XLA inserts the gradient all-reduce.
  manual    (grad_sync=psum|ring|ring_bf16, ZeRO 2/3, or microbatches > 1): the loss and gradients run in a
            shard_map that is manual over the batch's mesh axes, `data` x `context` (tensor parallelism over
            `model` stays with the compiler). Each device differentiates its own rows; the reduction is
            explicit: reduce-scatter for ZeRO 2/3 (once per microbatch, so the accumulated
            gradient stays sharded), all-reduce once per step for ZeRO 0/1. ZeRO-3 weights
            arrive sharded and are all-gathered one layer at a time inside the layer scan;
            the transpose of that all-gather is the gradient's reduce-scatter.
A pipeline (every schedule runs on the table executor, trainer/parallel/pipeline.py) is manual over `stage` and the
batch axes (`data` x `context`) and syncs with the same reducers once per step, after its tick loop (ZeRO 2/3
included, whatever grad_sync); its eval step runs the same stages through GPipe's forwards alone
(trainer/parallel/pipeline_eval.py), so no layer's weights cross `stage`.
ZeRO 2/3 always take the manual path: XLA:CPU has no pass that turns all-reduce +
dynamic-slice into a reduce-scatter, and the explicit form keeps the gradient sharded on
every backend. So does gradient accumulation: the compiler's all-reduce stays inside the
accumulation loop (once per microbatch, M times the bytes), the manual path's runs once after it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from models.batch import counted
from models.objectives.objective import aux_counts, dpo_eval_sums, loss_sum, objective, part_metrics, scales, zero_parts
from models.precision import compute_dtypes
from models.spec import family
from models.frozen import frozen_stopped, frozen_zeroed
from models.transformer import STACKS, head_only
from trainer import guard
from trainer.parallel import localsgd, pipeline, pipeline_eval, reduction
from trainer.optim import schedule_count
from trainer.parallel.microbatch import split_microbatches
from trainer.state import Setup


def _constrain_tree(tree, shardings):
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def uses_manual_sync(s: Setup) -> bool:
    """Whether the step reduces gradients over `data` itself (else the compiler inserts the all-reduce)."""
    return s.reduction.where != reduction.COMPILER


# ----------------------------------------------------------------------------- compiler path

def _auto_grads(s: Setup, params, batch, scale):
    constrain = s.layout.constrainer()
    vg = jax.value_and_grad(lambda p, b: objective(s.model, frozen_stopped(s.model, p), b, scale, dtype=s.dtype,
                                                   constrain=constrain, placement=s.placement), has_aux=True)
    m = s.cfg.train.microbatches
    if m == 1:
        (_, parts), g = vg(params, batch)
        return parts, g
    gsh = s.layout.tree("grad", s.param_shapes, s.logical)
    mbs = jax.lax.with_sharding_constraint(split_microbatches(batch, m), P(None, *s.layout.batch_spec()))

    def body(carry, mb):
        (_, parts), g = vg(params, mb)
        acc = _constrain_tree(jax.tree.map(jnp.add, carry[1], g), gsh)
        return (_add(carry[0], parts), acc), None

    zeros = _constrain_tree(jax.tree.map(jnp.zeros_like, params), gsh)
    return jax.lax.scan(body, (zero_parts(s.model), zeros), mbs)[0]


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


# ----------------------------------------------------------------------------- manual path

def _scattered_shape(shape, dim, k):
    return shape if dim is None else shape[:dim] + (shape[dim] // k,) + shape[dim + 1:]


def _gathering(s: Setup, reducer):
    """params -> (the weights the layers' stacks and the embedding read, whole; the per-layer gather each stack runs;
    the gather of the head's weights, run after the stack): ZeRO-3 gathers the non-layer weights outside the scan
    and each layer's inside it (in the compute dtype: half the bytes in bfloat16, the rest as stored); below
    ZeRO-3 all three are as they arrive."""
    red = s.reduction
    dims, specs = red.dims, red.specs

    def full_params(p):
        if s.cfg.train.zero_stage < 3:
            return p, lambda lp: lp, lambda hp: hp
        cast = compute_dtypes(s.model, p, s.dtype)

        def top(t):
            return reducer.all_gather_tree(t, *({n: tree[n] for n in t} for tree in (dims, specs, cast)))
        def per_layer(stack):  # one layer of a stack gathered inside its scan
            layer_dims = {n: (None if d is None else d - 1) for n, d in dims[stack].items()}
            layer_specs = {n: P(*sp[1:]) for n, sp in specs[stack].items()}
            return lambda lp: reducer.all_gather_tree(lp, layer_dims, layer_specs, cast[stack])
        own = [n for n in STACKS if n in p]
        rest = {n: v for n, v in p.items() if n not in own and n not in _late(s, p)}
        return {**top(rest), **{n: p[n] for n in own}}, {n: per_layer(n) for n in own}, top
    return full_params


def _late(s: Setup, p: dict) -> tuple:
    """The weights only the head reads (models/transformer.py head_only), gathered after the layers' stack under
    ZeRO-3 so that their gradient is reduce-scattered before the layers' backward begins (`_head_first`)."""
    return tuple(n for n in head_only(s.model) if n in p) if s.cfg.train.zero_stage >= 3 else ()


@jax.custom_vjp
def _head_first(x, shards):
    """Identity; its backward holds the final hidden states' cotangent until the head weights' gradient shards
    (reduce-scattered already) are done: XLA:TPU would otherwise put that reduce-scatter after the layers'
    backward and keep the whole float32 head gradient live through it (0.5 GB for a 32k x 4096 head)."""
    return x, shards


_head_first.defvjp(lambda x, shards: ((x, shards), None), lambda _, cts: tuple(jax.lax.optimization_barrier(cts)))


def _manual_grads(s: Setup, params, batch, scale):
    """The explicit path: a shard_map manual over the batch axes, each rank's rows differentiated, the gradients
    reduced where and as s.reduction decides (trainer/parallel/reduction.py)."""
    t, red = s.cfg.train, s.reduction
    m, manual = t.microbatches, set(red.axes)
    constrain = s.layout.constrainer(manual=manual)
    reducer = red.reducer(t.grad_sync)
    full_params = _gathering(s, reducer)

    def local_loss(p, mb, scale):
        p = frozen_stopped(s.model, p)
        full, gather, gather_head = full_params(p)

        def before_head(x, full):
            x, shards = _head_first(x, {n: p[n] for n in _late(s, p)})
            return x, {**full, **gather_head(shards)}
        return objective(s.model, full, mb, scale, dtype=s.dtype, constrain=constrain, gather=gather,
                         placement=s.placement, before_head=before_head if _late(s, p) else None)

    vg = jax.value_and_grad(local_loss, has_aux=True)

    def local(p, b, scale):
        mbs = split_microbatches(b, m)

        def body(carry, mb):
            (_, parts), g = vg(p, mb, scale)
            return (_add(carry[0], parts), _add(carry[1], red.per_microbatch(reducer, g))), None
        # ZeRO-2 accumulates each leaf's reduce-scattered block
        scattered = jax.tree.map(lambda d: d if t.zero_stage == 2 else None, red.dims)
        zeros = jax.tree.map(lambda x, d, k: jnp.zeros(_scattered_shape(x.shape, d, k), x.dtype), p, scattered,
                             red.scattered())
        if m == 1:
            (parts, g), _ = body((zero_parts(s.model), zeros), jax.tree.map(lambda x: x[0], mbs))
        else:
            (parts, g), _ = jax.lax.scan(body, (zero_parts(s.model), zeros), mbs)
        return jax.lax.psum(parts, red.axes), red.per_step(reducer, g)

    fn = jax.shard_map(local, mesh=s.mesh, in_specs=(red.manual_specs("param", manual), s.layout.batch_spec(), P()),
                       out_specs=(P(), red.manual_specs("grad", manual)), axis_names=manual, check_vma=False)
    return fn(params, batch, scale)


# ----------------------------------------------------------------------------- steps

def loss_and_grads(s: Setup, params, batch, scale=None):
    """(parts, gradient) of the objective over the global batch (models/objectives/objective.py `objective`), summed
    over `data`: parts["loss"] is scale["loss"] x the loss sum, parts["aux"] each aux output's sum.
    scale defaults to the batch's own (`scales`: the mean over its counted tokens, each aux over its count)."""
    if scale is None:
        scale = scales(s.model, batch)
    # every pipeline schedule runs from its table, synced over `data` once per step
    paths = {reduction.PIPELINE: pipeline.loss_and_grads, reduction.EXPLICIT: _manual_grads,
             reduction.COMPILER: _auto_grads}
    return paths[s.reduction.where](s, params, batch, scale)



def train_step(s: Setup, state: dict, batch: jax.Array):
    """One optimizer step. Pure: (state, batch) -> (state, metrics)."""
    params = state["params"]
    # the step's divisions and counts from the rows in their own order (a document's or a depth's count reads
    # neighbouring tokens), then each row's tokens in its context ranks' order (identity without)
    scale, counts = scales(s.model, batch), aux_counts(s.model, batch)
    batch = s.in_context_order(batch)
    parts, grads = loss_and_grads(s, params, batch, scale)  # the mean over the step's counted tokens, the aux sums
    grads = frozen_zeroed(s.model, grads)  # a frozen weight's (a LoRA base's embedding or head): not a gradient
    opt_sh = s.layout.tree("opt", s.param_shapes, s.logical)
    if s.cfg.train.zero_stage >= 1:  # update only this device's slice of the optimizer state
        grads = _constrain_tree(grads, opt_sh)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = s.tx.update(grads, state["opt_state"], params)
    # then what the family sets itself from the step's aux sums (DeepSeek's router bias from the experts' loads)
    params, own = family(s.model.family).after_step(s.model, optax.apply_updates(params, updates), parts["aux"])
    params = _constrain_tree(params, s.shardings["params"])
    new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
    lr = s.schedule(schedule_count(state["opt_state"]))  # the rate this update used
    return new, {**part_metrics(parts, counts), **own, "grad_norm": grad_norm, "lr": lr,
                 "counted_tokens": counted(batch)}


def eval_step(s: Setup, params, batch):
    """(loss sum, counted tokens) of a batch: the evaluation sums both over its batches, then divides."""
    batch = s.in_context_order(batch)
    if s.reduction.where == reduction.PIPELINE:  # through the stages' forward: no layer's weights leave its stage
        sums = pipeline_eval.eval_sums(s, params, batch, scales(s.model, batch))
        return sums if s.model.dpo is not None else (sums["loss"], counted(batch))
    kw = dict(dtype=s.dtype, constrain=s.layout.constrainer(), placement=s.placement)
    if s.model.dpo is not None:  # preference pairs: the pair loss and each metric, summed (trainer/run/evaluator.py)
        return dpo_eval_sums(s.model, params, batch, **kw)
    return loss_sum(s.model, params, batch, **kw), counted(batch)


def jit_train_step(s: Setup):
    """train_step behind the NaN/spike guard, jitted once with explicit in/out shardings and the state donated."""
    # local SGD / DiLoCo: replicas step apart and sync every train.sync_every steps
    inner = localsgd.train_step if localsgd.enabled(s.cfg) else train_step
    step = functools.partial(guard.guarded_step, functools.partial(inner, s), s.cfg)
    return jax.jit(step, in_shardings=(s.shardings, s.batch_sharding()),
                   out_shardings=(s.shardings, s.layout.replicated), donate_argnums=0)


def jit_eval_step(s: Setup):
    if localsgd.enabled(s.cfg):
        return localsgd.jit_eval_step(s)
    return jax.jit(functools.partial(eval_step, s), in_shardings=(s.shardings["params"], s.batch_sharding()),
                   out_shardings=s.layout.replicated)
