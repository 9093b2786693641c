"""The Gemma 2 and Gemma 3 families (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`): Llama's projections with

  - embeddings x sqrt(d_model) and every RMSNorm gain applied as (1 + w) (ModelConfig.embed_scale,
    norm_plus_one: kept in the computation, the weights stored as transformers stores them);
  - a norm after attention and after the MLP too (post_attn_norm, post_mlp_norm), before each residual add;
  - GeGLU with the tanh GELU;
  - attention scores scaled by query_pre_attn_scalar ** -0.5 (query_scale) and, in Gemma 2, soft-capped
    (attn_softcap), the logits soft-capped too (final_softcap);
  - local (sliding-window) and global layers in one stack (local_layers: per-layer data of the spec, so the
    stack stays one scanned (L, ...) stack in every pipeline schedule); each layer runs its own kind's attention;
  - Gemma 3: per-head q/k RMSNorm ((1 + w) too), the local layers' own RoPE base and linear RoPE scaling on the
    global ones (rope_local_theta, rope_linear).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import GLOBAL
from models.config import ModelConfig
from models.gemma_hf import GEMMA2_HF, GEMMA3_HF
from models.layers import rms_norm
from models.spec import LayerCall, ModelSpec, Param, register
from models.transformer import llama_inventory, qkv


def gemma_inventory(c: ModelConfig, qk_norm: bool = False) -> dict:
    inv = llama_inventory(c)
    zeros = lambda p: p._replace(init="zeros")  # noqa: E731  (1 + w): a zero weight is a gain of 1
    D, E = c.d_model, c.head_dim
    layers = {k: zeros(p) if k.endswith("norm") else p for k, p in inv["layers"].items()}
    layers["post_attn_norm"] = Param((D,), ("embed",), "zeros", False)
    layers["post_mlp_norm"] = Param((D,), ("embed",), "zeros", False)
    if qk_norm:
        layers["q_norm"] = Param((E,), ("head_dim",), "zeros", False)
        layers["k_norm"] = Param((E,), ("head_dim",), "zeros", False)
    return {**inv, "layers": layers, "final_norm": zeros(inv["final_norm"])}


def layer_data(c: ModelConfig) -> dict:
    local = c.local_layers if c.local_layers is not None else (c.window is not None,) * c.n_layers
    # float32 (1.0: local): the remat'd halves close over it, and a sub-layer remat's closure must be differentiable
    return {"local": np.asarray(local, np.float32)}


def layer(c: ModelConfig, p: dict, x_BTD, call: LayerCall):
    x_BTD = call.half(functools.partial(attention_half, c, call=call))(p, x_BTD)
    return call.half(functools.partial(mlp_half, c, call=call))(p, x_BTD), {}


def attention_half(c: ModelConfig, p: dict, x_BTD, call: LayerCall):
    kn, constrain = call.kernels, call.constrain
    p = {k: p[k].astype(x_BTD.dtype) for k in ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm",
                                                "post_attn_norm") if k in p}
    local = call.data["local"] > 0.5
    rope = call.rope
    if len(rope) == 4:  # Gemma 3: (global cos, sin, local cos, sin)
        rope = tuple(jnp.where(local, lo, gl) for gl, lo in zip(rope[:2], rope[2:]))
    q_BTHE, k_BTKE, v_BTKE = qkv(c, p, x_BTD, rope, constrain, kernels=kn)
    if c.kv_repeat > 1:
        k_BTKE, v_BTKE = (constrain(jnp.repeat(a, c.kv_repeat, axis=2), ("batch", "seq", "heads", "head_dim"))
                          for a in (k_BTKE, v_BTKE))
    # the layer's window, traced (GLOBAL: every causal key); the kernels run each kind's own (models/attention.py)
    window = jnp.where(local, c.window or GLOBAL, GLOBAL)
    o_BTHE = call.attention(q_BTHE, k_BTKE, v_BTKE, segments=call.segments, window=window,
                            softcap=c.attn_softcap, scale=(c.query_scale or c.head_dim) ** -0.5,
                            windows=(c.window, None) if c.window else (None,))
    B, T, D = x_BTD.shape
    HE = c.n_heads * c.head_dim
    o_BTX = constrain(o_BTHE, ("batch", "seq", "heads", "head_dim")).reshape(B, T, HE)
    (o_BTD,) = kn.project(o_BTX, (p["wo"].reshape(HE, D),))
    if "post_attn_norm" in p:  # Gemma 2 and 3 (Gemma 1 had none)
        o_BTD = rms_norm(o_BTD, p["post_attn_norm"], c.norm_eps, c.norm_plus_one)
    return constrain(x_BTD + o_BTD, ("batch", "seq", "embed"))


def geglu(gate, up):
    """GeGLU with the tanh GELU (transformers' gelu_pytorch_tanh)."""
    return jax.nn.gelu(gate, approximate=True) * up


def mlp_half(c: ModelConfig, p: dict, x_BTD, call: LayerCall):
    kn, constrain = call.kernels, call.constrain
    p = {k: p[k].astype(x_BTD.dtype) for k in ("mlp_norm", "w_gate", "w_up", "w_down", "post_mlp_norm") if k in p}
    h_BTD = rms_norm(x_BTD, p["mlp_norm"], c.norm_eps, c.norm_plus_one)
    gate_BTF, up_BTF = kn.project(h_BTD, (p["w_gate"], p["w_up"]))
    a_BTF = constrain(geglu(gate_BTF, up_BTF), ("batch", "seq", "mlp"))
    (down_BTD,) = kn.project(a_BTF, (p["w_down"],))
    if "post_mlp_norm" in p:
        down_BTD = rms_norm(down_BTD, p["post_mlp_norm"], c.norm_eps, c.norm_plus_one)
    return constrain(x_BTD + down_BTD, ("batch", "seq", "embed"))


# a Gemma trained from scratch (no HF folder) computes as Gemma does; the keys an HF folder may leave null (the
# soft-caps, the window) stay the config's (null: none), as they cannot mean both "unset" and "off"
GEMMA = {"embed_scale": True, "norm_plus_one": True}
KEYS = ("local_layers", "attn_softcap", "final_softcap", "query_scale", "embed_scale", "norm_plus_one")
GEMMA2 = register(ModelSpec("gemma2", gemma_inventory, layer, GEMMA2_HF, layer_data, keys=KEYS, defaults=GEMMA))
GEMMA3 = register(ModelSpec("gemma3", functools.partial(gemma_inventory, qk_norm=True), layer, GEMMA3_HF,
                            layer_data, keys=KEYS + ("rope_local_theta", "rope_linear"),
                            defaults={**GEMMA, "rope_local_theta": 10000.0}))
