"""`meshtrain plan --verify`: compile the real step ahead of time and read XLA's own numbers.

Nothing runs: the train step is lowered with abstract inputs and compiled for the simulated
CPU devices; `memory_analysis()` gives the bytes of its arguments (parameters, optimizer state,
step and batch) and a second compile of the gradient function gives the gradients' bytes as the
implementation holds them. The HLO gives every collective's bytes (trainer/plan/hlo.py); in the
table executor's tick switch each branch counts as often as the schedule table runs it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from trainer.plan.hlo import collective_bytes

# About 3x faster compiles. The partitioned HLO, hence every collective and argument size, is the
# same as a default compile; without the fusion emitters XLA:CPU's scratch differs by < 0.1%.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                "xla_cpu_use_fusion_emitters": False}


@dataclasses.dataclass(frozen=True)
class Measured:
    """XLA's numbers for one compiled step, per device."""
    params_opt_bytes: int  # arguments less the step counter and the batch
    grads_bytes: int | None  # outputs of the gradient function less the loss (None: not compiled)
    temp_bytes: int  # the step's scratch: activations, gradients, buffers
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    collectives: dict  # (kind, axes) -> bytes one device sends per step
    mesh_shape: dict
    text: str = dataclasses.field(repr=False, default="")

    def axis_bytes(self, axis: str) -> float:
        """Collective bytes over one mesh axis (a collective spanning several axes counts under each)."""
        return sum(b for (_, axes), b in self.collectives.items() if axis in axes)

    @property
    def comm_bytes(self) -> float:
        return sum(self.collectives.values())


def _abstract_inputs(s):
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), s.shapes, s.shardings)
    batch = jax.ShapeDtypeStruct((s.cfg.train.batch_size, s.model.seq_len + 1), np.int32,
                                 sharding=s.batch_sharding())
    return state, batch


def measure(cfg, devices=None, grads: bool = True) -> Measured:
    """Compile cfg's train step (and gradient function) for `devices` (default: all) and measure them."""
    from trainer.state import make_setup
    from trainer.step import jit_train_step, loss_and_grads
    if devices is None:  # a fully given mesh uses the first devices it needs
        sizes = (cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model)
        devices = jax.devices()[:np.prod(sizes)] if min(sizes) > 0 else jax.devices()
    s = make_setup(cfg, devices)
    state, batch = _abstract_inputs(s)
    with jax.set_mesh(s.mesh):
        step = jit_train_step(s).lower(state, batch).compile(FAST_COMPILE)
        g_bytes = None
        if grads:  # the gradients as loss_and_grads returns them (its outputs, less the loss)
            grad_fn = jax.jit(functools.partial(loss_and_grads, s),
                              in_shardings=(s.shardings["params"], s.batch_sharding()))
            g_mem = grad_fn.lower(state["params"], batch).compile(FAST_COMPILE).memory_analysis()
            g_bytes = g_mem.output_size_in_bytes - 4
    mem = step.memory_analysis()
    n_batch = batch.size * batch.dtype.itemsize // s.mesh.shape["data"]
    text = step.as_text()
    return Measured(
        params_opt_bytes=mem.argument_size_in_bytes - n_batch - 4,
        grads_bytes=g_bytes,
        temp_bytes=mem.temp_size_in_bytes, argument_bytes=mem.argument_size_in_bytes,
        output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
        collectives=collective_bytes(text, dict(s.mesh.shape), branch_weights(s)), mesh_shape=dict(s.mesh.shape),
        text=text)


def branch_weights(s) -> list[float] | None:
    """Share of the (tick, stage) cells of the table executor's schedule that run each branch of its
    tick switch (None without it): a device runs one branch per tick, not all of them."""
    from trainer import pipeline_1f1b, schedules
    from trainer.step import table_executor
    if not table_executor(s):
        return None
    t = s.cfg.train
    _, pl = pipeline_1f1b.table_plan(t.pipeline_schedule, s.mesh.shape["stage"], t.microbatches, t.pipeline_repeats)
    branches = 1 + max(schedules.IDLE, schedules.FWD, schedules.FWD_EMBED, schedules.FWD_LOSS, schedules.BWD,
                       schedules.BWD_EMBED)  # the switch has them all, used or not
    counts = np.bincount(np.asarray(pl.branch).ravel(), minlength=branches)
    return (counts / counts.sum()).tolist()
