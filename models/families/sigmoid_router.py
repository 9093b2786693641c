"""DeepSeek-V3's router (Kimi-K2's and GLM-4.7-Flash's route the same way), a piece of its family: sigmoid scores;
a per-expert correction bias that the choice adds and the weights never see; the choice limited to the best
`topk_group` of `n_group` groups of experts (a group's score the sum of its two best biased scores; the other
groups' experts masked with -inf, as transformers' `DeepseekV3TopkRouter`); the chosen experts' unbiased scores,
renormalised where `norm_topk_prob`, times `routed_scaling_factor`. And the auxiliary-loss-free balancing rule that
moves the bias after each optimizer step: bias + rate x sign(mean load - load), each layer's experts' loads counted
over the whole step batch. And the sequence-wise balance loss, per document.

Letters as in models/families/moe.py: N tokens, X experts, k experts per token, G groups, L layers."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.families.moe import top_k
from models.spec import LOCAL


def group_limited_top_k(scores_NX, bias_X, n_group: int, topk_group: int, k: int):
    """(the k chosen experts (N, k) int32, in the order of their biased scores, best first; their unbiased
    scores (N, k)): the k best of scores + bias among the experts of each token's best `topk_group` groups."""
    N, X = scores_NX.shape
    per = X // n_group
    choice_NX = scores_NX + bias_X  # the bias moves the choice alone (integers: no gradient reaches it)
    best_NG = top_k(choice_NX.reshape(N * n_group, per), min(2, per))[0].reshape(N, n_group, -1).sum(-1)
    keep_NG = jnp.any(jax.nn.one_hot(top_k(best_NG, topk_group)[1], n_group, dtype=bool), axis=1)
    masked_NX = jnp.where(jnp.repeat(keep_NG, per, axis=1), choice_NX, -jnp.inf)
    idx_NK = top_k(masked_NX, k)[1]
    return idx_NK, jnp.take_along_axis(scores_NX, idx_NK, axis=-1)


def route(logits_NX, bias_X, n_group: int, topk_group: int, k: int, norm_topk_prob: bool, scale: float):
    """(the sigmoid scores (N, X), the chosen experts (N, k) int32, their weights (N, k)) of float32 router logits."""
    scores_NX = jax.nn.sigmoid(logits_NX)
    idx_NK, w_NK = group_limited_top_k(scores_NX, bias_X, n_group, topk_group, k)
    if norm_topk_prob:
        w_NK = w_NK / (jnp.sum(w_NK, axis=-1, keepdims=True) + 1e-20)
    return scores_NX, idx_NK, w_NK * scale


def balanced_bias(bias_LX, loads_LX, rate: float):
    """Each layer's bias after one step of auxiliary-loss-free balancing: an expert loaded below its layer's mean
    load gains `rate`, one above loses it, one at the mean keeps its bias (loads: the step's choices per expert)."""
    loads = loads_LX.astype(jnp.float32)
    return bias_LX + rate * jnp.sign(jnp.mean(loads, axis=-1, keepdims=True) - loads).astype(bias_LX.dtype)


def sequence_balance(scores_BTX, idx_BTK, segments_BT, valid_BT, collectives=LOCAL):
    """DeepSeek-V3's sequence-wise balance loss, per document (a row's tokens of one segment id; a row without
    documents is one): (its sum over the documents, the documents counted), each document's term
    sum_i f_i P_i over the experts i, with f_i = X / (k T) x the document's choices of expert i and P_i the mean over
    its T tokens of expert i's score divided by the token's sum of scores; padding (valid_BT False) counts nowhere.
    The objective weighs the sum by alpha / the step's documents (one mean over every document of the step).
    Where each row's tokens are split over context ranks (`collectives` over `seq`), a document's tokens and choices
    are counted over the ranks and P_i is this rank's share of its sum: the ranks' terms add up to the document's,
    each token's gradient from its own rank (as models/families/moe.py router_losses)."""
    B, T, X = scores_BTX.shape
    K = idx_BTK.shape[-1]
    n = T * collectives.axis_size("seq") + 1  # a row's segment ids, 0 (padding) to its whole length
    valid = valid_BT.astype(jnp.float32)
    doc = (jnp.arange(B)[:, None] * n + segments_BT.astype(jnp.int32)).reshape(-1)  # (row, segment): one document
    share = (scores_BTX / jnp.sum(scores_BTX, axis=-1, keepdims=True)) * valid[..., None]
    chosen = jnp.sum(jax.nn.one_hot(idx_BTK, X, dtype=jnp.float32), axis=2) * valid[..., None]
    tokens = collectives.psum(jax.ops.segment_sum(valid.reshape(-1), doc, num_segments=B * n), "seq")
    f = collectives.psum(jax.ops.segment_sum(chosen.reshape(-1, X), doc, num_segments=B * n), "seq")
    p = jax.ops.segment_sum(share.reshape(-1, X), doc, num_segments=B * n)
    per_doc = X / K * jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1) / jnp.maximum(tokens, 1.0) ** 2
    return jnp.sum(jnp.where(tokens > 0, per_doc, 0.0)), jnp.sum(tokens > 0).astype(jnp.float32)
