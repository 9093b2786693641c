"""NaN/Inf and loss-spike guard (train.on_nan, train.max_bad_steps, train.spike_factor).

Inside the jitted step: a step whose loss or gradient norm is not finite, or (spike guard on)
whose loss exceeds spike_factor x the median of the last spike_window accepted losses, is
*bad*: params and optimizer state are kept as they were (a select over the whole update), only
the step counter advances. The counters live on the devices in `state["guard"]`, so they are
checkpointed with the state and read by the host only where it syncs anyway (log points and
checkpoint saves):
  offset   data offset: step s (0-based) trains on the batch at position s + offset
  skipped  bad steps so far        streak  consecutive bad steps
  trip     the step at which a streak reached max_bad_steps (0: none since the last rollback)
  window, seen   the spike guard's ring buffer of accepted losses and how many it has seen
On a trip the host applies train.on_nan: skip warns and goes on; stop exits (TrainingStopped,
naming the step); rollback restores the newest checkpoint c and adds (trip - c) to the offset, so
step c+1 trains on the batch after the bad streak. The offset is saved in the state, so a resume
replays exactly what an uninterrupted run does, rollbacks included; a checkpoint's meta records the
data position it implies (rng.data_step = step + offset, and rng.data_offset).
"""
from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np

from trainer.errors import TrainingStopped, UserError

POLICIES = ("skip", "rollback", "stop")
MAX_ROLLBACKS = 3  # in a row to the same checkpoint: the steps, not the data, are bad
log = logging.getLogger(__name__)


def inject_range(spec) -> tuple[int, int] | None:
    """train.inject_nan_at 'A' or 'A:B' -> (A, B); '' -> None."""
    if spec in ("", None):
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(spec))
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2) or m.group(1)):
        raise UserError(f"train.inject_nan_at='{spec}' is not STEP or A:B with 1 <= A <= B; write e.g. "
                        "train.inject_nan_at=7 (in YAML quote a range: '7:9')")
    return int(m.group(1)), int(m.group(2) or m.group(1))


def validate(t):
    """UserError naming the key and the fix for a bad guard setting."""
    if t.on_nan not in POLICIES:
        raise UserError(f"train.on_nan='{t.on_nan}' is unknown; choose one of {', '.join(POLICIES)}")
    if t.max_bad_steps < 1:
        raise UserError(f"train.max_bad_steps={t.max_bad_steps} must be >= 1 (consecutive bad steps before "
                        "train.on_nan acts)")
    if t.spike_factor != 0 and t.spike_factor <= 1:
        raise UserError(f"train.spike_factor={t.spike_factor} must be 0 (off) or > 1 (skip a loss above "
                        "factor x the running median); e.g. train.spike_factor=2")
    if t.spike_window < 1:
        raise UserError(f"train.spike_window={t.spike_window} must be >= 1 (losses in the running median)")
    inject_range(t.inject_nan_at)


def shapes(t) -> dict:
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    return {"offset": i32, "skipped": i32, "streak": i32, "trip": i32, "seen": i32,
            "window": jax.ShapeDtypeStruct((t.spike_window,), jnp.float32)}


def init(t) -> dict:
    """The guard's part of a fresh train state (inside a jitted init)."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes(t))


def guarded_step(inner, cfg, state: dict, batch):
    """inner(state, batch) -> (state, metrics), with a bad step's update dropped; pure and jittable."""
    t, g = cfg.train, state["guard"]
    new, m = inner(state, batch)
    loss, pos = m["loss"], state["step"] + g["offset"] + 1  # the 1-based data position of this batch
    inj = inject_range(t.inject_nan_at)
    if inj:  # a drill: this batch's loss is NaN, as if the data were poisoned
        loss = jnp.where((pos >= inj[0]) & (pos <= inj[1]), jnp.nan, loss)
    bad = ~(jnp.isfinite(loss) & jnp.isfinite(m["grad_norm"]))
    if t.spike_factor > 0:
        bad |= (g["seen"] >= t.spike_window) & (loss > t.spike_factor * jnp.median(g["window"]))
    out = {k: new[k] if k == "step" else jax.tree.map(lambda n, o: jnp.where(bad, o, n), new[k], state[k])
           for k in new if k != "guard"}
    streak = jnp.where(bad, g["streak"] + 1, 0)
    out["guard"] = {
        "offset": g["offset"], "skipped": g["skipped"] + bad.astype(jnp.int32), "streak": streak,
        "trip": jnp.where(streak == t.max_bad_steps, state["step"] + 1, g["trip"]),
        "window": jnp.where(bad, g["window"], g["window"].at[g["seen"] % t.spike_window].set(loss)),
        "seen": g["seen"] + (~bad).astype(jnp.int32)}
    g2 = out["guard"]
    return out, {**m, "loss": loss, "skipped": g2["skipped"], "bad_streak": streak, "trip": g2["trip"]}


class Feed:
    """(step, rows) for steps [start, stop) at the current data offset; a rollback restarts it."""

    def __init__(self, batches, start: int, stop: int, offset: int):
        self.batches, self.start, self.stop, self.offset, self._gen = batches, start, stop, offset, 0

    def restart(self, start: int, offset: int):
        self.start, self.offset, self._gen = start, offset, self._gen + 1

    def __iter__(self):
        while self.start < self.stop:
            gen = self._gen
            for item in self.batches.iterate(self.start, self.stop, offset=self.offset):
                yield item
                if gen != self._gen:
                    break
            else:
                return


class Guard:
    """The host side: reads the device counters at sync points and applies train.on_nan."""

    def __init__(self, s, ckpt, state: dict, init):
        t = s.cfg.train
        self.s, self.ckpt, self.init = s, ckpt, init
        self.policy, self.max_bad = t.on_nan, t.max_bad_steps
        g = jax.device_get({k: state["guard"][k] for k in ("offset", "trip")})
        self.offset, self.seen_trip = int(g["offset"]), int(g["trip"])
        self.what = "non-finite loss or gradient norm" + (
            f", or a loss above {t.spike_factor:g} x the median of the last {t.spike_window}" if t.spike_factor else "")
        self.last_target, self.in_a_row = None, 0
        self._set = jax.jit(lambda g, off: {**g, "offset": off, "streak": jnp.zeros_like(g["streak"]),
                                            "trip": jnp.zeros_like(g["trip"])},
                            out_shardings=s.shardings["guard"])

    def fields(self, m) -> dict:
        """Guard fields of a metrics record (m: the step's metrics on the host)."""
        rec = {"skipped": int(m["skipped"]), "bad_streak": int(m["bad_streak"])}
        return {**rec, "data_offset": self.offset} if self.offset else rec

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
        state, back = self.ckpt.restore_or_init(self.init)
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
