"""Train state created already sharded: abstract shapes -> shardings -> jitted init."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from meshes import CONTEXT, DATA, EXPERT, MODEL, RULES, Collectives, Layout, MeshError, Rules, build
from models import ModelConfig, Placement, Transformer, abstract_model, params_of
from models import batch as batch_fields
from models.context_parallel.gather import ContextPlan, order
from trainer import guard
from trainer.parallel import localsgd
from trainer.parallel.reduction import Decision, decide
from trainer.config import Config, compute_dtype, experts_axis, model_config, validate
from trainer.errors import UserError
from trainer.optim import make_optimizer, map_params


@dataclasses.dataclass(frozen=True, eq=False)
class Setup:
    """Everything static about a run: config, mesh, shardings, optimizer."""
    cfg: Config
    model: ModelConfig
    mesh: Mesh
    layout: Layout
    tx: optax.GradientTransformation
    schedule: Any
    dtype: Any
    logical: dict  # logical axes of every parameter
    shapes: dict  # abstract train state
    shardings: dict  # NamedSharding of every leaf of the train state
    placement: Placement  # what the model's program needs of the mesh: its platform, the kv heads' repeat, collectives
    reduction: Decision  # how each gradient is reduced, and where (trainer/parallel/reduction.py)

    @property
    def param_shapes(self):
        return self.shapes["params"]

    def batch_sharding(self):
        """The sharding of every batch field (rows over `data`)."""
        return self.layout.sharding(self.layout.batch_spec())

    def row_sharding(self):
        """The sharding of the batch's rows alone (over `data`), whatever splits each row's tokens."""
        return self.layout.sharding(P(self.layout.batch_spec()[0]))

    def in_context_order(self, batch: dict) -> dict:
        """The batch as the model runs it: under context parallelism with load balancing, each row's tokens
        reordered (models/context_parallel/gather.py `order`; the loss is a sum over tokens, RoPE and masks take the original
        positions); otherwise as it is."""
        plan = self.placement.context
        if plan is None or list(plan.order) == list(range(len(plan.order))):
            return batch
        idx = jnp.asarray(plan.order, jnp.int32)
        return {k: jax.lax.with_sharding_constraint(jnp.take(v, idx, axis=1), self.batch_sharding())
                for k, v in batch.items()}

    def abstract_batch(self, batch_size: int | None = None) -> dict:
        """The step's batch fields as ShapeDtypeStructs (train.batch_size rows unless given), sharded."""
        from models.objectives.grpo import FIELDS as GRPO
        fields = batch_fields.DPO_FIELDS if self.model.dpo is not None else \
            batch_fields.FIELDS + GRPO if self.model.grpo is not None else batch_fields.FIELDS
        return batch_fields.abstract(batch_size or self.cfg.train.batch_size, self.model.seq_len,
                                     self.batch_sharding(), fields)


def rules_for(cfg: Config, data: int, quiet: bool = False, context: int = 1, expert: int = 1, model: int = 1) -> Rules:
    """The run's logical->mesh rules on `data` data ranks, `expert` expert ranks and `context` context ranks: the
    base table (meshes/rules.py) and the entries its config adds (an MoE's experts over `expert`, the batch over
    data x expert: mesh.expert; or the experts over `data`: train.expert_parallel; each sequence's tokens over
    `context`: context parallelism; the residual stream's sequence over `model` ranks too: sequence
    parallelism)."""
    over = experts_axis(cfg, data, quiet, expert)
    rules = RULES.replace(batch=(DATA, EXPERT), experts=EXPERT) if over == EXPERT else \
        RULES.replace(experts=DATA) if over == DATA else RULES
    return rules.sequence(context, cfg.train.sequence_parallel and model > 1)


