"""Test-only loop plug-ins that inject faults through the plug-in interface (trainer/run/plugin.py).

The subprocess tests put this folder on PYTHONPATH and name a class in the config key `run.plugins`,
e.g. `run.plugins=[faults:HangStep]`; a plug-in's parameters come from the test's environment
(FAULT_STEP, ...). Production code has no test hook: these run only where a test names them.
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from trainer.run.plugin import Plugin


def _never():
    while True:
        time.sleep(60)
    return np.float32(0)  # noqa: unreachable - the callback's result type


class HangStep(Plugin):
    """Step FAULT_STEP never finishes: its outputs (state and metrics) wait on a host callback that never
    returns, as a collective waiting for a dead peer does."""

    def __init__(self, run):
        self.at = int(os.environ["FAULT_STEP"])
        rep = run.s.layout.replicated

        def hang(state, metrics):
            wait = jax.pure_callback(_never, jax.ShapeDtypeStruct((), jnp.float32))
            return jax.tree.map(lambda x: x + (wait * 0).astype(x.dtype), (state, metrics))
        self.hang = jax.jit(hang, out_shardings=(run.s.shardings, rep))

    def after_step(self, run, step):
        if step == self.at:
            run.state, run.metrics = self.hang(run.state, run.metrics)


def _block(*args, **kwargs):
    """A wait that never ends: a peer that never answers, a device that never returns."""
    while True:
        time.sleep(60)


class BlockPhase(Plugin):
    """The phase FAULT_PHASE waits for good (from step FAULT_STEP on, where it has steps): eval, save (a
    checkpoint save), close (the final save's close), agreement (the stop agreement between processes),
    restore (a rollback's restore)."""

    def __init__(self, run):
        phase, at = os.environ["FAULT_PHASE"], int(os.environ.get("FAULT_STEP", "0"))
        if phase == "eval":
            run.eval_fn = _block
        elif phase == "save":
            save = run.ckpt.save
            run.ckpt.save = lambda step, state: _block() if step >= at else save(step, state)
        elif phase == "close":
            run.ckpt.close = _block
        elif phase == "restore":
            run.ckpt.restore = _block
        elif phase == "agreement":
            from trainer.ckpt.preempt import StopRequest
            agreed = StopRequest.agreed
            StopRequest.agreed = lambda self, can_sync=True: _block() if run.done >= at else agreed(self, can_sync)
        else:
            raise ValueError(f"FAULT_PHASE={phase}")
