"""Preemption: SIGTERM or Ctrl-C stops the run after a step every process agrees on, and the checkpoint plug-in
saves it; the signal handlers are in place from the first step to the last save. The agreement is asked after
every step: under jax.distributed it is jax's preemption sync point (a lock and a compare on the host, about a
microsecond: scripts/bench/preemption_sync.py); jax's notifier hears of a signal within about a second, so a
stop comes about a second plus a step after it (one process: after the step the signal arrives in)."""
from __future__ import annotations

from trainer.ckpt.preempt import StopRequest
from trainer.run.plugin import Plugin, Stop


class Preemption(Plugin):
    waits = "the stop agreement between processes"

    def __init__(self, run):
        self.request = StopRequest().__enter__()

    def at_sync(self, run, step: int):
        # without jax's notifier several processes all-gather their flag, at sync points only. agreed() is asked
        # after the last step too (jax's protocol counts every call), but a run at train.steps has finished: it
        # exits 0, and a scheduler must not requeue it
        if self.request.agreed(can_sync=run.host is not None) and step < run.cfg.train.steps:
            run.preempted = True
            if self.request.jax_owns_sigterm:
                run.console.print(f"meshtrain: a preemption notice (SIGTERM) reached the processes; every process "
                                  f"stops after step {step} and saves")
            return Stop("preempted")

    def on_exit(self, run, error):
        self.request.__exit__(None, None, None)
