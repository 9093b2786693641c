"""Which causal grouped-query attention runs: jax.nn's (XLA's or cuDNN's) or the manual kernel.

All take q (B, T, H, E) and k, v (B, T, K, E) with H a multiple of K and return (B, T, H, E).
The plain reference is jax.nn.dot_product_attention(q, k, v, is_causal=True) ("xla"). The
"manual" kernel, with a hand-written FlashAttention-style backward tuned for XLA:CPU, is
models/kernels/fast_cpu.py's `causal_attention`, one of the CPU fast paths.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from models.kernels.fast_cpu import causal_attention

log = logging.getLogger(__name__)


# The manual kernel's causal query block where model.attention_block is unset: XLA:CPU's fastest (docs/performance.md);
# on TPU fewer, larger blocks (the 7B v5p step: XLA:TPU temp 5.12 GB at 1024 against 5.05 at 512, and a tenth less
# to compile: docs/plan.md)
BLOCK = {"tpu": 1024}


def block_for(block: int | None, platform: str) -> int:
    """The manual kernel's query block: `block` (model.attention_block), else the platform's (BLOCK, else 128)."""
    return BLOCK.get(platform, 128) if block is None else block


def select(impl: str, dtype, platform: str, cpu_fast: bool = True) -> str:
    """The implementation `attention` runs for `impl` on a jax platform name ("cpu", "gpu", "tpu").

    cpu_fast=False (the reference path, model.kernels=reference) makes CPU's `auto` XLA's attention."""
    # auto: cuDNN's fused kernel on GPU for bfloat16/float16; the manual (blockwise) kernel on CPU and TPU: it
    # saves one log-sum-exp per query, where jax.nn's XLA attention keeps float32 (T, T) scores and probabilities
    # per head (XLA:TPU's temp of the 7B v5p step: 7.52 GB with XLA's, docs/plan.md); XLA's elsewhere
    if impl != "auto":
        return impl
    if platform == "cpu":
        return "manual" if cpu_fast else "xla"
    if platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "manual" if platform == "tpu" else "xla"


@functools.lru_cache(maxsize=None)
def _warn_fallback(reason: str):
    """Log once per reason that cuDNN's attention was not used (traced once per layer and shape)."""
    log.warning("attention: cuDNN's fused kernel refused these inputs or is missing (%s); using XLA's", reason)


# What each implementation supports beyond causal attention: "segments" = attention inside each token's
# document (segment_ids), "window" = a sliding window. cuDNN's claims nothing until it is checked on a GPU; a
# config that needs what the chosen one lacks runs XLA's, which supports everything, and says so once.
FEATURES = {"manual": {"segments", "window"}, "xla": {"segments", "window"}, "cudnn": set()}


@functools.lru_cache(maxsize=None)
def _warn_unsupported(impl: str, feature: str):
    log.warning("attention: %s does not support %s; using XLA's attention for them", impl, feature)


def reset_warnings():
    """Say each fallback again the next time it happens (they are said once per process)."""
    _warn_fallback.cache_clear()
    _warn_unsupported.cache_clear()
    _warn_positions.cache_clear()


