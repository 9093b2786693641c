"""The Gemma 2 and Gemma 3 families (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`) and their own config keys
(Gemma2Config, Gemma3Config): Llama's projections with

  - embeddings x sqrt(d_model) and every RMSNorm gain applied as (1 + w) (embed_scale, norm_plus_one: kept in the
    computation, the weights stored as transformers stores them; the shared embedding and head read them as the
    family's Ends);
  - a norm after attention and after the MLP too (post_attn_norm, post_mlp_norm), before each residual add;
  - GeGLU with the tanh GELU;
  - attention scores scaled by query_pre_attn_scalar ** -0.5 (query_scale) and, in Gemma 2, soft-capped
    (attn_softcap), the logits soft-capped too (final_softcap);
  - local (sliding-window) and global layers in one stack (local_layers: per-layer data of the spec, so the
    stack stays one scanned (L, ...) stack in every pipeline schedule); each layer runs its own kind's attention;
  - Gemma 3: per-head q/k RMSNorm ((1 + w) too), the local layers' own RoPE base and linear RoPE scaling on the
    global ones (rope_local_theta, rope_linear: the family's RoPE tables, ModelSpec.rope).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.kernels.attention import GLOBAL
from models.config import POSITIVE, ModelConfig, key
from models.hf.gemma import GEMMA2_HF, GEMMA3_HF
from models.layers import rms_norm, rope_tables
from models.spec import Ends, LayerCall, ModelSpec, Param, register
from models.families.llama import llama_inventory
from models.transformer import layer, qkv, repeat_kv


# A Gemma trained from scratch computes as Gemma does (sqrt(d) embeddings, (1 + w) norms); the keys an HF folder may
# leave null (the soft-caps, the window) stay the config's (null: none), as they cannot mean both "unset" and "off"
@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalLayers:
    """The key of a stack whose layers are local (sliding-window) or global by layer, declared once for the family
    configs that take it (Gemma 2's and 3's, gpt-oss's, each with ModelConfig); its layer_data and windows below."""
    # True where a layer is local (attends through `window`), False where global; None: every layer alike (`window`,
    # if set, for all of them)
    local_layers: tuple[bool, ...] | None = key(None, None, "Gemma, gpt-oss: per layer, true local (model.window) "
                                                "or false global (HF's layer_types); null: every layer alike")


def as_tuple(c: LocalLayers):
    """local_layers as a tuple of bools however given (a list from YAML); a config's __post_init__ calls it."""
    if c.local_layers is not None:
        object.__setattr__(c, "local_layers", tuple(bool(x) for x in c.local_layers))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma2Config(ModelConfig, LocalLayers):
    """Gemma 2's model (and Gemma 3's): the shared keys and these."""
    attn_softcap: float | None = key(None, POSITIVE, "Gemma: attention scores soft-capped at this; null: none")
    final_softcap: float | None = key(None, POSITIVE, "Gemma: output logits soft-capped at this; null: none")
    # query_pre_attn_scalar: scores scaled by query_scale ** -0.5 instead of head_dim ** -0.5
    query_scale: float | None = key(None, POSITIVE, "Gemma: scores scaled by query_scale ** -0.5; null: head_dim")
    embed_scale: bool = key(True, None, "Gemma: embeddings x sqrt(d_model); null: the family's")
    norm_plus_one: bool = key(True, None, "Gemma: RMSNorm gains applied as 1 + w; null: the family's")

    def __post_init__(self):
        super().__post_init__()
        as_tuple(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config(Gemma2Config):
    """Gemma 3's model: Gemma 2's keys and its RoPE per layer kind."""
    rope_local_theta: float | None = key(10000.0, POSITIVE, "Gemma 3: the local layers' RoPE base; null: rope_theta")
    # positions / factor on the global layers
    rope_linear: float | None = key(None, POSITIVE, "Gemma 3: the global layers' linear RoPE factor; null: none")


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


def layer_data(c: Gemma2Config) -> dict:
    local = c.local_layers if c.local_layers is not None else (c.window is not None,) * c.n_layers
    # float32 (1.0: local): the remat'd halves close over it, and a sub-layer remat's closure must be differentiable
    return {"local": np.asarray(local, np.float32)}


def attention_half(c: Gemma2Config, p: dict, x_BTD, call: LayerCall):
    kn, constrain = call.kernels, call.constrain
    p = {k: p[k].astype(x_BTD.dtype) for k in ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm",
                                                "post_attn_norm") if k in p}
    local = call.data["local"] > 0.5
    rope = call.rope
    if len(rope) == 4:  # Gemma 3: (global cos, sin, local cos, sin)
        rope = tuple(jnp.where(local, lo, gl) for gl, lo in zip(rope[:2], rope[2:]))
    q_BTHE, k_BTKE, v_BTKE = repeat_kv(call, *qkv(c, p, x_BTD, rope, constrain, kernels=kn,
                                                  plus_one=c.norm_plus_one))
    # the layer's window, traced (GLOBAL: every causal key); the kernels run each kind's own (models/kernels/attention.py)
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
    return constrain(x_BTD + o_BTD, ("batch", "res_seq", "embed"))


def geglu(gate, up):
    """GeGLU with the tanh GELU (transformers' gelu_pytorch_tanh)."""
    return jax.nn.gelu(gate, approximate=True) * up


def mlp_half(c: Gemma2Config, p: dict, x_BTD, call: LayerCall):
    kn, constrain = call.kernels, call.constrain
    p = {k: p[k].astype(x_BTD.dtype) for k in ("mlp_norm", "w_gate", "w_up", "w_down", "post_mlp_norm") if k in p}
    h_BTD = rms_norm(x_BTD, p["mlp_norm"], c.norm_eps, c.norm_plus_one)
    gate_BTF, up_BTF = kn.project(h_BTD, (p["w_gate"], p["w_up"]))
    a_BTF = constrain(geglu(gate_BTF, up_BTF), ("batch", "seq", "mlp"))
    (down_BTD,) = kn.project(a_BTF, (p["w_down"],))
    if "post_mlp_norm" in p:
        down_BTD = rms_norm(down_BTD, p["post_mlp_norm"], c.norm_eps, c.norm_plus_one)
    return constrain(x_BTD + down_BTD, ("batch", "res_seq", "embed")), {}


def windows(c: Gemma2Config):
    """Each layer's window (None: global) for a stack of both kinds; None where every layer is alike."""
    return None if c.local_layers is None else tuple(c.window if local else None for local in c.local_layers)


def rope(c: Gemma3Config, T: int, positions_BT=None) -> tuple:
    """Gemma 3's RoPE tables: (cos, sin) of the global layers (their positions divided by rope_linear), then, where
    the local layers have their own base, (cos, sin) of theirs."""
    glob = rope_tables(T, c.head_dim, c.rope_theta, c.rope_scaling, positions_BT, c.rope_linear)
    if c.rope_local_theta is None:
        return glob
    return glob + rope_tables(T, c.head_dim, c.rope_local_theta, None, positions_BT)


def ends(c: Gemma2Config) -> Ends:
    return Ends(c.embed_scale, c.norm_plus_one, c.final_softcap)


def checks(c: Gemma2Config) -> list:
    n = len(c.local_layers or ())
    return [(c.local_layers is None or n == c.n_layers, f"model.local_layers has {n} entries but "
             f"model.n_layers={c.n_layers}; give one true (local) or false (global) per layer")]


# models/transformer.py's layer runs Gemma's two halves
SPEC = dict(layer_data=layer_data, windows=windows, ends=ends, checks=checks, attention=attention_half, mlp=mlp_half)
GEMMA2 = register(ModelSpec("gemma2", gemma_inventory, layer, GEMMA2_HF, config=Gemma2Config, **SPEC))
GEMMA3 = register(ModelSpec("gemma3", functools.partial(gemma_inventory, qk_norm=True), layer, GEMMA3_HF,
                            config=Gemma3Config, rope=rope, **SPEC))
