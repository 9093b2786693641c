"""train.profile_steps=A:B as a loop plug-in: the trace starts before step A and stops once step B is done."""
from __future__ import annotations

import contextlib

from trainer.observe.profiling import StepProfiler
from trainer.run.plugin import Plugin


class Profiler(Plugin):
    def __init__(self, run):
        self.p = StepProfiler(run.cfg.train.profile_steps, run.dir / "tensorboard")  # TensorBoard reads it there
        self.annotation = contextlib.nullcontext()

    def before_step(self, run, step: int):
        self.p.before(step)
        self.annotation = self.p.annotate(step)  # marks the step for XProf's step view while tracing
        self.annotation.__enter__()

    def after_step(self, run, step: int):
        self.annotation.__exit__(None, None, None)
        self.p.after(step, (run.state, run.metrics))

    def on_exit(self, run, error):
        self.p.stop(run.state if error is None else None)