def masked_attention(q_BTHE, k_BSKE, v_BSKE, mask, softcap=None, scale=None, sinks=None):
    """Attention written out: scores (float32) scaled by `scale` (default head_dim ** -0.5), soft-capped as
    softcap * tanh(scores / softcap), masked where `mask` (broadcast against (B, K, G, T, S)) is False, softmax,
    values. `sinks` (H,): each head's learned sink logit (gpt-oss), one more term in every query's softmax
    denominator that takes no value. For what the fused kernels do not take: a soft-cap, another scale, a window
    that differs by layer, sinks."""
    B, T, H, E = q_BTHE.shape
    K = k_BSKE.shape[2]
    q = q_BTHE.reshape(B, T, K, H // K, E)
    s = jnp.einsum("btkge,bske->bkgts", q, k_BSKE, preferred_element_type=jnp.float32)
    s = s * (E ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask, s, -jnp.inf)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:  # the sink's column joins the softmax, then is dropped
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, H // K, 1, 1), s.shape[:-1] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s, sink], -1), axis=-1)[..., :-1]
    return jnp.einsum("bkgts,bske->btkge", p.astype(v_BSKE.dtype), v_BSKE).reshape(B, T, H, E)


def causal_mask(T: int, segments=None, window=None):
    """(B or 1, 1, 1, T, T) True where a query may see a key: causal, inside `window` positions (may be traced),
    inside its document."""
    ahead = jnp.arange(T)[:, None] - jnp.arange(T)[None, :]
    keep = ahead >= 0
    if window is not None:
        keep = keep & (ahead < window)
    keep = keep[None, None, None]
    if segments is not None:
        keep = keep & (segments[:, :, None] == segments[:, None, :])[:, None, None]
    return keep


def position_mask(positions, segments=None, window=None):
    """(B or 1, 1, 1, Tq, S) True where a query may see a key, by position: positions = (the queries' (Tq,), the
    keys' (S,)); segments a pair ((B, Tq), (B, S)) or None; a window as causal_mask's."""
    q, k = positions
    ahead = q[:, None] - k[None, :]
    keep = ahead >= 0
    if window is not None:
        keep = keep & (ahead < window)
    keep = keep[None, None, None]
    if segments is not None:
        sq, sk = segments
        keep = keep & (sq[:, :, None] == sk[:, None, :])[:, None, None]
    return keep


@functools.lru_cache(maxsize=None)
def _warn_positions(impl: str):
    log.warning("attention: %s does not take positions (a chunk of a sequence under context parallelism); using "
                "XLA's attention with a mask from the positions", impl)


GLOBAL = 2 ** 30  # a traced window that means every causal key (a mixed stack's global layer)


def attention(q_BTHE, k_BTKE, v_BTKE, impl: str = "auto", block: int = 128, platform: str | None = None,
              cpu_fast: bool = True, segments=None, window: int | None = None, softcap=None, scale=None,
              windows: tuple | None = None, positions=None, sinks=None):
    """Causal attention by implementation: "manual" (models/kernels/fast_cpu.py), "xla", "cudnn" or "auto" (`select`);
    with segments (B, T), inside each token's segment only; with a window, over the keys fewer than `window`
    positions before each query (itself included) only. `scale`: the scores' (default head_dim ** -0.5);
    `softcap`: scores soft-capped (the masked path); a traced `window` (a mixed stack's, GLOBAL for every key)
    that takes one of the static `windows` (None: every key) runs that window's own kernel, picked at run time.
    `positions` = (the queries' (Tq,), the keys' (S,), float32): causality and windows by those positions, not by
    index (a chunk of a sequence against keys gathered from elsewhere: context parallelism, models/context_parallel/gather.py);
    segments then a pair (the queries' (B, Tq), the keys' (B, S)). Without, whole sequences as they were.
    `sinks` (H,): per-head attention sinks (masked_attention's): the manual kernels take them, cuDNN's none (the
    manual kernel runs instead), XLA's by the written-out softmax."""
    # "xla"/"cudnn" are jax.nn.dot_product_attention's (its own default, None, is XLA's: it never
    # picks cuDNN). An auto cuDNN that refuses the inputs falls back to XLA's and says why, once.
    if scale is not None and softcap is None:  # the kernels' own scale, the rest folded into q
        q_BTHE = q_BTHE * jnp.asarray(scale * q_BTHE.shape[-1] ** 0.5, q_BTHE.dtype)
        scale = None
    if softcap is None and windows is not None and not isinstance(window, (int, type(None))):
        kw = dict(impl=impl, block=block, platform=platform, cpu_fast=cpu_fast, segments=segments,
                  positions=positions, sinks=sinks)
        branches = [functools.partial(attention, window=w, **kw) for w in windows]
        index = jnp.argmax(jnp.stack([window == (w or GLOBAL) for w in windows]))
        return jax.lax.switch(index, branches, q_BTHE, k_BTKE, v_BTKE)
    chosen = select(impl, q_BTHE.dtype, platform or jax.devices()[0].platform, cpu_fast)
    chosen = "manual" if sinks is not None and chosen == "cudnn" else chosen  # cuDNN's takes no sink
    # only the manual kernels take sinks (jax.nn's log-sum-exp residual carries no gradient): XLA's writes them out
    takes_sinks = sinks is None or (positions is None and chosen == "manual")
    if softcap is not None or scale is not None or not takes_sinks or not isinstance(window, (int, type(None))):
        with jax.named_scope("attention_masked"):  # Gemma's, and sinks where no fused kernel takes them yet
            mask = (causal_mask(q_BTHE.shape[1], segments, window) if positions is None
                    else position_mask(positions, segments, window))
            return masked_attention(q_BTHE, k_BTKE, v_BTKE, mask, softcap, scale, sinks)
    if segments is not None and "segments" not in FEATURES[chosen]:
        _warn_unsupported(chosen, "document masks (segment_ids)")
        chosen = "xla"
    if window and "window" not in FEATURES[chosen]:
        _warn_unsupported(chosen, "sliding windows")
        chosen = "xla"
    if positions is not None and chosen == "cudnn":
        _warn_positions(chosen)
        chosen = "xla"
    # each implementation's ops are scoped `attention_<name>`: the HLO's metadata says which one ran
    if chosen == "cudnn" and impl == "auto":
        try:
            with jax.named_scope("attention_cudnn"):
                return jax.nn.dot_product_attention(q_BTHE, k_BTKE, v_BTKE, is_causal=True, implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError) as e:  # shape, dtype, GPU or cuDNN version
            _warn_fallback(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            chosen = "xla"
    with jax.named_scope(f"attention_{chosen}"):
        if chosen == "manual":
            return causal_attention(q_BTHE, k_BTKE, v_BTKE, block, segments, window, positions, sinks)
        if positions is not None:
            mask = position_mask(positions, segments, window or None)[:, 0]  # (B or 1, 1, Tq, S)
            return jax.nn.dot_product_attention(q_BTHE, k_BTKE, v_BTKE, mask=mask, implementation=chosen)
        mask = None if segments is None else (segments[:, None, :, None] == segments[:, None, None, :])
        local = {"local_window_size": (window - 1, 0)} if window else {}
        return jax.nn.dot_product_attention(q_BTHE, k_BTKE, v_BTKE, mask=mask, is_causal=True,
                                            implementation=chosen, **local)

