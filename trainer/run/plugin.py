"""What a training run does beside its steps plugs into the loop through one small interface.

The loop (trainer/run/loop.py) dispatches steps; each plug-in decides for itself when it is due:
  before_step(run, step)   before step `step` (1-based) is dispatched
  after_step(run, step)    after it was dispatched: run.metrics are its outputs, still on the devices
  at_sync(run, step)       after every step, in order; run.host holds the step's metrics on the host once
                           a plug-in fetched them (a sync point); may return an Action for the loop
  on_exit(run, error)      once, in reverse order, with the exception that ends the run (None: it ended)
`part` names the goodput part its at_sync and on_exit time counts as (None: other); `waits` says what they
wait on beyond this process (None: nothing), and the watchdog ends a run whose wait outlasts a step's limit.
Extra plug-ins (a test's fault injection, a user's hook) are named by `run.plugins` as module:Class; the
class is called with the Run and its plug-ins run after the built-in ones. A module's old name (trainer.run.guard is
now trainer.run.on_nan, trainer.run.goodput trainer.run.goodput_record) still imports: trainer/__init__.py MOVED.
"""
from __future__ import annotations

import dataclasses
import importlib

from trainer.errors import UserError


class Plugin:
    part: str | None = None
    waits: str | None = None

    def __init__(self, run=None):
        pass

    def before_step(self, run, step: int) -> None:
        pass

    def after_step(self, run, step: int) -> None:
        pass

    def at_sync(self, run, step: int):
        return None

    def on_exit(self, run, error: BaseException | None) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Rollback:
    """Go back: train on from `state` after step `step`, reading the data at `offset` (the loop applies it)."""
    state: dict
    step: int
    offset: int


@dataclasses.dataclass(frozen=True)
class Stop:
    """End the run after this step, as a preemption does (the final checkpoint is saved)."""
    reason: str


def extra(run, names) -> list[Plugin]:
    """The plug-ins `run.plugins` names (module:Class), each made with the run."""
    out = []
    for name in names or ():
        mod, _, cls = str(name).partition(":")
        try:
            out.append(getattr(importlib.import_module(mod), cls)(run))
        except (ImportError, AttributeError, ValueError) as e:
            raise UserError(f"run.plugins entry '{name}' cannot be loaded ({type(e).__name__}: {e}); give "
                            "module:Class of a class importable here") from None
    return out
