"""The loss: next-token cross-entropy of the output head, whole or tiled over tokens
(model.loss_chunk), as a sum of loss_weight x token loss (models/batch.py: the step divides once,
by the step's counted tokens).

Letters as in models/transformer.py; N tokens (flattened B*T), C chunks of n tokens.

At Llama 3's 128k vocabulary the float32 logits of an 8k-token microbatch are 4 GB, and their
gradient as much again. The tiled form (MaxText's vocab tiling, Levanter's blockwise
cross-entropy) never materialises them: the forward is a `lax.scan` over chunks of n tokens,
each computing its logits (n, V), their logsumexp and the target's logit; a custom_vjp's
backward recomputes the logits by vocabulary block (N, V/C) and writes each block's weight
gradient in place. Peak memory for the loss: one chunk's logits and their gradient, plus the
head weight's gradient; compute: one more head matmul than the whole-logits loss (recompute).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.objectives import dpo
from models.batch import counted, inverse_count, mean_of
from models.config import ModelConfig
from models.layers import Placement
from models.spec import family
from models.transformer import (Constrain, _identity, _no_constrain, embed, final_norm, head, head_weight, layer_stack,
                                softcap)

# Default rule (model.loss_chunk unset): tile when the whole float32 logits would exceed
# TILE_ABOVE bytes, in chunks of the largest power-of-two token count whose logits fit in
# CHUNK_BYTES (at V = 128k: 256 tokens, 128 MB). Small vocabularies (the bench's 256) never tile.
TILE_ABOVE = 256 << 20
CHUNK_BYTES = 128 << 20


def chunk_tokens(loss_chunk: int | None, n_tokens: int, vocab: int) -> int:
    """Tokens per chunk for N tokens (0: whole logits at once); None applies the default rule."""
    if loss_chunk is None:
        if n_tokens * vocab * 4 <= TILE_ABOVE:
            return 0
        loss_chunk = 1 << max(0, (CHUNK_BYTES // (4 * vocab)).bit_length() - 1)
    return 0 if loss_chunk >= n_tokens else loss_chunk


def _logits(x_nD, w, w_axes, constrain):
    logits = jnp.einsum(f"nd,{w_axes}->nv", x_nD, w.astype(x_nD.dtype), preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "vocab"))


def token_losses(logits_nV, targets_n):
    """logsumexp - target logit per token. The target is picked by comparing with an iota, not
    gathered: with the vocabulary split over `model` each rank keeps its slice (a gather on a
    split axis would bring the logits together); the sum has one non-zero term, so it is exact."""
    return jax.nn.logsumexp(logits_nV, axis=-1) - _target_logits(logits_nV, targets_n, 1, 0)


def _target_logits(logits_nV, targets_n, stride, offset, shape=None):
    """Each token's target logit (column j holds vocabulary entry j*stride + offset); with
    logits None, the one-hot of the targets of that shape instead."""
    shape = logits_nV.shape if shape is None else shape
    hit = jax.lax.broadcasted_iota(jnp.int32, shape, 1) * stride + offset == targets_n[:, None]
    if logits_nV is None:
        return hit.astype(jnp.float32)
    return jnp.sum(jnp.where(hit, logits_nV, 0.0), axis=-1)


def divisors(n: int) -> list[int]:
    """n's divisors, ascending, from the pairs (d, n/d) with d <= sqrt(n): sqrt(n) trials, whatever n's size."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({x for d in small for x in (d, n // d)})


def vocab_blocks(vocab: int, at_most: int) -> int:
    """The most vocabulary blocks, at most `at_most`, that split V evenly (a V with no divisor
    near `at_most` gets fewer, larger blocks: vocabularies padded to a multiple of 64 avoid it)."""
    return max(b for b in divisors(vocab) if b <= max(1, at_most))


