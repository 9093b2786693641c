"""The NaN/spike guard's host side, a loop plug-in: reads the device counters (trainer/guard.py) at sync
points and applies train.on_nan: skip warns, stop ends the run, rollback restores the newest checkpoint
and returns a Rollback that moves the data offset past the bad streak (the loop applies it)."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from trainer.errors import TrainingStopped
from trainer.run.plugin import Plugin, Rollback

MAX_ROLLBACKS = 3  # in a row to the same checkpoint: the steps, not the data, are bad
log = logging.getLogger(__name__)


class Guard(Plugin):
    """Due where the loop syncs anyway (a metrics line, a checkpoint save): a streak's trip acted on there."""
    waits = "the rollback's restore of the newest checkpoint"

    def __init__(self, run):
        s, t = run.s, run.cfg.train
        self.s, self.ckpt, self.init = s, run.ckpt, run.initial
        self.policy, self.max_bad = t.on_nan, t.max_bad_steps
        g = jax.device_get({k: run.state["guard"][k] for k in ("offset", "trip")})
        self.offset, self.seen_trip = int(g["offset"]), int(g["trip"])
        self.what = "non-finite loss or gradient norm" + (
            f", or a loss above {t.spike_factor:g} x the median of the last {t.spike_window}" if t.spike_factor else "")
        self.last_target, self.in_a_row = None, 0
        self._set = jax.jit(lambda g, off: {**g, "offset": off, "streak": jnp.zeros_like(g["streak"]),
                                            "trip": jnp.zeros_like(g["trip"])},
                            out_shardings=s.shardings["guard"])

    def at_sync(self, run, step: int):
        if run.host is None and not run.ckpt.due(step):
            return None
        trip = self.tripped(run.host if run.host is not None else run.metrics)
        if not trip:
            return None
        state, back = self.act(trip)  # train.on_nan=rollback (stop raises): back to a checkpoint
        return Rollback(state, back, self.offset)

    def tripped(self, m) -> int:
        """The step a streak of max_bad_steps bad steps ended at, if train.on_nan must act on it; else 0."""
        trip = int(jax.device_get(m["trip"]))
        if not trip or trip == self.seen_trip:
            return 0
        self.seen_trip = trip
        if self.policy == "skip":
            log.warning(f"{self.max_bad} consecutive bad steps ({self.what}) up to step {trip}; "
                        "their updates were skipped (train.on_nan=skip)")
            return 0
        return trip

    def may_save(self, m) -> bool:
        """Whether a state may be checkpointed: never one whose bad streak is still to be acted on."""
        return self.policy == "skip" or int(jax.device_get(m["trip"])) in (0, self.seen_trip)

    def act(self, trip: int) -> tuple[dict, int]:
        """train.on_nan for a streak ending at `trip`: raise (stop) or return the rolled-back (state, step)."""
        first = trip - self.max_bad + 1
        if self.policy == "stop":
            raise TrainingStopped(
                f"step {trip}: {self.max_bad} consecutive bad steps ({self.what}, steps {first}..{trip}) and "
                "train.on_nan=stop; lower train.lr or train.grad_clip, check the data there, or set "
                "train.on_nan=skip|rollback")
        self.ckpt.mngr.wait_until_finished()
        state, back = self.ckpt.restore() or (self.init(), 0)
        self.in_a_row = self.in_a_row + 1 if back == self.last_target else 1
        self.last_target = back
        if self.in_a_row > MAX_ROLLBACKS:
            raise TrainingStopped(
                f"step {trip}: rolled back to step {back} {MAX_ROLLBACKS} times in a row and the steps after "
                f"it are still bad ({self.what}); the model, not the data, diverges: lower train.lr or use "
                "an earlier checkpoint")
        self.offset += max(trip - back, 0)
        with jax.set_mesh(self.s.mesh):
            state = {**state, "guard": self._set(state["guard"], np.int32(self.offset))}
        self.seen_trip = 0
        log.warning(f"{self.max_bad} consecutive bad steps ({self.what}, steps {first}..{trip}); "
                    f"rolled back to step {back}, data offset now {self.offset} (step {back + 1} trains on the "
                    f"batch after step {trip})")
        return state, back
