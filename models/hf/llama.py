"""The Llama family's Hugging Face adapter: `LlamaForCausalLM`'s config.json <-> ModelConfig keys, and its
tensor names <-> the inventory's parameters, both directions. trainer/ckpt/hf.py reads and writes folders through
a family's adapter and knows no family itself. Errors are ValueErrors naming the config.json field (the trainer
turns them into one-line user errors)."""
from __future__ import annotations

from models.spec import HFAdapter, Leaf

ARCH = "LlamaForCausalLM"
LLAMA_ONLY = ("attention_bias", "mlp_bias", "pretraining_tp")  # config.json fields of Llama's config alone


def check(hc: dict):
    """Raise ValueError for a config.json feature the Llama family does not compute."""
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hc.get(key, want) != want:
            raise ValueError(f"{key}={hc[key]!r} is not supported; meshtrain computes {key}={want!r}")


def rope(hc: dict) -> tuple[float, list | None]:
    """(rope_theta, rope_scaling) from transformers 5's rope_parameters or the older rope_theta/rope_scaling."""
    rp = hc.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", hc.get("rope_theta", 10000.0)))
    sc = hc.get("rope_scaling") or rp
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"rope scaling of type '{kind}' is not supported; meshtrain implements 'llama3'")
    try:
        return theta, [float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"]),
                       float(sc["original_max_position_embeddings"])]
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling lacks {e.args[0]}") from None


def model_keys(hc: dict) -> dict:
    """meshtrain model.* keys (and the config.json key each comes from) of an HF Llama config."""
    try:
        D, H = int(hc["hidden_size"]), int(hc["num_attention_heads"])
        keys = {"d_model": (D, "hidden_size"), "n_layers": (int(hc["num_hidden_layers"]), "num_hidden_layers"),
                "n_heads": (H, "num_attention_heads"),
                "n_kv_heads": (int(hc.get("num_key_value_heads") or H), "num_key_value_heads"),
                "d_ff": (int(hc["intermediate_size"]), "intermediate_size"),
                "vocab_size": (int(hc["vocab_size"]), "vocab_size"),
                "tie_embeddings": (bool(hc.get("tie_word_embeddings", False)), "tie_word_embeddings"),
                "norm_eps": (float(hc.get("rms_norm_eps", 1e-6)), "rms_norm_eps")}
    except KeyError as e:
        raise ValueError(f"lacks {e.args[0]}") from None
    keys["head_dim"] = (int(hc.get("head_dim") or D // H), "head_dim")
    theta, scaling = rope(hc)
    keys["rope_theta"], keys["rope_scaling"] = (theta, "rope_theta"), (scaling, "rope_scaling")
    return keys


def leaves(mc) -> list[Leaf]:
    """Every parameter of a meshtrain Llama and where HF keeps it (q/k need no permutation: both use
    rotate-half RoPE pairs)."""
    D, H, K, E, F, V, L = mc.d_model, mc.n_heads, mc.n_kv_heads, mc.head_dim, mc.d_ff, mc.vocab_size, mc.n_layers
    per_layer = {"attn_norm": ("input_layernorm", (D,), (D,), (0,)),
                 "wq": ("self_attn.q_proj", (H * E, D), (H, E, D), (2, 0, 1)),
                 "wk": ("self_attn.k_proj", (K * E, D), (K, E, D), (2, 0, 1)),
                 "wv": ("self_attn.v_proj", (K * E, D), (K, E, D), (2, 0, 1)),
                 "wo": ("self_attn.o_proj", (D, H * E), (D, H, E), (1, 2, 0)),
                 "mlp_norm": ("post_attention_layernorm", (D,), (D,), (0,)),
                 "w_gate": ("mlp.gate_proj", (F, D), (F, D), (1, 0)),
                 "w_up": ("mlp.up_proj", (F, D), (F, D), (1, 0)),
                 "w_down": ("mlp.down_proj", (D, F), (D, F), (1, 0))}
    out = [Leaf(("embed",), ["model.embed_tokens.weight"], (V, D), (V, D), (0, 1), False)]
    out += [Leaf(("layers", k), [f"model.layers.{i}.{n}.weight" for i in range(L)], s, v, pm, True)
            for k, (n, s, v, pm) in per_layer.items()]
    out.append(Leaf(("final_norm",), ["model.norm.weight"], (D,), (D,), (0,), False))
    if not mc.tie_embeddings:
        out.append(Leaf(("lm_head",), ["lm_head.weight"], (V, D), (V, D), (1, 0), False))
    return out


def hf_config(mc, dtype: str) -> dict:
    """config.json for transformers' LlamaForCausalLM (rope keys in both forms: 5.x's rope_parameters, 4.x's
    rope_theta/rope_scaling)."""
    scaling = None
    if mc.rope_scaling is not None:
        f, lo, hi, n = mc.rope_scaling
        scaling = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
                   "original_max_position_embeddings": int(n)}
    return {"architectures": [ARCH], "model_type": "llama", "hidden_size": mc.d_model,
            "intermediate_size": mc.d_ff, "num_hidden_layers": mc.n_layers, "num_attention_heads": mc.n_heads,
            "num_key_value_heads": mc.n_kv_heads, "head_dim": mc.head_dim, "vocab_size": mc.vocab_size,
            "max_position_embeddings": mc.seq_len, "rms_norm_eps": mc.norm_eps, "rope_theta": mc.rope_theta,
            "rope_scaling": scaling,
            "rope_parameters": {"rope_type": "default", "rope_theta": mc.rope_theta, **(scaling or {})},
            "tie_word_embeddings": mc.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
            "initializer_range": mc.init_std, "use_cache": True, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "torch_dtype": dtype, "dtype": dtype}


def heads_expressible(mc):
    """Raise ValueError when the heads do not group (HF's attention repeats each kv head n_heads / n_kv_heads
    times)."""
    if mc.n_heads % mc.n_kv_heads:
        raise ValueError(f"n_heads={mc.n_heads} is not a multiple of n_kv_heads={mc.n_kv_heads}, which a "
                         "Hugging Face model cannot express")


def expressible(mc):
    """Raise ValueError when HF's Llama cannot hold this model."""
    heads_expressible(mc)
    if mc.window:
        raise ValueError(f"window={mc.window}: a sliding window, which a LlamaForCausalLM cannot express")


LLAMA_HF = HFAdapter(ARCH, check, model_keys, leaves, hf_config, expressible)
