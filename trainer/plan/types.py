"""The planner's vocabulary: a layout (Strategy), as the trainer runs it (executed), and one kind of traffic
(Transfer)."""
from __future__ import annotations

import dataclasses

from meshes import CONTEXT, DATA, MODEL, RULES, STAGE, MeshShape, Rules
from trainer.config import PIPELINE_REMATS


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One layout: mesh shape (meshes/axes.py), ZeRO stage, microbatches, remat, pipeline repeats, gradient sync,
    schedule, and the logical->mesh rules it lays weights out by."""
    mesh: MeshShape
    zero: int
    microbatches: int
    remat: str
    repeats: int = 1
    grad_sync: str = "auto"
    schedule: str = "gpipe"  # train.pipeline_schedule (meaningful where stage > 1)
    rules: Rules = RULES
    balance: bool = True  # train.context_load_balance (meaningful where context > 1)
    context_attention: str = "all_gather"  # train.context_attention (meaningful where context > 1)

    # the sizes, by name, of the axes whose costs the planner models (trainer/plan/comm.py, memory.py)
    data = property(lambda self: self.mesh[DATA])
    stage = property(lambda self: self.mesh[STAGE])
    model = property(lambda self: self.mesh[MODEL])
    context = property(lambda self: self.mesh[CONTEXT] if CONTEXT in self.mesh.names else 1)

    @property
    def batch_axes(self) -> str:
        """The axes gradients are summed over and ZeRO shards over, as a Transfer (and the HLO) names them: `data`,
        `data,context` under context parallelism (a context rank is data-parallel for the weights), `context` with
        one data rank."""
        if self.context == 1:
            return DATA
        return CONTEXT if self.data == 1 else f"{DATA},{CONTEXT}"

    @property
    def devices(self) -> int:
        return self.mesh.devices

    def describe(self) -> str:
        pp = f" V={self.repeats}" if self.repeats > 1 else ""
        pp += f" {self.schedule}" if self.stage > 1 else ""
        ep = " experts over data" if self.rules["experts"] == DATA else ""
        ep += f" context by {self.context_attention}" if self.context > 1 else ""
        return f"{self.mesh.describe()} ZeRO-{self.zero} M={self.microbatches}{pp} remat={self.remat}{ep}"


def executed(st: Strategy) -> Strategy:
    """The layout as the trainer runs it: a key its executor ignores set to the value it runs with."""
    if st.stage > 1 and st.remat not in PIPELINE_REMATS:
        # trainer/parallel/pipeline.py recomputes each stage body whole for its backward and runs its layers
        # without per-layer remat: none, dots and full trace the same program (tests/test_plan.py)
        return dataclasses.replace(st, remat="none")
    return st


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Bytes one device sends per step for one kind of collective over one mesh axis (and, timed, its seconds)."""
    axis: str
    kind: str  # all-reduce | all-gather | reduce-scatter | collective-permute (HLO op names)
    what: str
    bytes: float
    count: float = 1  # collectives per step
    seconds: float = 0.0  # where a model of the links has timed it (the simulator)

    def times(self, n: float) -> "Transfer":
        """The same traffic n times over."""
        return dataclasses.replace(self, bytes=n * self.bytes, count=n * self.count, seconds=n * self.seconds)
