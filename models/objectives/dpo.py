"""Direct Preference Optimization (Rafailov et al. 2023) and its variants, as TRL 1.16's DPOTrainer defines them.

A row of a DPO batch holds one pair (trainer/data/pairs.py): segment 1 is prompt + chosen, segment 2 prompt +
rejected, loss_weight 1 on the answers' targets, and `ref_logp` the frozen reference's log-probability of each
target. Per row, with s the answers' summed log-probabilities (policy pi, reference ref) and n their token counts:
  delta = (s_pi(chosen) - s_ref(chosen)) - (s_pi(rejected) - s_ref(rejected))
  sigmoid  -log sigmoid(beta delta)
  hinge    relu(1 - beta delta)
  ipo      (delta' - 1 / (2 beta))^2, delta' with each log-ratio divided by its answer's n (TRL's normalisation)
  robust   (-(1 - ls) log sigmoid(beta delta) + ls log sigmoid(-beta delta)) / (1 - 2 ls)
The loss is the mean over the step's pairs (one division, as the token loss is one mean over counted tokens), plus
sft_weight x the chosen answers' mean token loss over the step (TRL's loss_type=["...", "sft"] with loss_weights).
Metrics, means over the step's pairs as TRL logs them: rewards/chosen and rewards/rejected (beta x each log-ratio),
rewards/margins, rewards/accuracies (chosen reward > rejected reward), logps/chosen, logps/rejected.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.batch import mean_of

LOSSES = ("sigmoid", "ipo", "hinge", "robust")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@dataclasses.dataclass(frozen=True)
class Dpo:
    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    online: bool = False  # dpo.reference_mode=online: the reference's parameters are held beside the policy's


def _answers(batch, values_BT):
    """(chosen, rejected) sums over each row's answers of values (already weighted)."""
    seg = batch["segment_ids"]
    return (jnp.sum(jnp.where(seg == 1, values_BT, 0.0), axis=-1),
            jnp.sum(jnp.where(seg == 2, values_BT, 0.0), axis=-1))


def counts(batch):
    """(pairs: rows with both answers counted, chosen tokens counted) of a batch."""
    nc, nr = _answers(batch, batch["loss_weight"].astype(jnp.float32))
    return jnp.sum(((nc > 0) & (nr > 0)).astype(jnp.float32)), jnp.sum(nc)


def scales(batch) -> dict:
    """The step's divisions: 1 / its pairs, 1 / its chosen tokens (1 where there are none)."""
    pairs, chosen = counts(batch)
    return {"pairs": mean_of(1.0, pairs), "chosen": mean_of(1.0, chosen)}


def sums(d: Dpo, ce_BT, batch) -> tuple:
    """(pair loss sum, chosen token loss sum, {metric: its sum over the pairs}) of a batch from its per-target token
    losses, each already weight x cross-entropy (models/objectives/cross_entropy.py head_cross_entropy): weighted
    once, as the reference's."""
    w = batch["loss_weight"].astype(jnp.float32)
    pc, pr = _answers(batch, -ce_BT)
    rc, rr = _answers(batch, batch["ref_logp"] * w)
    nc, nr = _answers(batch, w)
    valid = ((nc > 0) & (nr > 0)).astype(jnp.float32)
    chosen, rejected = pc - rc, pr - rr
    delta, b, ls = chosen - rejected, d.beta, d.label_smoothing
    if d.loss == "sigmoid":
        per = -jax.nn.log_sigmoid(b * delta)
    elif d.loss == "hinge":
        per = jax.nn.relu(1.0 - b * delta)
    elif d.loss == "ipo":
        per = (chosen / jnp.maximum(nc, 1.0) - rejected / jnp.maximum(nr, 1.0) - 1.0 / (2.0 * b)) ** 2
    elif d.loss == "robust":
        per = (-(1.0 - ls) * jax.nn.log_sigmoid(b * delta) + ls * jax.nn.log_sigmoid(-b * delta)) / (1.0 - 2.0 * ls)
    else:
        raise ValueError(f"unknown DPO loss {d.loss}")
    rc_, rr_ = jax.lax.stop_gradient(b * chosen), jax.lax.stop_gradient(b * rejected)
    stats = {"rewards/chosen": rc_, "rewards/rejected": rr_, "rewards/margins": rc_ - rr_,
             "rewards/accuracies": (rc_ > rr_).astype(jnp.float32), "logps/chosen": jax.lax.stop_gradient(pc),
             "logps/rejected": jax.lax.stop_gradient(pr)}
    metrics = {k: jnp.sum(v * valid) for k, v in stats.items()}
    return jnp.sum(per * valid), jnp.sum(jnp.where(batch["segment_ids"] == 1, ce_BT, 0.0)), metrics


def unit(d: Dpo) -> str:
    """What the printed DPO loss measures: a mean over pairs (nats; ipo's squares a per-token log-ratio), plus the sft
    term's nats per chosen token."""
    per = "(nats/token)^2/pair" if d.loss == "ipo" else "nats/pair"
    return per + (f" + {d.sft_weight:g} x nats/chosen token" if d.sft_weight else "")
