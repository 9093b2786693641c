"""GRPO's objective as TRL 1.16's `GRPOTrainer` defines it (`_compute_loss`, `_generate_and_score_completions`), on
per-token log-probabilities at the sampling temperature, so that any path that has them (the train step's head, a
test's recorded ones) computes the same numbers.

Per completion token t of a completion with advantage A (token-level importance sampling):
    ratio r = exp(logp - old_logp); loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
    + beta x kl_t, kl_t = exp(ref - logp) - (ref - logp) - 1, times r (TRL's use_bias_correction_kl).
The step's loss is sum_t weight_t x loss_t, each token's weight fixed once from the step's whole batch of completions
(`token_weights`), so that it is the same on every layout and microbatch split:
    grpo     1 / (its completion's tokens) / (the step's completions)       (mean of per-completion means)
    dr_grpo  1 / (the step's completions x max_completion_length)
    dapo     1 / (the step's completion tokens)                             (one mean over the step's tokens)
    bnpo     1 / (its microbatch's completion tokens) / (microbatches)      (TRL's per-device micro-batch mean)
TRL logs each metric as the mean over the step's microbatches of that microbatch's value: `kl`, `entropy` and the
`clip_ratio/*_mean` are masked means over the microbatch's tokens (bnpo's weights); `clip_ratio/low_min` and
`high_max` the smallest (largest) per-completion mean of the microbatch.
Advantages (`advantages`): the rewards of each function times its weight, summed (a completion every function
returned None for is left out of its group's mean and std and gets advantage 0), minus the group's mean, divided by
the group's (or the batch's) standard deviation + 1e-4 unless scale_rewards is none.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALES = ("group", "batch", "none")
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclasses.dataclass(frozen=True)
class Grpo:
    """The objective's settings (trainer/config: the grpo section)."""
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0
    max_completion_length: int = 256
    bias_correction_kl: bool = True


def per_token(g: Grpo, logp, old_logp, ref_logp, advantage) -> dict:
    """Each token's loss term and statistics (arrays shaped as logp; advantage broadcast per token):
    {"loss", "kl", "low", "high"} (low/high: 1.0 where the ratio was clipped below/above with that advantage's sign)."""
    ratio = jnp.exp(logp - old_logp)
    clipped = jnp.clip(ratio, 1 - g.epsilon, 1 + g.epsilon_high)
    loss = -jnp.minimum(ratio * advantage, clipped * advantage)
    kl = jnp.zeros_like(logp)
    if g.beta:
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1
        if g.bias_correction_kl:
            kl = kl * ratio
        loss = loss + g.beta * kl
    low = ((ratio < 1 - g.epsilon) & (advantage < 0)).astype(jnp.float32)
    high = ((ratio > 1 + g.epsilon_high) & (advantage > 0)).astype(jnp.float32)
    return {"loss": loss, "kl": kl, "low": low, "high": high}