def tiled_cross_entropy(x_ND, w, w_axes: str, targets_N, weight_N, n: int, constrain, cap: float | None = None,
                        per_token: bool = False):
    """Sum of weight x cross-entropy of the logits x @ w, computed n tokens at a time; w is (D, V) for
    w_axes "dv" or (V, D) for "vd" (a tied embedding, used as stored: its gradient then needs no
    transpose before it meets the lookup's).

    Forward: chunk c takes tokens c, c+C, c+2C, ... (as microbatches take rows), so that with
    the tokens split over `data` every chunk is split over it too; N not a multiple of n is
    padded with tokens of weight 0. It keeps each token's logsumexp (N floats).
    Backward: the logits are recomputed by vocabulary block instead (every token, V/C entries
    of the vocabulary, strided so that a block is split over `model` like V): each block's
    weight gradient is written once into its place. By token chunk, every chunk's (V, D)
    weight gradient would be a second head-sized buffer next to the accumulated one (XLA:CPU
    does not add a matmul's output in place).
    cap: the logits soft-capped first (the family's Ends.cap: Gemma's final_logit_softcapping), in both passes.
    per_token: each token's weight x cross-entropy (N,) instead of their sum (DPO sums them per answer); the
    backward is the same with a cotangent per token.
    """
    C = -(-x_ND.shape[0] // n)
    nb = vocab_blocks(w.shape[0] if w_axes == "vd" else w.shape[1], C)

    def forward(x_ND, w, targets_N, mask_N):
        return _chunked_forward(x_ND, w, w_axes, targets_N, mask_N, n, C, constrain, cap, per_token)

    @jax.custom_vjp
    def loss(x_ND, w, targets_N, weight_N):
        return forward(x_ND, w, targets_N, weight_N)[0]

    def fwd(x_ND, w, targets_N, weight_N):
        value, logz_N = forward(x_ND, w, targets_N, weight_N)
        return value, (x_ND, w, targets_N, weight_N, logz_N)

    def bwd(res, g):
        return _blockwise_backward(res, g, w_axes, nb, constrain, cap)

    loss.defvjp(fwd, bwd)
    return loss(x_ND, w, targets_N, weight_N.astype(jnp.float32))


def _chunked_forward(x_ND, w, w_axes, targets_N, mask_N, n, C, constrain, cap, per_token):
    """tiled_cross_entropy's forward, C chunks of n tokens (token c + k*C in chunk c): (its value, each
    token's logsumexp (N,))."""
    N, D = x_ND.shape
    pad = C * n - N
    if pad:
        x_ND = jnp.pad(x_ND, ((0, pad), (0, 0)))
        targets_N, mask_N = jnp.pad(targets_N, (0, pad)), jnp.pad(mask_N, (0, pad))
    # (n, C, D) is a free reshape; each chunk is a strided slice of it, not of a transposed copy
    x_nCD = constrain(x_ND.reshape(n, C, D), ("batch", None, "embed"))
    t_nC, m_nC = targets_N.reshape(n, C), mask_N.reshape(n, C)

    def chunk(total, c):
        x_nD, t_n, m_n = (jax.lax.dynamic_index_in_dim(a, c, 1, keepdims=False) for a in (x_nCD, t_nC, m_nC))
        logits = softcap(_logits(x_nD, w, w_axes, constrain), cap)
        logz = jax.nn.logsumexp(logits, axis=-1)
        ce = (logz - _target_logits(logits, t_n, 1, 0)) * m_n
        return total + jnp.sum(ce), (logz, ce)

    total, (logz_Cn, ce_Cn) = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), jnp.arange(C))
    value = ce_Cn.T.reshape(C * n)[:N] if per_token else total
    return value, logz_Cn.T.reshape(C * n)[:N]


