"""Preemption: SIGTERM or Ctrl-C stops the run after the current step (every process the same step), and
the checkpoint plug-in saves it; the signal handlers are in place from the first step to the last save."""
from __future__ import annotations

from trainer.ckpt.preempt import StopRequest
from trainer.run.plugin import Plugin, Stop


class Preemption(Plugin):
    waits = "the stop agreement between processes"

    def __init__(self, run):
        self.request = StopRequest().__enter__()

    def at_sync(self, run, step: int):
        # with several processes they agree, at sync points only (a collective every step would stall dispatch)
        if self.request.agreed(can_sync=run.host is not None):
            run.preempted = True
            return Stop("preempted")

    def on_exit(self, run, error):
        self.request.__exit__(None, None, None)
