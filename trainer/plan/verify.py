"""`meshtrain plan --verify`: compile the real step ahead of time and read XLA's own numbers.

Nothing runs: the train step is lowered with abstract inputs and compiled for the simulated
CPU devices; `memory_analysis()` gives the bytes of its arguments (parameters, optimizer state,
step and batch), scratch and outputs (`Footprint`, which the run's memory check reads too) and a
second compile of the gradient function gives the gradients' bytes as the implementation holds them.
The HLO gives every collective's bytes (trainer/plan/hlo.py); in the table executor's tick each
branch and 0-or-1-trip step counts as often as the schedule table runs it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from meshes import STAGE
from trainer.plan.hlo import collective_bytes

# About 3x faster compiles. The partitioned HLO, hence every collective and argument size, is the
# same as a default compile; without the fusion emitters XLA:CPU's scratch differs by < 0.1%.
_FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
         "xla_cpu_use_fusion_emitters": False}


@functools.lru_cache(maxsize=None)
def fast_compile() -> dict:
    """The options of _FAST this XLA knows (jax 0.12's XLA:CPU has no fusion-emitter switch)."""
    def known(k, v):
        try:
            jax.jit(lambda x: x + 1).lower(1.0).compile({k: v})
            return True
        except Exception as e:  # noqa: BLE001  (XLA raises JaxRuntimeError for an unknown option)
            if "No such compile option" in str(e):
                return False
            raise
    return {k: v for k, v in _FAST.items() if known(k, v)}


@dataclasses.dataclass(frozen=True)
class Footprint:
    """XLA's memory analysis of one compiled program, bytes per device."""
    argument_bytes: int  # the state and the batch
    temp_bytes: int  # the step's scratch: activations, gradients, buffers
    output_bytes: int
    alias_bytes: int  # outputs written into donated arguments

    @classmethod
    def of(cls, compiled) -> Footprint:
        m = compiled.memory_analysis()
        return cls(m.argument_size_in_bytes, m.temp_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes)

    @property
    def total_bytes(self) -> int:
        """The program's peak: arguments + temp + the outputs not written into an argument."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


@dataclasses.dataclass(frozen=True)
class Measured(Footprint):
    """XLA's numbers for one compiled step, per device."""
    params_opt_bytes: int  # arguments less the step counter and the batch
    grads_bytes: int | None  # outputs of the gradient function less the loss (None: not compiled)
    collectives: dict  # (kind, axes) -> bytes one device sends per step (an MoE dispatch's exact path apart)
    mesh_shape: dict
    text: str = dataclasses.field(repr=False, default="")
    flops: float | None = None  # XLA's FLOP count of the step, per device (its cost analysis)
    platform: str = "cpu"  # what it was compiled for
    # an MoE dispatch's exact path, which runs only where a buffer overflows: (kind, axes) -> bytes, as if it ran
    overflow: dict = dataclasses.field(default_factory=dict)

    def axis_bytes(self, axis: str) -> float:
        """Collective bytes over one mesh axis (a collective spanning several axes counts under each)."""
        return sum(b for (_, axes), b in self.collectives.items() if axis in axes)

    @property
    def comm_bytes(self) -> float:
        return sum(self.collectives.values())


def abstract_inputs(s):
    """The train state and batch as abstract arrays with their shardings."""
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), s.shapes, s.shardings)
    return state, s.abstract_batch()


def measure(cfg, devices=None, grads: bool = True, options: dict | None = None) -> Measured:
    """Compile cfg's train step (and gradient function) for `devices` (default: all) and measure them.

    `options` are XLA's compile options; None: fast_compile() for CPU devices, XLA's defaults elsewhere
    (a TPU topology compiled ahead of time)."""
    from trainer.state import make_setup
    from models.objectives.objective import zero_parts
    from models.frozen import trained_only
    from trainer.step import jit_train_step, loss_and_grads
    if devices is None:  # a fully given mesh uses the first devices it needs
        from meshes import devices_named
        devices = jax.devices()[:devices_named(cfg.mesh) or jax.device_count()]
    s = make_setup(cfg, devices)
    platform = s.mesh.devices.flat[0].platform
    if options is None:
        options = fast_compile() if platform == "cpu" else {}
    state, batch = abstract_inputs(s)
    with jax.set_mesh(s.mesh):
        step = jit_train_step(s).lower(state, batch).compile(options)
        g_bytes = None
        if grads:  # the gradients as loss_and_grads returns them (its outputs, less the loss and aux scalars; a
            # frozen weight's, zero and never kept by the step, left out)
            def grad_fn(p, b):
                parts, g = loss_and_grads(s, p, b)
                return parts, trained_only(s.model, g)
            grad_fn = jax.jit(grad_fn, in_shardings=(s.shardings["params"], s.batch_sharding()))
            g_mem = grad_fn.lower(state["params"], batch).compile(options).memory_analysis()
            g_bytes = g_mem.output_size_in_bytes - 4 * len(jax.tree.leaves(zero_parts(s.model)))
    fp = Footprint.of(step)
    split = int(np.prod([s.mesh.shape[a] for a in s.layout.batch_axes]))  # rows over data, tokens over context
    n_batch = sum(f.size * f.dtype.itemsize for f in jax.tree.leaves(batch)) // split
    text = step.as_text()
    return Measured(
        **dataclasses.asdict(fp), params_opt_bytes=fp.argument_bytes - n_batch - 4, grads_bytes=g_bytes,
        collectives=collective_bytes(text, dict(s.mesh.shape), *table_weights(s)), mesh_shape=dict(s.mesh.shape),
        text=text, flops=_flops(step), platform=platform,
        overflow=collective_bytes(text, dict(s.mesh.shape), *table_weights(s), apart=True))


def _flops(compiled) -> float | None:
    """XLA's FLOP count of a compiled program (None where its backend gives none)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    return float(cost["flops"]) if cost and "flops" in cost else None


def table_weights(s) -> tuple[list[float] | None, dict[str, float] | None]:
    """How often a device runs each part of the table executor's tick (None, None without it): the
    share of the schedule's (tick, stage) cells that take each branch of the forward switch (none,
    forward, forward with embedding), and the mean trips of the 0-or-1-trip loops of the steps that
    add to the gradients, named by the function of trainer/parallel/pipeline.py they run."""
    from trainer.parallel import pipeline, schedules as sc
    if s.mesh.shape[STAGE] == 1:
        return None, None
    t = s.cfg.train
    _, pl = pipeline.table_plan(t.pipeline_schedule, s.mesh.shape[STAGE], t.microbatches, t.pipeline_repeats)
    share = np.bincount(np.asarray(pl.branch).ravel(), minlength=1 + max(sc.IDLE, sc.FWD, sc.FWD_EMBED,
                                                                       sc.FWD_LOSS, sc.BWD, sc.BWD_EMBED))
    share = share / share.sum()
    switch = [share[sc.IDLE] + share[sc.BWD] + share[sc.BWD_EMBED], share[sc.FWD] + share[sc.FWD_LOSS],
              share[sc.FWD_EMBED]]
    loops = {"loss_step": share[sc.FWD_LOSS], "bwd_step": share[sc.BWD], "bwd_embed_step": share[sc.BWD_EMBED]}
    return [float(x) for x in switch], {k: float(x) for k, x in loops.items()}
