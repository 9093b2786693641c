"""The objective: what the step differentiates, composed once (`objective` on a batch, `head_objective` from the final
hidden states a plain step or a pipeline's last stage has) from the token loss (models/objectives/cross_entropy.py),
the layers' aux terms and DPO (models/objectives/dpo.py), and the step's divisions (`scales`) and metrics."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.objectives import dpo, grpo, mtp
from models.objectives.cross_entropy import head_cross_entropy
from models.batch import counted, inverse_count, mean_of
from models.config import ModelConfig
from models.layers import Placement
from models.spec import family
from models.transformer import Constrain, _identity, _no_constrain, aux_zeros, embed, run_stacks


def head_objective(c: ModelConfig, params: dict, x_BTD, aux: dict, batch: dict, scale: dict,
                   constrain: Constrain = _no_constrain, placement: Placement = Placement()):
    """(what the step differentiates, its parts) of a batch's final hidden states and its layers' aux outputs: the
    head's term (the token loss sum x scale["loss"], or DPO's pair loss / pairs + sft_weight x chosen token loss /
    chosen tokens) plus each aux sum x its scale (its weight / its count: a statistic's, DPO's metrics', is 0);
    parts = {"loss": the head's term, "aux": {name: sum}}, the sums every path adds up over its microbatches, data
    ranks and stages (the counts are the step's, `aux_counts`). A pipeline's last stage calls it with no aux (its
    layers' aux enter the backward as `aux_cotangents`)."""
    if c.dpo is not None:
        pair, sft, metrics = dpo_sums(c, params, x_BTD, batch, constrain)
        loss, aux = pair * scale["pairs"] + c.dpo.sft_weight * sft * scale["chosen"], {**aux, **metrics}
    elif c.grpo is not None:  # each token's weight is its share of the step's loss already (grpo.token_weights)
        loss, metrics = grpo.head_sums(c, params, x_BTD, batch, constrain)
        aux = {**aux, **metrics}
    else:
        ce = head_cross_entropy(c, params, x_BTD, batch["targets"], batch["loss_weight"], constrain)
        loss = ce * scale["loss"]
    if c.mtp_depth:  # the multi-token prediction modules' losses, aux terms of their own
        more = mtp.sums(c, params, x_BTD, batch, constrain, placement)  # a table's rows add to the layers'
        aux = {**aux, **{k: aux[k] + v if k in aux else v for k, v in more.items()}}
    aux = {**aux, **family(c.family).aux_objective(c, aux, placement.collectives)}  # gpt-oss's pooled balance
    return with_aux(loss, aux, scale), {"loss": loss, "aux": aux}


def dpo_sums(c: ModelConfig, params: dict, x_BTD, batch: dict, constrain: Constrain = _no_constrain) -> tuple:
    """DPO's (pair loss sum, chosen token loss sum, {metric: sum}) of a batch's final hidden states
    (models/objectives/dpo.py `sums` of each target's weight x cross-entropy)."""
    ce = head_cross_entropy(c, params, x_BTD, batch["targets"], batch["loss_weight"].astype(jnp.float32), constrain,
                            per_token=True)
    return dpo.sums(c.dpo, ce, batch)


def head_fields(c: ModelConfig) -> tuple:
    """The batch fields `head_objective` reads (a pipeline's last stage takes only these of its microbatch)."""
    mtp_fields = ("segment_ids", "positions") if c.mtp_depth else ()
    own = (("segment_ids", "ref_logp") if c.dpo is not None else ()) + (grpo.FIELDS if c.grpo is not None else ())
    return ("targets", "loss_weight") + own + tuple(
        f for f in mtp_fields if c.dpo is None or f != "segment_ids")


def with_aux(value, sums: dict, scale: dict):
    """value plus each aux sum x its scale: the aux terms of the objective."""
    for k, total in sums.items():
        value = value + jnp.sum(total * scale["aux"][k])  # (an array's, aux_shapes: a statistic, weight 0)
    return value


def aux_cotangents(aux: dict, scale: dict) -> dict:
    """The objective's gradient with respect to the layers' aux outputs {name: sum} (`with_aux`'s: each sum's
    scale): what seeds a pipeline stage's backward of its layers' aux, known before it runs."""
    _, vjp = jax.vjp(lambda a: with_aux(jnp.zeros((), jnp.float32), a, scale), aux)
    return vjp(jnp.ones((), jnp.float32))[0]


def dpo_eval_sums(c: ModelConfig, params: dict, batch: dict, **kw) -> dict:
    """What an evaluation adds up over its batches: the pair loss sum and pairs, the chosen token loss sum and
    chosen tokens, each metric's sum (trainer/run/evaluator.py divides once)."""
    x, _ = hidden(c, params, batch, **kw)
    return dpo_eval_head(c, params, x, batch, kw.get("constrain", _no_constrain))


def dpo_eval_head(c: ModelConfig, params: dict, x_BTD, batch: dict, constrain: Constrain = _no_constrain) -> dict:
    """`dpo_eval_sums` of a batch's final hidden states (a pipeline's last stage has them per microbatch)."""
    pair, sft, metrics = dpo_sums(c, params, x_BTD, batch, constrain)
    pairs, chosen = dpo.counts(batch)
    return {"pair": pair, "pairs": pairs, "sft": sft, "chosen": chosen, **metrics}


def hidden(c: ModelConfig, params: dict, batch: dict, *, dtype=jnp.float32, constrain: Constrain = _no_constrain,
           gather=_identity, remat: str | None = None, placement: Placement = Placement()):
    """(the final hidden states (B, T, D), the layers' aux outputs) of a batch."""
    x = embed(c, params, batch["tokens"], dtype, constrain)
    return run_stacks(c, params, x, constrain=constrain, gather=gather, remat=remat,
                      documents=documents_of(c, batch), placement=placement)


def loss_sum(c: ModelConfig, params: dict, batch: dict, **kw):
    """Sum of loss_weight x next-token loss over a batch of fields (models/batch.py)."""
    x, _ = hidden(c, params, batch, **kw)
    return head_cross_entropy(c, params, x, batch["targets"], batch["loss_weight"], kw.get("constrain", _no_constrain))


def aux_counts(c: ModelConfig, batch: dict) -> dict:
    """Each aux output's count over the step's whole batch, the one source of its mean's divisor (in the objective's
    scale and in the logged metric): the family's aux_counts; DPO's metrics, its pairs (models/objectives/dpo.py)."""
    counts = {**family(c.family).aux_counts(c, batch), **mtp.counts(c, batch)}
    if c.grpo is not None:  # means already (each token's metric weight)
        counts.update(dict.fromkeys(grpo.METRICS, jnp.ones((), jnp.float32)))
    return {**counts, **dict.fromkeys(dpo.METRICS, dpo.counts(batch)[0])} if c.dpo is not None else counts


def scales(c: ModelConfig, batch: dict) -> dict:
    """The step's divisions, each taken once over the whole step batch: 1 / its counted tokens for the token loss,
    its weight (the family's aux_weights; 1 unless given, 0 for a statistic) / each aux output's count (the family's
    aux_counts) for that output (1 where a count is 0)."""
    spec = family(c.family)
    counts, weights = {**spec.aux_counts(c, batch), **mtp.counts(c, batch)}, {**spec.aux_weights(c), **mtp.weights(c)}
    out = {"loss": inverse_count(batch), "aux": {k: weights.get(k, 1.0) * mean_of(1.0, n) for k, n in counts.items()}}
    if c.dpo is not None:  # the pairs' mean and the chosen tokens' mean; the metrics are statistics (weight 0)
        out.update(dpo.scales(batch))
        out["aux"].update({k: jnp.zeros((), jnp.float32) for k in dpo.METRICS})
    if c.grpo is not None:  # the loss weighted once per token already; its metrics are statistics
        out["loss"] = jnp.ones((), jnp.float32)
        out["aux"].update({k: jnp.zeros((), jnp.float32) for k in grpo.METRICS})
    return out


def zero_parts(c: ModelConfig) -> dict:
    """`objective`'s parts, all zero: where a path starts adding them up."""
    z = lambda: jnp.zeros((), jnp.float32)  # noqa: E731
    own = mtp.names(c) + (dpo.METRICS if c.dpo is not None else ()) + (grpo.METRICS if c.grpo is not None else ())
    return {"loss": z(), "aux": {**aux_zeros(c), **{k: z() for k in own}}}


def part_metrics(parts: dict, counts: dict) -> dict:
    """The step's metrics of its summed parts: the loss, and each aux output's mean (its sum / its count over the
    step's batch, `aux_counts`, divided once, here) as aux/<name>, or under its own name where that has a "/" (a
    statistic's, e.g. moe/dropped); an array's (ModelSpec.aux_shapes) is the family's to read (after_step)."""
    return {"loss": parts["loss"], **{k if "/" in k else f"aux/{k}": mean_of(total, counts[k])
                                      for k, total in parts["aux"].items() if jnp.ndim(total) == 0}}


def objective(c: ModelConfig, params: dict, batch: dict, scale: dict, before_head=None, **kw):
    """(what the step differentiates, its parts) of a batch (`head_objective` of its final hidden states and aux).
    `before_head`: (final hidden states, params) -> the same two, as the head reads them (the ZeRO-3 step gathers
    the head's weights there, trainer/step.py)."""
    x, aux = hidden(c, params, batch, **kw)
    if before_head is not None:
        x, params = before_head(x, params)
    return head_objective(c, params, x, aux, batch, scale, kw.get("constrain", _no_constrain),
                          kw.get("placement", Placement()))


def documents_of(c: ModelConfig, batch: dict):
    """(segment_ids, positions) of a batch where the model keeps to documents (c.documents), else None:
    one document per row, and the program of a run without document masks stays as it was."""
    return (batch["segment_ids"], batch["positions"]) if c.documents else None


def loss_fn(c: ModelConfig, params: dict, batch: dict, **kw):
    """The mean next-token loss over the batch's counted tokens, on one shard in one piece (the
    train step sums over its microbatches and devices and divides once instead)."""
    return mean_of(loss_sum(c, params, batch, **kw), counted(batch))
