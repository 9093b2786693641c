"""Next-token cross-entropy of the output head, whole or tiled over tokens (model.loss_chunk).

Letters as in models/transformer.py; N tokens (flattened B*T), C chunks of n tokens.

At Llama 3's 128k vocabulary the float32 logits of an 8k-token microbatch are 4 GB, and their
gradient as much again. The tiled form (MaxText's vocab tiling, Levanter's blockwise
cross-entropy) never materialises them: a `lax.scan` over chunks of tokens computes each
chunk's logits (n, V), their logsumexp and the target's logit, and `jax.checkpoint` on the
chunk makes the backward recompute the chunk's logits instead of storing them. Peak memory
for the loss is then one chunk's logits and their gradient, plus the head weight's gradient.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

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


def _token_losses(logits_nV, targets_n):
    """logsumexp - target logit per token. The target is picked by comparing with an iota, not
    gathered: with the vocabulary split over `model` each rank keeps its slice (a gather on a
    split axis would bring the logits together); the sum has one non-zero term, so it is exact."""
    logz = jax.nn.logsumexp(logits_nV, axis=-1)
    hit = jax.lax.broadcasted_iota(jnp.int32, logits_nV.shape, 1) == targets_n[:, None]
    return logz - jnp.sum(jnp.where(hit, logits_nV, 0.0), axis=-1)


def tiled_cross_entropy(x_ND, w, w_axes: str, targets_N, n: int, constrain):
    """Mean cross-entropy of the logits x @ w, computed n tokens at a time; w is (D, V) for
    w_axes "dv" or (V, D) for "vd" (a tied embedding, used as stored: its gradient then needs no
    transpose before it meets the lookup's).

    Chunk c takes tokens c, c+C, c+2C, ... (as microbatches take rows), so that with the
    tokens split over `data` every chunk is split over it too and all devices work on every
    chunk. N not a multiple of n: padded with masked-out tokens.
    """
    N, D = x_ND.shape
    C = -(-N // n)
    pad = C * n - N
    mask_N = jnp.ones((N,), jnp.float32)
    if pad:
        x_ND = jnp.pad(x_ND, ((0, pad), (0, 0)))
        targets_N, mask_N = jnp.pad(targets_N, (0, pad)), jnp.pad(mask_N, (0, pad))
    # (n, C, D) is a free reshape; each chunk is a strided slice of it, not of a transposed
    # copy (scanning over a (C, n, D) transpose held one more copy of x and of its gradient)
    x_nCD = constrain(x_ND.reshape(n, C, D), ("batch", None, "embed"))
    t_nC, m_nC = targets_N.reshape(n, C), mask_N.reshape(n, C)

    def chunk(total, c):
        x_nD, t_n, m_n = (jax.lax.dynamic_index_in_dim(a, c, 1, keepdims=False) for a in (x_nCD, t_nC, m_nC))
        return total + jnp.sum(_token_losses(_logits(x_nD, w, w_axes, constrain), t_n) * m_n), None

    # nothing saved: the backward recomputes the chunk's logits from its inputs
    chunk = jax.checkpoint(chunk, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    total, _ = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), jnp.arange(C))
    return total / N
