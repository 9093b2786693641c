"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash), a piece of the DeepSeek family: queries
through a low-rank path (or one projection), keys and values from one compressed latent per token plus one RoPE
key shared by the heads; RoPE on the decoupled part of each query and key only; values of their own width.

Letters as in models/transformer.py, plus Rq the queries' rank (q_lora_rank), Rkv the latent's (kv_lora_rank), En
the heads' no-RoPE width (qk_nope_head_dim), Er the RoPE width (qk_rope_head_dim), Ev the values' (v_head_dim).
The weights of one layer (each projection's input first, as models/transformer.py's):
  wq_a (D, Rq), q_norm (Rq,), wq_b (Rq, H, En + Er)     queries through the low rank; or wq (D, H, En + Er)
  wkv_a (D, Rkv + Er)                                     the latent and the shared RoPE key
  kv_norm (Rkv,), wkv_b (Rkv, H, En + Ev)                 the latent normed and expanded to each head's key and value
  wo (H, Ev, D)
Training expands the latent per head (as MaxText, torchtitan and Megatron-LM do); decoding caches the latent and the
RoPE key alone and absorbs the keys' and values' up-projections into the query and the output (absorbed_attention)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.layers import apply_rope, attend, rms_norm


def rope_part(x_BTNE, cos, sin, interleave: bool):
    """RoPE on the decoupled part: with `interleave` (DeepSeek's released weights) each pair (x0, x1), (x2, x3), ...
    turns by one angle, laid out first as the rotate-half form it equals (the evens, then the odds: queries and keys
    alike, so their products are the interleaved ones)."""
    if interleave:
        x_BTNE = jnp.concatenate([x_BTNE[..., 0::2], x_BTNE[..., 1::2]], axis=-1)
    return apply_rope(x_BTNE, cos, sin)


def queries(p: dict, x_BTD, cos, sin, nope: int, interleave: bool, eps: float):
    """q (B, T, H, En + Er) of the normed hidden states x, its RoPE part turned (cos, sin: the Er-wide part's
    tables at the tokens' positions, times YaRN's cos/sin factor where it has one)."""
    if "wq" in p:
        q = jnp.einsum("btd,dhe->bthe", x_BTD, p["wq"])
    else:
        q_low = rms_norm(jnp.einsum("btd,dr->btr", x_BTD, p["wq_a"]), p["q_norm"], eps)
        q = jnp.einsum("btr,rhe->bthe", q_low, p["wq_b"])
    return jnp.concatenate([q[..., :nope], rope_part(q[..., nope:], cos, sin, interleave)], axis=-1)


def latents(p: dict, x_BTD, cos, sin, interleave: bool, eps: float):
    """(the normed latent (B, T, Rkv), the shared RoPE key turned (B, T, Er)): all that a token's keys and values
    are made of, and all that decoding caches (Rkv + Er numbers per token and layer)."""
    latent = jnp.einsum("btd,dr->btr", x_BTD, p["wkv_a"])
    Rkv = p["kv_norm"].shape[0]
    k_rot = rope_part(latent[..., None, Rkv:], cos, sin, interleave)[..., 0, :]
    return rms_norm(latent[..., :Rkv], p["kv_norm"], eps), k_rot


def queries_keys_values(p: dict, x_BTD, cos, sin, nope: int, interleave: bool, eps: float):
    """(q (B, T, H, En + Er), k (B, T, H, En + Er), v (B, T, H, Ev)): the latent expanded per head (training)."""
    kv_low, k_rot = latents(p, x_BTD, cos, sin, interleave, eps)
    kv = jnp.einsum("btr,rhe->bthe", kv_low, p["wkv_b"])
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k_rot = jnp.broadcast_to(k_rot[:, :, None], k_nope.shape[:3] + (k_rot.shape[-1],))
    return queries(p, x_BTD, cos, sin, nope, interleave, eps), jnp.concatenate([k_nope, k_rot], axis=-1), v


def absorbed_attention(p: dict, x_BTD, cos, sin, cached: tuple, q_pos, k_pos, scale: float, nope: int,
                       interleave: bool, eps: float):
    """Decoding's attention output (B, T, D) of new tokens x against the cache (latent (B, S, Rkv), RoPE key
    (B, S, Er), the new tokens' included) at positions q_pos (T,) and k_pos (S,): the keys' and values'
    up-projections absorbed into the query and the output, so that no key or value is ever expanded per head."""
    latent, k_rot = cached
    w_k, w_v = p["wkv_b"][..., :nope], p["wkv_b"][..., nope:]  # (Rkv, H, En), (Rkv, H, Ev)
    q = queries(p, x_BTD, cos, sin, nope, interleave, eps).astype(jnp.float32)
    q_latent = jnp.einsum("bthe,rhe->bthr", q[..., :nope], w_k.astype(jnp.float32))
    s = (jnp.einsum("bthr,bsr->bhts", q_latent, latent.astype(jnp.float32))
         + jnp.einsum("bthe,bse->bhts", q[..., nope:], k_rot.astype(jnp.float32))) * scale
    s = jnp.where(k_pos[None, None, None, :] <= q_pos[None, None, :, None], s, -jnp.inf)
    o_latent = jnp.einsum("bhts,bsr->bthr", jax.nn.softmax(s, axis=-1), latent.astype(jnp.float32))
    o = jnp.einsum("bthr,rhe->bthe", o_latent, w_v.astype(jnp.float32)).astype(x_BTD.dtype)
    return jnp.einsum("bthe,hed->btd", o, p["wo"])


def latent_attention(p: dict, x_BTD, cos, sin, attention, scale: float, nope: int, interleave: bool, eps: float,
                     **kw):
    """The attention's output (B, T, D) before the residual add: `attention` a LayerCall's (any strategy and
    kernel: the values' width and the scale reach it through models/layers.py `attend`), `scale` the softmax's
    (1 / sqrt(En + Er), times YaRN's softmax factor where the model has one)."""
    q, k, v = queries_keys_values(p, x_BTD, cos, sin, nope, interleave, eps)
    return jnp.einsum("bthe,hed->btd", attend(attention, q, k, v, scale, **kw), p["wo"])
