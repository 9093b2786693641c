"""Preemption: SIGTERM or Ctrl-C stops the run after a step every process agrees on, and the checkpoint plug-in
saves it; the signal handlers are in place from the first step to the last save. The agreement is asked after
every step: under jax.distributed it is jax's preemption sync point (a lock and a compare on the host, about a
microsecond: scripts/bench/preemption_sync.py), so a stop is never more than a step or two after the signal."""
from __future__ import annotations

from trainer.ckpt.preempt import StopRequest
from trainer.run.plugin import Plugin, Stop


class Preemption(Plugin):
    waits = "the stop agreement between processes"

    def __init__(self, run):
        self.request = StopRequest().__enter__()

    def at_sync(self, run, step: int):
        # without jax's notifier several processes all-gather their flag, at sync points only
        if self.request.agreed(can_sync=run.host is not None):
            run.preempted = True
            if self.request.jax_owns_sigterm:
                run.console.print(f"meshtrain: a preemption notice (SIGTERM) reached the processes; every process "
                                  f"stops after step {step} and saves")
            return Stop("preempted")

    def on_exit(self, run, error):
        self.request.__exit__(None, None, None)
