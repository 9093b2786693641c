"""AdamW (or SGD with momentum) with linear warmup, cosine decay and global-norm clipping (optax)."""
from __future__ import annotations

import logging

import jax
import optax

log = logging.getLogger(__name__)


def warmup_of(t) -> int:
    """The schedule's warmup steps: train.warmup_steps, at most steps - 1 (so that the last step has the peak)."""
    return min(t.warmup_steps, max(t.steps - 1, 0))


def warn_if_no_decay(t) -> None:
    """A warning at start when the warmup asked for is longer than the run: the schedule cuts it to steps - 1, and
    the rate rises to the peak at the last step and never decays. (A warmup of steps - 1 or fewer is as asked: not
    warned, whatever the run's length; nor a rate that stays 0 or never decays anyway, min_lr_ratio=1.)"""
    if t.steps > 1 and t.warmup_steps >= t.steps and t.lr > 0 and t.min_lr_ratio < 1:
        log.warning(f"train.warmup_steps={t.warmup_steps} fills the run of train.steps={t.steps} (the schedule cuts "
                    f"the warmup to {warmup_of(t)} step{'s' * (warmup_of(t) > 1)}): the learning rate rises to its peak train.lr={t.lr} at "
                    f"the last step and never decays; for a run that decays set train.warmup_steps below "
                    f"{t.steps - 1}, e.g. train.warmup_steps={t.steps // 10}")


def make_optimizer(t, decay: dict, frozen: dict | None = None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and its schedule; `decay` says, per parameter (a tree like the parameters', declared
    where each was created: models.weight_decay_of), whether weight decay applies to it; `frozen`, whether it is
    state the step sets itself (models.frozen_of: DeepSeek's router bias), which the optimizer leaves (no update, no
    state: optax.set_to_zero; a model without such state keeps the plain chain and its state's layout)."""
    warmup = warmup_of(t)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1), end_value=t.lr * t.min_lr_ratio)
    if getattr(t, "optimizer", "adamw") == "sgd":
        # Every step of this chain is linear in the gradient (clipping aside): local SGD relies on it.
        update = optax.chain(optax.add_decayed_weights(t.weight_decay, mask=decay),
                             optax.sgd(schedule, momentum=t.b1 or None))
    else:
        update = optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=1e-8, weight_decay=t.weight_decay, mask=decay)
    clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
    tx = optax.chain(clip, update)
    if frozen is not None and any(jax.tree.leaves(frozen)):
        labels = jax.tree.map(lambda f: "frozen" if f else "trained", frozen)
        tx = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)
    return tx, schedule


def map_params(tx, f, opt_state, *rest, transform_non_params=None):
    """optax.tree_map_params over the optimizer state (f(state leaf, *rest's leaves) on each per-parameter leaf),
    a frozen parameter's place (optax.MaskedNode: it has no state) kept as it is."""
    def masked(x):
        return isinstance(x, optax.MaskedNode)
    return optax.tree_map_params(tx, lambda v, *r: v if masked(v) else f(v, *r), opt_state, *rest,
                                 transform_non_params=transform_non_params, is_leaf=masked)


def schedule_count(opt_state):
    """The optimizer's own step count, at which the schedule gives this update's learning rate (a step
    the guard skipped did not advance it, so it lags the train state's step)."""
    found = [x.count for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
             if isinstance(x, optax.ScaleByScheduleState)]
    assert len(found) == 1, f"expected one scheduled learning rate in the optimizer state, found {len(found)}"
    return found[0]
