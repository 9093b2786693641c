"""The train and eval steps: pure functions of (state, batch), jitted once with explicit shardings.

A batch is a dict of named fields (models/batch.py). The step first counts the batch's counted
tokens N (the sum of loss_weight over the whole step batch) and takes 1/N, its one division (1 where
N is 0), and likewise 1/count for each auxiliary output of the family's layers (models/loss.py `scales`;
docs/models.md). Every path below then sums loss_weight x token loss / N (plus each aux sum / its count), and
its gradient, over its microbatches, data ranks and pipeline microbatches: the loss is one mean over the step's
counted tokens whatever the layout, and a step with none has loss 0 and zero gradients. (1/N scales the
loss where its backward starts, so the gradients need no pass of their own to be divided.)

Gradients come from one of two paths:
  compiler  (grad_sync=auto, ZeRO 0/1, one microbatch): plain jit; XLA inserts the gradient all-reduce.
  manual    (grad_sync=psum|ring|ring_bf16, ZeRO 2/3, or microbatches > 1): the loss and gradients run in a
            shard_map that is manual over `data` (tensor parallelism over `model` stays
            with the compiler). Each device differentiates its own rows; the reduction is
            explicit: reduce-scatter for ZeRO 2/3 (once per microbatch, so the accumulated
            gradient stays sharded), all-reduce once per step for ZeRO 0/1. ZeRO-3 weights
            arrive sharded and are all-gathered one layer at a time inside the layer scan;
            the transpose of that all-gather is the gradient's reduce-scatter.
A pipeline (every schedule runs on the table executor, trainer/parallel/pipeline.py) is manual over
`stage` and `data` and syncs with the same reducers once per step, after its tick loop (ZeRO 2/3
included, whatever grad_sync).
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
from models.loss import loss_sum, objective, part_metrics, scales, zero_parts
from models.precision import compute_dtypes
from trainer import guard
from trainer.parallel import localsgd, pipeline as pipeline_1f1b, sync
from trainer.optim import schedule_count
from trainer.parallel.microbatch import split_microbatches
from trainer.state import Setup


def _constrain_tree(tree, shardings):
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def uses_manual_sync(s: Setup) -> bool:
    """Whether the step reduces gradients over `data` itself (else the compiler inserts the all-reduce)."""
    t = s.cfg.train
    # a pipeline (trainer/parallel/pipeline.py) always does, once per step after its tick loop
    return s.mesh.shape["stage"] > 1 or t.grad_sync != "auto" or (
        s.mesh.shape["data"] > 1 and (t.zero_stage >= 2 or t.microbatches > 1))


# ----------------------------------------------------------------------------- compiler path

def _auto_grads(s: Setup, params, batch, scale):
    constrain = s.layout.constrainer()
    vg = jax.value_and_grad(lambda p, b: objective(s.model, p, b, scale, dtype=s.dtype, constrain=constrain,
                                                   placement=s.placement), has_aux=True)
    m = s.cfg.train.microbatches
    if m == 1:
        (_, parts), g = vg(params, batch)
        return parts, g
    gsh = s.layout.tree("grad", s.param_shapes, s.logical)
    mbs = jax.lax.with_sharding_constraint(split_microbatches(batch, m), P(None, "data"))

    def body(carry, mb):
        (_, parts), g = vg(params, mb)
        acc = _constrain_tree(jax.tree.map(jnp.add, carry[1], g), gsh)
        return (_add(carry[0], parts), acc), None

    zeros = _constrain_tree(jax.tree.map(jnp.zeros_like, params), gsh)
    return jax.lax.scan(body, (zero_parts(s.model), zeros), mbs)[0]


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


# ----------------------------------------------------------------------------- manual path

def _spec_with_data(ndim: int, dim: int | None) -> P:
    if dim is None:
        return P()
    return P(*([None] * dim + ["data"]))


def _scattered_shape(shape, dim, k):
    return shape if dim is None else shape[:dim] + (shape[dim] // k,) + shape[dim + 1:]


def _manual_grads(s: Setup, params, batch, scale):
    t, lay = s.cfg.train, s.layout
    k, m, zero = s.mesh.shape["data"], t.microbatches, t.zero_stage
    dims = jax.tree.map(lambda sh, lg: lay.data_dim(sh.shape, lg), s.param_shapes, s.logical)
    shapes = s.param_shapes
    sharded_params = zero >= 3
    in_p = jax.tree.map(lambda sh, d: _spec_with_data(sh.ndim, d if sharded_params else None), shapes, dims)
    out_g = jax.tree.map(lambda sh, d: _spec_with_data(sh.ndim, d if zero >= 2 else None), shapes, dims)
    specs = jax.tree.map(lambda sh, lg: lay.compute_spec(sh.shape, lg), shapes, s.logical)
    constrain = s.layout.constrainer(manual={"data"})
    reducer = sync.make(t.grad_sync, "data", k)

    def full_params(p):
        """ZeRO-3: gather the non-layer weights; layer weights are gathered inside the scan."""
        if not sharded_params:
            return p, lambda lp: lp
        # layer weights gathered in the compute dtype (half the bytes in bfloat16), the rest as stored
        cast = compute_dtypes(s.model, p, s.dtype)
        top = {n: v for n, v in p.items() if n != "layers"}
        top = reducer.all_gather_tree(top, {n: dims[n] for n in top}, {n: specs[n] for n in top},
                                      {n: cast[n] for n in top})
        layer_dims = {n: (None if d is None else d - 1) for n, d in dims["layers"].items()}
        layer_specs = {n: P(*sp[1:]) for n, sp in specs["layers"].items()}
        return {**top, "layers": p["layers"]}, lambda lp: reducer.all_gather_tree(lp, layer_dims, layer_specs,
                                                                                  cast["layers"])

    def local_loss(p, mb, scale):
        full, gather = full_params(p)
        return objective(s.model, full, mb, scale, dtype=s.dtype, constrain=constrain, gather=gather,
                         placement=s.placement)

    vg = jax.value_and_grad(local_loss, has_aux=True)

    def reduce_micro(g):
        """Per microbatch: ZeRO-2 reduce-scatters; ZeRO-3 was reduce-scattered by the gather's
        transpose; leaves ZeRO leaves replicated (no divisible dim) are all-reduced."""
        if zero < 2:
            return g
        if zero == 2:
            return reducer.reduce_scatter_tree(g, dims, specs)
        return jax.tree.map(lambda x, d: reducer.all_reduce(x) if d is None else x, g, dims)

    def local(p, b, scale):
        mbs = split_microbatches(b, m)
        def body(carry, mb):
            (_, parts), g = vg(p, mb, scale)
            g = reduce_micro(g)
            return (_add(carry[0], parts), jax.tree.map(jnp.add, carry[1], g)), None
        zeros = jax.tree.map(lambda x, d: jnp.zeros(_scattered_shape(x.shape, d if zero == 2 else None, k),
                                                    x.dtype), p, dims)
        if m == 1:
            (parts, g), _ = body((zero_parts(s.model), zeros), jax.tree.map(lambda x: x[0], mbs))
        else:
            (parts, g), _ = jax.lax.scan(body, (zero_parts(s.model), zeros), mbs)
        if zero < 2:  # one all-reduce per step, after accumulation
            g = reducer.all_reduce_tree(g, dims, specs)
        return jax.lax.psum(parts, "data"), g

    fn = jax.shard_map(local, mesh=s.mesh, in_specs=(in_p, P("data"), P()), out_specs=(P(), out_g),
                       axis_names={"data"}, check_vma=False)
    return fn(params, batch, scale)


# ----------------------------------------------------------------------------- steps

def loss_and_grads(s: Setup, params, batch, scale=None):
    """(parts, gradient) of the objective over the global batch (models/loss.py `objective`), summed over
    `data`: parts["loss"] is scale["loss"] x the loss sum, parts["aux"] the layers' aux (sum, count) pairs.
    scale defaults to the batch's own (`scales`: the mean over its counted tokens, each aux over its count)."""
    if scale is None:
        scale = scales(s.model, batch)
    if s.mesh.shape["stage"] > 1:  # every pipeline schedule runs from its table, synced over `data` once per step
        return pipeline_1f1b.loss_and_grads(s, params, batch, scale)
    if uses_manual_sync(s):
        return _manual_grads(s, params, batch, scale)
    return _auto_grads(s, params, batch, scale)



def train_step(s: Setup, state: dict, batch: jax.Array):
    """One optimizer step. Pure: (state, batch) -> (state, metrics)."""
    params = state["params"]
    parts, grads = loss_and_grads(s, params, batch)  # the mean over the step's counted tokens, the aux sums
    opt_sh = s.layout.tree("opt", s.param_shapes, s.logical)
    if s.cfg.train.zero_stage >= 1:  # update only this device's slice of the optimizer state
        grads = _constrain_tree(grads, opt_sh)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = s.tx.update(grads, state["opt_state"], params)
    params = _constrain_tree(optax.apply_updates(params, updates), s.shardings["params"])
    new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
    lr = s.schedule(schedule_count(state["opt_state"]))  # the rate this update used
    return new, {**part_metrics(parts), "grad_norm": grad_norm, "lr": lr, "counted_tokens": counted(batch)}


def eval_step(s: Setup, params, batch):
    """(loss sum, counted tokens) of a batch: the evaluation sums both over its batches, then divides."""
    return (loss_sum(s.model, params, batch, dtype=s.dtype, constrain=s.layout.constrainer(), placement=s.placement),
            counted(batch))


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