def _blockwise_backward(res, g, w_axes, nb, constrain, cap):
    """tiled_cross_entropy's backward from the forward's residuals and the cotangent g: the logits recomputed
    in nb vocabulary blocks (block b holds entries b, b+nb, ...), each block's weight gradient written in place."""
    x_ND, w, targets_N, weight_N, logz_N = res
    N, D = x_ND.shape
    v_axis = 1 if w_axes == "vd" else 2
    shape = (w.shape[0] // nb, nb, D) if w_axes == "vd" else (D, w.shape[1] // nb, nb)
    w_r = w.reshape(shape)

    def block(carry, b):
        dx_ND, dw = carry
        w_b = jax.lax.dynamic_index_in_dim(w_r, b, v_axis, keepdims=False)
        logits = softcap(_logits(x_ND, w_b, w_axes, constrain), cap)
        # d loss / d logits = (softmax - one-hot) g weight; vocabulary entry i*nb + b in this block
        hit = _target_logits(None, targets_N, nb, b, logits.shape)
        d = (jnp.exp(logits - logz_N[:, None]) - hit) * (g * weight_N)[:, None]
        if cap is not None:  # through cap * tanh(z / cap): d/dz = 1 - (capped / cap)^2
            d = d * (1.0 - jnp.square(logits / cap))
        d = d.astype(x_ND.dtype)
        dx_ND = dx_ND + jnp.einsum(f"nv,{w_axes}->nd", d, w_b.astype(x_ND.dtype),
                                   preferred_element_type=jnp.float32)
        dw_b = jnp.einsum(f"nv,nd->{w_axes}", d, x_ND, preferred_element_type=jnp.float32).astype(w.dtype)
        return (dx_ND, jax.lax.dynamic_update_index_in_dim(dw, dw_b, b, v_axis)), None

    zeros = (jnp.zeros((N, D), jnp.float32), jnp.zeros(shape, w.dtype))
    (dx_ND, dw), _ = jax.lax.scan(block, zeros, jnp.arange(nb))
    return dx_ND.astype(x_ND.dtype), dw.reshape(w.shape), None, None


def cross_entropy(logits_BTV, targets_BT, weight_BT=None):
    """Sum of weight x next-token cross-entropy in nats (weight None: every token 1)."""
    logz = jax.nn.logsumexp(logits_BTV, axis=-1)
    tgt = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    ce = logz - tgt
    return jnp.sum(ce if weight_BT is None else ce * weight_BT)


def head_loss(c: ModelConfig, params: dict, x_BTD, targets_BT, weight_BT, constrain: Constrain = _no_constrain):
    """Sum of weight x cross-entropy of the head on final hidden states: whole logits, or tiled
    over tokens (c.loss_chunk) so that they are never materialised whole."""
    B, T, D = x_BTD.shape
    n = chunk_tokens(c.loss_chunk, B * T, c.vocab_size)
    if not n:
        return cross_entropy(head(c, params, x_BTD, constrain), targets_BT, weight_BT)
    x = final_norm(c, params, x_BTD)
    w, w_axes = head_weight(c, params)
    return tiled_cross_entropy(x.reshape(B * T, D), w, w_axes, targets_BT.reshape(B * T),
                               weight_BT.reshape(B * T), n, constrain, family(c.family).ends(c).cap)


def head_token_losses(c: ModelConfig, params: dict, x_BTD, targets_BT, weight_BT,
                      constrain: Constrain = _no_constrain):
    """Each target's weight x cross-entropy (B, T) from the final hidden states: whole or tiled (c.loss_chunk)."""
    B, T, D = x_BTD.shape
    n = chunk_tokens(c.loss_chunk, B * T, c.vocab_size)
    if not n:
        logits = head(c, params, x_BTD, constrain)
        tgt = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
        return (jax.nn.logsumexp(logits, axis=-1) - tgt) * weight_BT
    x = final_norm(c, params, x_BTD)
    w, w_axes = head_weight(c, params)
    return tiled_cross_entropy(x.reshape(B * T, D), w, w_axes, targets_BT.reshape(B * T), weight_BT.reshape(B * T),
                               n, constrain, family(c.family).ends(c).cap, per_token=True).reshape(B, T)


def dpo_head(c: ModelConfig, params: dict, x_BTD, batch: dict, scale: dict, constrain: Constrain = _no_constrain):
    """(DPO's value: pair loss / pairs + sft_weight x chosen token loss / chosen tokens, its metrics' (sum, pairs))
    of a batch's final hidden states (models/objectives/dpo.py)."""
    ce = head_token_losses(c, params, x_BTD, batch["targets"], batch["loss_weight"].astype(jnp.float32), constrain)
    pair, sft, metrics = dpo.sums(c.dpo, ce, batch)
    return pair * scale["pairs"] + c.dpo.sft_weight * sft * scale["chosen"], metrics


def dpo_eval_sums(c: ModelConfig, params: dict, batch: dict, **kw) -> dict:
    """What an evaluation adds up over its batches: the pair loss sum and pairs, the chosen token loss sum and
    chosen tokens, each metric's sum (trainer/run/evaluator.py divides once)."""
    x, _ = hidden(c, params, batch, **kw)
    return dpo_eval_head(c, params, x, batch, kw.get("constrain", _no_constrain))


def dpo_eval_head(c: ModelConfig, params: dict, x_BTD, batch: dict, constrain: Constrain = _no_constrain) -> dict:
    """`dpo_eval_sums` of a batch's final hidden states (a pipeline's last stage has them per microbatch)."""
    ce = head_token_losses(c, params, x_BTD, batch["targets"], batch["loss_weight"].astype(jnp.float32), constrain)
    pair, sft, metrics = dpo.sums(c.dpo, ce, batch)
    pairs, chosen = dpo.counts(batch)
    return {"pair": pair, "pairs": pairs, "sft": sft, "chosen": chosen, **{k: v for k, (v, _) in metrics.items()}}


def stack_sums(c: ModelConfig, params: dict, batch: dict, *, dtype=jnp.float32,
               constrain: Constrain = _no_constrain, gather=_identity, remat: str | None = None,
               placement: Placement = Placement()):
    """(sum of loss_weight x next-token loss, the layers' aux outputs {name: (sum, count)}) over a batch, on the
    platform and with the kv heads' repeat of `placement` (models/layers.py)."""
    x, aux = hidden(c, params, batch, dtype=dtype, constrain=constrain, gather=gather, remat=remat, placement=placement)
    return head_loss(c, params, x, batch["targets"], batch["loss_weight"], constrain), aux


def hidden(c: ModelConfig, params: dict, batch: dict, *, dtype=jnp.float32, constrain: Constrain = _no_constrain,
           gather=_identity, remat: str | None = None, placement: Placement = Placement()):
    """(the final hidden states (B, T, D), the layers' aux outputs) of a batch."""
    x = embed(c, params, batch["tokens"], dtype, constrain)
    return layer_stack(c, params["layers"], x, constrain=constrain, gather=gather, remat=remat,
                       documents=documents_of(c, batch), placement=placement)


def loss_sum(c: ModelConfig, params: dict, batch: dict, **kw):
    """Sum of loss_weight x next-token loss over a batch of fields (models/batch.py)."""
    return stack_sums(c, params, batch, **kw)[0]


def scales(c: ModelConfig, batch: dict) -> dict:
    """The step's divisions, each taken once over the whole step batch: 1 / its counted tokens for the token loss,
    its weight (the family's aux_weights; 1 unless given, 0 for a statistic) / each aux output's count (the family's
    aux_counts) for that output (1 where a count is 0)."""
    spec = family(c.family)
    counts, weights = spec.aux_counts(c, batch), spec.aux_weights(c)
    out = {"loss": inverse_count(batch), "aux": {k: weights.get(k, 1.0) * mean_of(1.0, n) for k, n in counts.items()}}
    if c.dpo is not None:  # the pairs' mean and the chosen tokens' mean; the metrics are statistics (weight 0)
        out.update(dpo.scales(batch))
        out["aux"].update({k: jnp.zeros((), jnp.float32) for k in dpo.METRICS})
    return out


def zero_parts(c: ModelConfig) -> dict:
    """`objective`'s parts, all zero: where a path starts adding them up."""
    z = lambda: jnp.zeros((), jnp.float32)  # noqa: E731
    aux = {k: (z(), z()) for k in family(c.family).aux}
    return {"loss": z(), "aux": {**aux, **dpo.zero_metrics()} if c.dpo is not None else aux}


def part_metrics(parts: dict) -> dict:
    """The step's metrics of its summed parts: the loss, and each aux output's mean (its sum / its count, divided
    once, here) as aux/<name>, or under its own name where that has a "/" (a statistic's, e.g. moe/dropped)."""
    return {"loss": parts["loss"], **{k if "/" in k else f"aux/{k}": mean_of(total, n)
                                      for k, (total, n) in parts["aux"].items()}}


def objective(c: ModelConfig, params: dict, batch: dict, scale: dict, **kw):
    """(what the step differentiates, its parts): the token loss sum x scale["loss"] plus each aux sum x its
    scale (its weight / its count: a statistic's is 0); parts = {"loss": the scaled token loss sum, "aux": {name:
    (sum, count)}}, the sums every path adds up over its microbatches, data ranks and stages."""
    if c.dpo is not None:
        x, aux = hidden(c, params, batch, **kw)
        loss, metrics = dpo_head(c, params, x, batch, scale, kw.get("constrain", _no_constrain))
        aux = {**aux, **metrics}
    else:
        token, aux = stack_sums(c, params, batch, **kw)
        loss = token * scale["loss"]
    value = loss
    for k, (total, _) in aux.items():
        value = value + total * scale["aux"][k]
    return value, {"loss": loss, "aux": aux}


def documents_of(c: ModelConfig, batch: dict):
    """(segment_ids, positions) of a batch where the model keeps to documents (c.documents), else None:
    one document per row, and the program of a run without document masks stays as it was."""
    return (batch["segment_ids"], batch["positions"]) if c.documents else None


def loss_fn(c: ModelConfig, params: dict, batch: dict, **kw):
    """The mean next-token loss over the batch's counted tokens, on one shard in one piece (the
    train step sums over its microbatches and devices and divides once instead)."""
    return mean_of(loss_sum(c, params, batch, **kw), counted(batch))
