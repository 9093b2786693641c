"""`train.profile_steps=A:B`: a jax.profiler trace of steps A..B (numbered as in the log, inclusive)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import jax

from trainer.config import step_range


class StepProfiler:
    """Starts a trace before step A and stops it after step B has finished on the devices."""

    def __init__(self, spec: str, log_dir: Path):
        self.steps, self.log_dir, self.active = step_range(spec, "train.profile_steps"), log_dir, False

    def annotate(self, step: int):
        """Marks the step for XProf's step view while tracing."""
        return jax.profiler.StepTraceAnnotation("train", step_num=step) if self.active else contextlib.nullcontext()

    def before(self, step: int):
        if self.steps and not self.active and self.steps[0] <= step <= self.steps[1]:
            jax.profiler.start_trace(str(self.log_dir))
            self.active = True

    def after(self, step: int, outputs):
        if self.active and step >= self.steps[1]:
            self.stop(outputs)

    def stop(self, outputs=None):
        if self.active:
            jax.block_until_ready(outputs)  # the trace should hold the steps' device work
            jax.profiler.stop_trace()
            self.active = False