def token_weights(loss_type: str, mask: np.ndarray, microbatches: int, max_completion_length: int) -> dict:
    """{"loss": each token's weight in the step's loss, "metric": its weight in a microbatch-averaged masked mean}
    of the step's completions (mask (N, T): 1 on each completion's counted tokens; row i in microbatch i % M, as the
    train step splits its batch, trainer/parallel/microbatch.py)."""
    mask = np.asarray(mask, np.float64)
    N = mask.shape[0]
    mb = mask.reshape(N // microbatches, microbatches, -1)
    per_mb = np.maximum(mb.sum(axis=(0, 2), keepdims=True), 1.0)
    metric = (mb / per_mb / microbatches).reshape(mask.shape)
    if loss_type == "grpo":
        loss = mask / np.maximum(mask.sum(-1, keepdims=True), 1.0) / N
    elif loss_type == "dr_grpo":
        loss = mask / (N * max_completion_length)
    elif loss_type == "dapo":
        loss = mask / max(mask.sum(), 1.0)
    elif loss_type == "bnpo":
        loss = metric
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    return {"loss": loss.astype(np.float32), "metric": metric.astype(np.float32)}


def sums(g: Grpo, logp, old_logp, ref_logp, advantage, weights: dict, mask) -> dict:
    """The step's loss and metric numerators over these tokens (they add up over microbatches and ranks): "loss",
    "kl", "clip_ratio/*_mean"; and each completion's (row's) mean of low/high clipping (`row_low`, `row_high`, NaN
    for a row without counted tokens), from which `clip_extremes` takes TRL's low_min and high_max."""
    t = per_token(g, logp, old_logp, ref_logp, advantage)
    w, m = weights["loss"], weights["metric"]
    count = jnp.sum(mask, -1)
    row = lambda x: jnp.where(count > 0, jnp.sum(x * mask, -1) / jnp.maximum(count, 1), jnp.nan)  # noqa: E731
    return {"loss": jnp.sum(w * t["loss"]), "kl": jnp.sum(m * t["kl"]),
            "clip_ratio/low_mean": jnp.sum(m * t["low"]), "clip_ratio/high_mean": jnp.sum(m * t["high"]),
            "clip_ratio/region_mean": jnp.sum(m * jnp.maximum(t["low"], t["high"])),
            "row_low": row(t["low"]), "row_high": row(t["high"])}


def clip_extremes(row_low: np.ndarray, row_high: np.ndarray, microbatches: int) -> dict:
    """TRL's clip_ratio/low_min and high_max: per microbatch (row i in microbatch i % M) the smallest (largest)
    completion's mean, NaN rows left out, averaged over the microbatches."""
    lo = np.asarray(row_low, np.float64).reshape(-1, microbatches)
    hi = np.asarray(row_high, np.float64).reshape(-1, microbatches)
    return {"clip_ratio/low_min": float(np.mean(np.nanmin(lo, axis=0))),
            "clip_ratio/high_max": float(np.mean(np.nanmax(hi, axis=0)))}


def _nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """TRL's nanstd: Bessel-corrected over the non-NaN values."""
    mean = np.nanmean(x, axis=axis, keepdims=True)
    var = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    n = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    out = np.sqrt(var * n / (n - 1))
    return out.reshape(()) if axis is None else np.squeeze(out, axis)


def advantages(rewards_per_func: np.ndarray, weights, G: int, scale: str = "group") -> tuple[np.ndarray, dict]:
    """(each completion's advantage (N,), the reward metrics TRL logs) of the rewards (N, functions; NaN where a
    function returned None), completions in groups of G consecutive rows, computed in float32 as TRL does."""
    r = np.asarray(rewards_per_func, np.float32)
    w = np.asarray(weights, np.float32)
    unscorable = np.isnan(r).all(axis=1)
    total = np.nansum(r * w[None, :], axis=1).astype(np.float32)
    total[unscorable] = np.nan
    grouped = total.reshape(-1, G)
    mean = np.repeat(np.nanmean(grouped, axis=1), G)
    std = np.repeat(_nanstd(grouped, axis=1), G) if scale in ("group", "none") else \
        np.full_like(total, _nanstd(total))
    adv = total - mean
    if scale != "none":
        adv = adv / (std + np.float32(1e-4))
    metrics = {"reward": float(np.nanmean(total)), "reward_std": float(_nanstd(total)),
               "frac_reward_zero_std": float(np.mean(np.isclose(std, 0.0)))}
    return np.nan_to_num(adv.astype(np.float32), nan=0.0), metrics


FIELDS = ("metric_weight", "old_logp", "ref_logp", "advantage", "completion")  # a GRPO batch's fields beyond the LM's
METRICS = ("kl", "entropy", *CLIP_METRICS)


def token_logps(c, params: dict, x_BTD, targets_BT, constrain) -> tuple:
    """(each target's log-probability, the distribution's entropy), both (B, T), at c.grpo.temperature, from the final
    hidden states: the head's logits / temperature (TRL's), over the whole vocabulary (split over `model` where the
    rules split it: the sums below are the compiler's to reduce)."""
    from models.objectives.cross_entropy import _target_logits
    from models.transformer import head
    logits = head(c, params, x_BTD, constrain) / c.grpo.temperature
    B, T, V = logits.shape
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = _target_logits(logits.reshape(B * T, V), targets_BT.reshape(-1), 1, 0).reshape(B, T)
    p = jnp.exp(logits - lse[..., None])
    return picked - lse, lse - jnp.sum(p * logits, axis=-1)


def head_sums(c, params: dict, x_BTD, batch: dict, constrain) -> tuple:
    """(the step's loss over this batch, {metric: its sum}) of a GRPO batch's final hidden states: `sums` of its
    per-target log-probabilities against the batch's old and reference ones, advantages and weights (every
    non-completion target has weight 0); entropy as TRL logs it, a microbatch-averaged masked mean."""
    logp, entropy = token_logps(c, params, x_BTD, batch["targets"], constrain)
    got = sums(c.grpo, logp, batch["old_logp"], batch["ref_logp"], batch["advantage"],
               {"loss": batch["loss_weight"], "metric": batch["metric_weight"]}, batch["completion"])
    metrics = {k: jax.lax.stop_gradient(got[k]) for k in METRICS if k in got}
    metrics["entropy"] = jax.lax.stop_gradient(jnp.sum(batch["metric_weight"] * entropy))
    return got["loss"], metrics