def rules_by_data(cfg: Config):
    """The rules a layout of the config may run with, as a function of its data and expert ranks, for the planner's
    search: mesh.expert > 1: the experts over `expert`; else train.expert_parallel null: with the experts split over
    `data` where they can be, and replicated; true: split only (none where they cannot be: that layout is not a
    candidate); false: replicated."""
    def rules(data: int, expert: int = 1) -> list[Rules]:
        try:
            over = experts_axis(cfg, data, quiet=True, expert=expert)
        except UserError:
            return []
        return [RULES.replace(experts=DATA), RULES] if over == DATA and cfg.train.expert_parallel is None else \
            [rules_for(cfg, data, quiet=True, expert=expert)]
    return rules


def make_setup(cfg: Config, devices=None, rules: Rules | None = None) -> Setup:
    """The run's setup on `devices` (default: all); `rules` other than the config's (`rules_for`) for a test."""
    devices = list(jax.devices() if devices is None else devices)
    shape = validate(cfg, len(devices))
    try:
        mesh = build(shape, devices)
    except MeshError as e:
        raise UserError(str(e)) from None
    return setup_on(cfg, mesh, devices[0].platform, rules)


def setup_on(cfg: Config, mesh, platform: str, rules: Rules | None = None) -> Setup:
    """The setup on a mesh (a Mesh, or an AbstractMesh to lower for devices this host lacks) whose
    devices are of `platform` ("cpu", "gpu", "tpu"): the model's kernels and compute dtype are that
    platform's."""
    model = mesh.shape[MODEL]
    mc = model_config(cfg)
    layout = Layout(mesh, cfg.train.zero_stage,
                    rules_for(cfg, mesh.shape[DATA], context=mesh.shape.get(CONTEXT, 1),
                              expert=mesh.shape.get(EXPERT, 1), model=model) if rules is None else rules)
    # the kernels of the devices the step runs on; kv heads replicated over `model` (fewer than its ranks): each
    # rank repeats the one its query heads need; the collectives over the layout's logical axes
    context = mesh.shape.get(CONTEXT, 1)
    plan = None if context == 1 else ContextPlan(context, cfg.train.context_attention, tuple(
        int(i) for i in order(mc.seq_len, context, cfg.train.context_load_balance)))
    placement = Placement(platform, model // mc.n_kv_heads if mc.n_kv_heads < model else 1,
                          Collectives(layout.rules, mesh, platform), plan,
                          sequence_parallel=layout.rules["res_seq"] != layout.rules["seq"])
    pshapes, logical, decay, frozen = abstract_model(mc, cfg.train.seed)
    reduction = decide(layout, pshapes, logical, cfg.train.grad_sync, cfg.train.microbatches)
    tx, schedule = make_optimizer(cfg.train, decay, frozen)
    shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": pshapes,
              "opt_state": jax.eval_shape(tx.init, pshapes), "guard": guard.shapes(cfg.train)}
    opt_param_sh = layout.tree("opt", pshapes, logical)
    shardings = {
        "step": layout.replicated,
        "params": layout.tree("param", pshapes, logical),
        "opt_state": map_params(tx, lambda _, sh: sh, shapes["opt_state"], opt_param_sh,
                                           transform_non_params=lambda _: layout.replicated),
        "guard": jax.tree.map(lambda _: layout.replicated, shapes["guard"]),
    }
    if localsgd.enabled(cfg):  # one copy of params and optimizer state per data-parallel replica
        shapes, shardings = localsgd.stack(cfg, tx, shapes, shardings, reduction)
    dtype = jnp.dtype(compute_dtype(cfg, platform))
    return Setup(cfg, mc, mesh, layout, tx, schedule, dtype, logical, shapes, shardings, placement, reduction)


def init_state(s: Setup) -> dict:
    """Initialise the train state directly into its shardings (no device holds it whole)."""
    mc, seed, tx = s.model, s.cfg.train.seed, s.tx

    def init():
        params = params_of(Transformer(mc, rngs=nnx.Rngs(seed)))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
                 "guard": guard.init(s.cfg.train)}
        if not localsgd.enabled(s.cfg):
            return state
        own = localsgd.owned(tx, s.reduction, s.shapes["opt_state"])
        return localsgd.replicate(s.cfg, s.reduction.size, state, own)

    with jax.set_mesh(s.mesh):
        return jax.jit(init, out_shardings=s.shardings)()
