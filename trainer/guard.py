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
On a trip the host (trainer/run/on_nan.py) applies train.on_nan: skip warns and goes on; stop exits
(TrainingStopped, naming the step); rollback restores the newest checkpoint c and adds (trip - c) to the offset, so
step c+1 trains on the batch after the bad streak. The offset is saved in the state, so a resume
replays exactly what an uninterrupted run does, rollbacks included; a checkpoint's meta records the
data position it implies (rng.data_step = step + offset, and rng.data_offset).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.config import step_range


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
    inj = step_range(t.inject_nan_at, "train.inject_nan_at", single=True)
    if inj:  # a drill: this batch's loss is NaN, as if the data were poisoned
        loss = jnp.where((pos >= inj[0]) & (pos <= inj[1]), jnp.nan, loss)
    bad = ~(jnp.isfinite(loss) & jnp.isfinite(m["grad_norm"]))
    if t.spike_factor > 0:
        bad |= (g["seen"] >= t.spike_window) & (loss > t.spike_factor * jnp.median(g["window"]))
    out = {k: new[k] if k == "step" else jax.tree.map(lambda n, o: jnp.where(bad, o, n), new[k], state[k])
           for k in new if k != "guard"}
    streak = jnp.where(bad, g["streak"] + 1, 0)
    # a step with no counted token (loss 0 by definition) is accepted but says nothing about spikes
    keep = bad | (m["counted_tokens"] <= 0)
    out["guard"] = {
        "offset": g["offset"], "skipped": g["skipped"] + bad.astype(jnp.int32), "streak": streak,
        "trip": jnp.where(streak == t.max_bad_steps, state["step"] + 1, g["trip"]),
        "window": jnp.where(keep, g["window"], g["window"].at[g["seen"] % t.spike_window].set(loss)),
        "seen": g["seen"] + (~keep).astype(jnp.int32)}
    g2 = out["guard"]
    return out, {**m, "loss": loss, "skipped": g2["skipped"], "bad_streak": streak, "trip": g2["trip"]}
