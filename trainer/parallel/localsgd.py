"""Local SGD and DiLoCo (train.sync=local_sgd|diloco): replicas train apart for H steps, then sync.

State: every leaf of `params` and `opt_state` gets a leading replica axis R = mesh.data, split
over `data`, so each data shard holds its own replica's parameters and optimizer state (ZeRO does
not apply: a replica needs all of its state). DiLoCo adds `outer` = {params, momentum}, replicated.
A leaf the rules split over `data` (each rank's experts) is not replicated: one array, each rank its slice, whose
gradient already sums every replica's rows (divided by R: their mean) and which is never averaged.
Step: a shard_map manual over `data` (tensor parallelism stays with the compiler). Each replica
differentiates its own rows and takes its own optimizer step, with no communication. On every
H-th step (a lax.cond whose branch is the same on every device) the replicas all-reduce their
parameters:
  local_sgd  params_r <- mean_r params_r
  diloco     delta = outer - mean_r params_r            (the outer gradient)
             m <- mu m + delta;  outer <- outer - lr (delta + mu m)   (Nesterov)
             params_r <- outer
One parameter all-reduce per H steps replaces one gradient all-reduce per step: the data axis
carries 1/H of the synchronous traffic. Inner optimizer states stay local.
With an optimizer linear in the gradient (train.optimizer=sgd, train.grad_clip=0), H=1 reproduces
synchronous training: the replicas' mean update is the update of the mean gradient (DiLoCo with
outer lr 1 and no momentum too). AdamW's update is not linear in the gradient, so there H=1 differs.
Each replica's loss is the mean over its own batch's counted tokens (loss_weight, models/batch.py),
so H=1 equals synchronous training when the replicas count equally many tokens; the logged loss
is the mean over all replicas' counted tokens, the logged grad norm the replicas' mean. An aux output (an MoE's
router losses, moe/dropped) likewise: each replica divides its sum by its own rows' count, the log
divides the replicas' summed sums by their summed counts (tests/test_moe_everywhere.py).
Evaluation uses the replicas' mean: at multiples of H, the synced model itself.
train.sync_warmup=W averages after every step up to step W first (post-local SGD): local steps
from a random start drift apart fastest, and DiLoCo itself was run from a trained start.
DiLoCo's published outer settings (lr 0.7, momentum 0.9) were tuned for H=500. At small H the
inner AdamW momentum already spans several rounds, and outer momentum on top of it overshoots:
there an outer step of about one (outer lr 0.5, momentum 0.5) does as well as plain averaging.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from models.batch import counted, mean_of
from models.objectives.objective import aux_counts, loss_sum, objective, part_metrics, scales, zero_parts
from meshes.rules import keep
from trainer.parallel.collective_costs import bus_factor
from trainer.optim import map_params, schedule_count
from trainer.parallel.microbatch import split_microbatches
from trainer.parallel.reduction import NONE


def enabled(cfg) -> bool:
    return cfg.train.sync != "every_step"


def owned(tx, reduction, opt_state) -> dict:
    """Whether each replica holds its own copy of each leaf of params and opt_state (a tree of bools each): every
    leaf but those the rules split over the data axis (one array, each rank its slice: never averaged)."""
    params = jax.tree.map(lambda r: r.kind != NONE, reduction.leaves)
    return {"params": params, "opt_state": map_params(tx, lambda _, mine: mine, opt_state, params,
                                                                 transform_non_params=lambda _: True)}


def stack(cfg, tx, shapes: dict, shardings: dict, reduction) -> tuple[dict, dict]:
    """Abstract state and shardings with a replica axis (over reduction.axis) on the owned leaves of params and
    opt_state (+ DiLoCo's outer)."""
    own, axis, replicas = owned(tx, reduction, shapes["opt_state"]), reduction.axis, reduction.size
    grow = lambda x, mine: jax.ShapeDtypeStruct((replicas,) + x.shape, x.dtype) if mine else x  # noqa: E731
    spread = lambda sh, mine: NamedSharding(sh.mesh, P(axis, *sh.spec)) if mine else sh  # noqa: E731
    out_shapes = {**shapes, **{k: jax.tree.map(grow, shapes[k], own[k]) for k in own}}
    out = {**shardings, **{k: jax.tree.map(spread, shardings[k], own[k]) for k in own}}
    if cfg.train.sync == "diloco":
        out_shapes["outer"] = {"params": shapes["params"], "momentum": shapes["params"]}
        out["outer"] = {"params": shardings["params"], "momentum": shardings["params"]}
    return out_shapes, out


def one_replica(s) -> tuple[dict, dict]:
    """(shapes, shardings) of one set of parameters of the run: a replica's when they are stacked."""
    shapes, shardings = s.shapes["params"], s.shardings["params"]
    if not enabled(s.cfg):
        return shapes, shardings
    own = owned(s.tx, s.reduction, s.shapes["opt_state"])["params"]
    return (jax.tree.map(lambda x, mine: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if mine else x, shapes, own),
            jax.tree.map(lambda sh, mine: NamedSharding(sh.mesh, P(*sh.spec[1:])) if mine else sh, shardings, own))


def replicate(cfg, replicas: int, state: dict, own: dict | None = None) -> dict:
    """Inside the jitted init: one copy of params and optimizer state per replica (of the `owned` leaves; None:
    every leaf)."""
    def copies(tree, mine):
        copy = lambda x, m=True: jnp.broadcast_to(x, (replicas,) + x.shape) if m else x  # noqa: E731
        return jax.tree.map(copy, tree) if mine is None else jax.tree.map(copy, tree, mine)
    own = own or {}
    out = {**state, **{k: copies(state[k], own.get(k)) for k in ("params", "opt_state")}}
    if cfg.train.sync == "diloco":
        out["outer"] = {"params": state["params"], "momentum": jax.tree.map(jnp.zeros_like, state["params"])}
    return out


def _mean(axis, own, p):
    """The replicas' mean of each owned leaf; a leaf split over the replicas' axis is its own."""
    return jax.tree.map(lambda x, mine: jax.lax.pmean(x, axis) if mine else x, p, own)


def _sync(t, axis, own, carry):
    """The every-H-steps all-reduce of the replicas' parameters (and DiLoCo's outer step)."""
    p, outer = carry
    mean = _mean(axis, own, p)
    if t.sync == "local_sgd":
        return mean, outer
    delta = jax.tree.map(jnp.subtract, outer["params"], mean)
    mom = jax.tree.map(lambda m, d: t.outer_momentum * m + d, outer["momentum"], delta)
    new = jax.tree.map(lambda o, d, m: o - t.outer_lr * (d + t.outer_momentum * m), outer["params"], delta, mom)
    return new, {"params": new, "momentum": mom}


def _warm_sync(t, axis, own, carry):
    """During train.sync_warmup: plain averaging after every step (post-local SGD, Lin et al.
    2020); DiLoCo's outer parameters follow the mean and its momentum stays zero."""
    p, outer = carry
    mean = _mean(axis, own, p)
    if t.sync == "local_sgd":
        return mean, outer
    return mean, {"params": mean, "momentum": outer["momentum"]}


def _local_grads(s, vg, p, rows, sc, own):
    """(parts, gradient) of this replica's rows (accumulated over train.microbatches). A leaf split over the
    replicas' axis gets every replica's rows' gradient (they reached its slice by all_to_all): divided by the
    replicas, it is their mean, as the owned leaves' averaging makes theirs."""
    m = s.cfg.train.microbatches
    if m == 1:
        (_, parts), g = vg(p, rows, sc)
    else:
        def body(acc, mb):
            (_, pm), gm = vg(p, mb, sc)
            return (jax.tree.map(jnp.add, acc[0], pm), jax.tree.map(jnp.add, acc[1], gm)), None
        zero = (zero_parts(s.model), jax.tree.map(jnp.zeros_like, p))
        (parts, g), _ = jax.lax.scan(body, zero, split_microbatches(rows, m))
    return parts, jax.tree.map(lambda x, mine: x if mine else x / s.reduction.size, g, own)


def train_step(s, state: dict, batch):
    """H-local step: (state, batch) -> (state, metrics); see the module docstring."""
    t, axis = s.cfg.train, s.reduction.axis
    own = owned(s.tx, s.reduction, s.shapes["opt_state"])
    constrain = s.layout.constrainer(manual={axis})
    vg = jax.value_and_grad(lambda p, b, sc: objective(s.model, p, b, sc, dtype=s.dtype, constrain=constrain,
                                                       placement=s.placement), has_aux=True)

    def local(st, rows):
        p, o = (jax.tree.map(lambda x, mine: x[0] if mine else x, st[k], own[k]) for k in ("params", "opt_state"))
        lr = s.schedule(schedule_count(o))  # the rate this update uses
        parts, g = _local_grads(s, vg, p, rows, scales(s.model, rows), own["params"])  # this replica's divisors
        grad_norm = optax.tree.norm(g)
        updates, o = s.tx.update(g, o, p)
        p = optax.apply_updates(p, updates)
        step = st["step"] + 1
        carry = (p, st.get("outer", {}))
        every, warm = (functools.partial(f, t, axis, own["params"]) for f in (_sync, _warm_sync))
        sync = lambda c: jax.lax.cond(step % t.sync_every == 0, every, lambda c: c, c)  # noqa: E731
        if t.sync_warmup:
            p, outer = jax.lax.cond(step <= t.sync_warmup, warm, sync, carry)
        else:
            p, outer = sync(carry)
        new = {**st, "step": step, **{k: jax.tree.map(lambda x, mine: x[None] if mine else x, v, own[k])
                                      for k, v in (("params", p), ("opt_state", o))}}
        if "outer" in st:
            new["outer"] = outer
        # Three scalars per step for the log (and two per aux output): the only data-axis traffic between syncs.
        n = counted(rows)
        (total, n, aux, counts), grad_norm = (
            jax.lax.psum((parts["loss"] * n, n, parts["aux"], aux_counts(s.model, rows)), axis),
            jax.lax.pmean(grad_norm, axis))
        return new, {**part_metrics({"loss": mean_of(total, n), "aux": aux}, counts), "grad_norm": grad_norm,
                     "lr": lr, "counted_tokens": n}

    specs = jax.tree.map(lambda sh: keep(sh.spec, {axis}), s.shardings)
    fn = jax.shard_map(local, mesh=s.mesh, in_specs=(specs, s.layout.batch_spec()), out_specs=(specs, P()),
                       axis_names={axis}, check_vma=False)
    return fn(state, batch)


def eval_step(s, params, batch):
    own = owned(s.tx, s.reduction, s.shapes["opt_state"])["params"]
    mean = jax.tree.map(lambda x, mine: x.mean(axis=0) if mine else x, params, own)
    return (loss_sum(s.model, mean, batch, dtype=s.dtype, constrain=s.layout.constrainer(), placement=s.placement),
            counted(batch))


def jit_train_step(s):
    rep = s.layout.replicated
    return jax.jit(functools.partial(train_step, s), in_shardings=(s.shardings, s.batch_sharding()),
                   out_shardings=(s.shardings, rep), donate_argnums=0)


def jit_eval_step(s):
    return jax.jit(functools.partial(eval_step, s), in_shardings=(s.shardings["params"], s.batch_sharding()),
                   out_shardings=s.layout.replicated)


def data_bytes_per_step(cfg, param_bytes: float, replicas: int) -> float:
    """Bytes one device sends on the data axis per step after train.sync_warmup: a ring all-reduce
    every H steps (1 if synchronous)."""
    h = cfg.train.sync_every if enabled(cfg) else 1
    return bus_factor("all-reduce", replicas) * param_bytes / h
