"""Checkpoints of a run: a save every checkpoint.every steps, and one at the end (also after a preemption)
unless the state holds a bad streak the guard has not acted on; the checkpointer closed whatever ends the run."""
from __future__ import annotations

from trainer.run.plugin import Plugin


class Checkpointing(Plugin):
    part, waits = "checkpoint", "a checkpoint save (or the wait for the one in flight)"

    def __init__(self, run, guard):
        self.guard = guard

    def at_sync(self, run, step: int):
        if run.ckpt.due(step):
            run.ckpt.save(step, run.state)
            run.upload()  # a URL run.dir's metrics beside the checkpoint

    def on_exit(self, run, error):
        if error is None and run.done > run.start and self.guard.may_save(run.metrics):
            run.ckpt.save(run.done, run.state)
        run.ckpt.close()  # waits for the save in flight
