"""Next-token cross-entropy, the one form every path takes: from the whole logits (`cross_entropy`, `token_losses`)
or tiled over tokens (model.loss_chunk, `tiled_cross_entropy`), and `head_cross_entropy`, the one place that decides
which from the head's input (the final hidden states).

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

from models.config import ModelConfig
from models.spec import family
from models.transformer import Constrain, _no_constrain, final_norm, head, head_weight, softcap

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
    split axis would bring the logits together); the sum has one non-zero term, so it is exact. The pick is
    rematerialised (jax.checkpoint): its backward remakes the (n, V) comparison from the targets, as XLA does, so
    the residuals are the logits and the targets only (the planner traces them: trainer/plan/memory.py)."""
    pick = jax.checkpoint(lambda l, t: _target_logits(l, t, 1, 0))
    return jax.nn.logsumexp(logits_nV, axis=-1) - pick(logits_nV, targets_n)


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
    """Sum of weight x next-token cross-entropy in nats of whole logits (weight None: every token 1): `token_losses`
    over the flattened tokens."""
    V = logits_BTV.shape[-1]
    ce = token_losses(logits_BTV.reshape(-1, V), targets_BT.reshape(-1))
    return jnp.sum(ce if weight_BT is None else ce * weight_BT.reshape(-1))


def head_cross_entropy(c: ModelConfig, params: dict, x_BTD, targets_BT, weight_BT,
                       constrain: Constrain = _no_constrain, per_token: bool = False, normed: bool = False):
    """Sum of weight x cross-entropy of the head on final hidden states (per_token: each target's, (B, T)): the whole
    logits, or tiled over tokens (c.loss_chunk, `chunk_tokens`) so that they are never materialised whole. `normed`:
    x is normed already (a multi-token prediction module's output): the head's projection alone."""
    B, T, D = x_BTD.shape
    n = chunk_tokens(c.loss_chunk, B * T, c.vocab_size)
    if not n:
        logits = head(c, params, x_BTD, constrain, normed)
        if not per_token:
            return cross_entropy(logits, targets_BT, weight_BT)
        return (token_losses(logits.reshape(B * T, -1), targets_BT.reshape(-1)) * weight_BT.reshape(-1)).reshape(B, T)
    x = x_BTD if normed else final_norm(c, params, x_BTD)
    w, w_axes = head_weight(c, params)
    ce = tiled_cross_entropy(x.reshape(B * T, D), w, w_axes, targets_BT.reshape(B * T), weight_BT.reshape(B * T), n,
                             constrain, family(c.family).ends(c).cap, per_token=per_token)
    return ce.reshape(B, T) if per_token else ce
