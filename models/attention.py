"""Causal grouped-query attention with a hand-written backward pass (FlashAttention's algebra).

`causal_attention(q, k, v)` equals `jax.nn.dot_product_attention(q, k, v, is_causal=True)` for
q (B, T, H, E) and k, v (B, T, K, E) with H a multiple of K. What differs is what is kept for the
backward pass and how it is computed:

  forward   S = Q K^T / sqrt(E), masked;  m = rowmax S;  P~ = exp(S - m);  l = rowsum P~
            O = (P~ V) / l  (normalised after the product: T x E divides instead of T x T)
            saved: Q, K, V, O and the log-sum-exp L = m + log l  (no T x T array)
  backward  P = exp(S - L) from a recomputed S;  dV = P^T dO;  dP = dO V^T
            D = rowsum(dO * O)  (T x E work, not T x T: rowsum(P * dP) = rowsum(dO * O))
            dS = P * (dP - D);  dQ = dS K / sqrt(E);  dK = dS^T Q / sqrt(E)

With autodiff through the plain softmax, XLA:CPU stores the T x T probabilities of every layer,
zero-fills and slices them through the layer loop, and runs the softmax backward as several
T x T passes; here the backward has one recomputed QK^T and two T x T elementwise passes.
Queries are grouped by their kv head, (B, K, G, T, E), so K/V are never repeated for GQA.
Scores, softmax and L are float32 whatever the input dtype.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)


def _group(q_BTHE, K):
    B, T, H, E = q_BTHE.shape
    return q_BTHE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, E)


def _ungroup(x_BKGTE):
    B, K, G, T, E = x_BKGTE.shape
    return x_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, E)


def _kv(x_BSKE):
    return x_BSKE.transpose(0, 2, 1, 3)  # (B, K, S, E)


def _scores(q, k, scale, offset):
    """Scaled scores (B, K, G, Tq, S) in float32 of queries at positions offset.. against keys
    0..S-1; keys after a query's position are at -inf (only the last Tq keys can be)."""
    s = jnp.einsum("bkgte,bkse->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    Tq, S = s.shape[-2:]
    causal = (jnp.arange(Tq)[:, None] + offset) >= jnp.arange(S)[None, :]
    return jnp.where(causal, s, -jnp.inf)


def _blocks(T, block):
    """Query blocks (start, stop): block i needs keys 0..stop-1 only (the causal saving)."""
    if block <= 0 or T % block or T <= block:
        return [(0, T)]
    return [(a, a + block) for a in range(0, T, block)]


def _forward(q, k, v, scale, block):
    outs, lses = [], []
    for a, b in _blocks(q.shape[3], block):
        s = _scores(q[:, :, :, a:b], k[:, :, :b], scale, a)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("bkgts,bkse->bkgte", p.astype(v.dtype), v[:, :, :b],
                       preferred_element_type=jnp.float32) / l
        outs.append(o.astype(q.dtype))
        lses.append((m + jnp.log(l))[..., 0])
    cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=3)  # noqa: E731
    return cat(outs), cat(lses)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, scale, block):
    return _forward(q, k, v, scale, block)[0]


def _attention_fwd(q, k, v, scale, block):
    o, lse = _forward(q, k, v, scale, block)
    return o, (q, k, v, o, lse)


def _attention_bwd(scale, block, res, do):
    q, k, v, o, lse = res
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    dqs, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for a, b in _blocks(q.shape[3], block):
        qa, doa, kb, vb = q[:, :, :, a:b], do[:, :, :, a:b], k[:, :, :b], v[:, :, :b]
        p = jnp.exp(_scores(qa, kb, scale, a) - lse[..., a:b, None])
        dv_b = jnp.einsum("bkgts,bkgte->bkse", p.astype(do.dtype), doa, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgte,bkse->bkgts", doa, vb, preferred_element_type=jnp.float32)
        ds = (p * (dp - d[..., a:b, :]) * scale).astype(q.dtype)
        dqs.append(jnp.einsum("bkgts,bkse->bkgte", ds, kb, preferred_element_type=jnp.float32))
        dk_b = jnp.einsum("bkgts,bkgte->bkse", ds, qa, preferred_element_type=jnp.float32)
        pad = ((0, 0), (0, 0), (0, k.shape[2] - b), (0, 0))  # keys past b get nothing from this block
        dk, dv = dk + jnp.pad(dk_b, pad), dv + jnp.pad(dv_b, pad)
    dq = dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


def causal_attention(q_BTHE, k_BTKE, v_BTKE, block: int = 128):
    """Causal attention output (B, T, H, E); see the module docstring."""
    K, E = k_BTKE.shape[2], q_BTHE.shape[-1]
    o = _attention(_group(q_BTHE, K), _kv(k_BTKE), _kv(v_BTKE), 1.0 / E ** 0.5, block)
    return _ungroup(o)


def select(impl: str, dtype, platform: str) -> str:
    """The implementation `attention` runs for `impl` on a jax platform name ("cpu", "gpu", "tpu")."""
    # auto: cuDNN's fused kernel on GPU for bfloat16/float16; the manual kernel only on CPU, whose
    # algebra and blocking are tuned for XLA:CPU; elsewhere (TPU) jax.nn's XLA attention, which XLA fuses
    if impl != "auto":
        return impl
    if platform == "cpu":
        return "manual"
    if platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "xla"


@functools.lru_cache(maxsize=None)
def _warn_fallback(reason: str):
    """Log once per reason that cuDNN's attention was not used (traced once per layer and shape)."""
    log.warning("attention: cuDNN's fused kernel refused these inputs or is missing (%s); using XLA's", reason)


def attention(q_BTHE, k_BTKE, v_BTKE, impl: str = "auto", block: int = 128, platform: str | None = None):
    """Causal attention by implementation: "manual" (above), "xla", "cudnn" or "auto" (`select`)."""
    # "xla"/"cudnn" are jax.nn.dot_product_attention's (its own default, None, is XLA's: it never
    # picks cuDNN). An auto cuDNN that refuses the inputs falls back to XLA's and says why, once.
    chosen = select(impl, q_BTHE.dtype, platform or jax.devices()[0].platform)
    if chosen == "manual":
        return causal_attention(q_BTHE, k_BTKE, v_BTKE, block)
    if chosen == "cudnn" and impl == "auto":
        try:
            return jax.nn.dot_product_attention(q_BTHE, k_BTKE, v_BTKE, is_causal=True, implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError) as e:  # shape, dtype, GPU or cuDNN version
            _warn_fallback(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            chosen = "xla"
    return jax.nn.dot_product_attention(q_BTHE, k_BTKE, v_BTKE, is_causal=True, implementation=chosen)
