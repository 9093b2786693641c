"""Hugging Face adapters of the Qwen families (`Qwen2ForCausalLM`, `Qwen3ForCausalLM`): Llama's tensor names and
config fields (models/hf/llama.py) plus each family's own, both directions. A config feature the families do
not compute (a sliding window, biases on Qwen3's projections) is a ValueError naming the field."""
from __future__ import annotations

from models.hf import llama as llama_hf
from models.spec import HFAdapter, Leaf


def _no_window(hc: dict):
    if hc.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported (meshtrain's Qwen attends to the whole context); "
                         "use a config with use_sliding_window=false")
    kinds = set(hc.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"layer_types={sorted(kinds)} is not supported; meshtrain's Qwen has full_attention layers")


def check(hc: dict):
    llama_hf.check(hc)  # silu; no attention bias flag (Qwen3's) or MLP biases
    _no_window(hc)


def _per_layer(mc, mine: dict) -> list[Leaf]:
    return [Leaf(("layers", k), [f"model.layers.{i}.{n}" for i in range(mc.n_layers)], s, v, pm, True)
            for k, (n, s, v, pm) in mine.items()]


def qwen2_leaves(mc) -> list[Leaf]:
    H, K, E = mc.n_heads, mc.n_kv_heads, mc.head_dim
    return llama_hf.leaves(mc) + _per_layer(mc, {
        "bq": ("self_attn.q_proj.bias", (H * E,), (H, E), (0, 1)),
        "bk": ("self_attn.k_proj.bias", (K * E,), (K, E), (0, 1)),
        "bv": ("self_attn.v_proj.bias", (K * E,), (K, E), (0, 1))})


def qwen3_leaves(mc) -> list[Leaf]:
    E = mc.head_dim
    return llama_hf.leaves(mc) + _per_layer(mc, {"q_norm": ("self_attn.q_norm.weight", (E,), (E,), (0,)),
                                                 "k_norm": ("self_attn.k_norm.weight", (E,), (E,), (0,))})


def _config(arch: str, model_type: str, drop: tuple):
    def config(mc, dtype: str) -> dict:
        base = {k: v for k, v in llama_hf.hf_config(mc, dtype).items() if k not in drop}
        return {**base, "architectures": [arch], "model_type": model_type, "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": mc.n_layers,
                "layer_types": ["full_attention"] * mc.n_layers}
    return config


QWEN2_HF = HFAdapter("Qwen2ForCausalLM", check, llama_hf.model_keys, qwen2_leaves,
                     _config("Qwen2ForCausalLM", "qwen2", llama_hf.LLAMA_ONLY), llama_hf.expressible)
QWEN3_HF = HFAdapter("Qwen3ForCausalLM", check, llama_hf.model_keys, qwen3_leaves,
                     _config("Qwen3ForCausalLM", "qwen3", ("mlp_bias", "pretraining_tp")), llama_hf.expressible)
