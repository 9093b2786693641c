"""The planner's vocabulary: a layout (Strategy), as the trainer runs it (executed), and one kind of traffic
(Transfer)."""
from __future__ import annotations

import dataclasses

from meshes import CONTEXT, DATA, EXPERT, MODEL, RULES, STAGE, MeshShape, Rules
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

    # the sizes, by name, of the axes whose costs the planner models (trainer/plan/comm.py, memory.py); `data`: the
    # ranks the batch's rows are split over (data x expert)
    data = property(lambda self: self.mesh[DATA] * self.expert)
    stage = property(lambda self: self.mesh[STAGE])
    model = property(lambda self: self.mesh[MODEL])
    # train.sequence_parallel: the residual stream's sequence over `model` (its rule differs from the sequence's)
    sequence_parallel = property(lambda self: self.mesh[MODEL] > 1 and self.rules["res_seq"] != self.rules["seq"])
    context = property(lambda self: self.mesh[CONTEXT] if CONTEXT in self.mesh.names else 1)
    expert = property(lambda self: self.mesh[EXPERT] if EXPERT in self.mesh.names else 1)

    @property
    def batch_axes(self) -> str:
        """The axes gradients are summed over and ZeRO shards over, as a Transfer (and the HLO) names them: `data`;
        with `expert` and `context` where they split the batch (a context rank is data-parallel for the weights),
        those of more than one rank (`context` alone with one data rank)."""
        return axes_named([DATA, EXPERT, CONTEXT], self.mesh)

    def axes_left(self, split) -> str:
        """The batch axes a leaf split over `split` (its rules' mesh axes) is summed over, named as batch_axes
        names them; '' where none has more than one rank."""
        return axes_named([a for a in (DATA, EXPERT, CONTEXT) if a not in split], self.mesh, "")

    @property
    def devices(self) -> int:
        return self.mesh.devices

    def describe(self) -> str:
        pp = f" V={self.repeats}" if self.repeats > 1 else ""
        pp += f" {self.schedule}" if self.stage > 1 else ""
        ep = f" experts over {self.rules['experts']}" if self.rules["experts"] else ""
        ep += f" context by {self.context_attention}" if self.context > 1 else ""
        ep += " sequence-parallel" if self.sequence_parallel else ""
        return f"{self.mesh.describe()} ZeRO-{self.zero} M={self.microbatches}{pp} remat={self.remat}{ep}"


def axes_named(axes, mesh: MeshShape, none: str = DATA) -> str:
    """Mesh axes as a Transfer (and trainer/plan/hlo.py) names them: those of more than one rank, joined by commas
    in mesh order (`none` where there are none)."""
    return ",".join(a for a in mesh.names if a in axes and mesh[a] > 1) or none


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
    # runs only where a dispatch buffer overflows (an MoE's exact path, moe/overflow): listed, not in the step's
    # totals (XLA's HLO holds it in a conditional, whose branches trainer/plan/hlo.py counts as if each ran)
    overflow: bool = False

    def times(self, n: float) -> "Transfer":
        """The same traffic n times over."""
        return dataclasses.replace(self, bytes=n * self.bytes, count=n * self.count, seconds=n * self.seconds)
