"""gpt-oss's Hugging Face adapter (`GptOssForCausalLM`), both directions: config.json <-> the family's keys
(models/families/gpt_oss.py), and the tensors as transformers 5 saves them: Llama's attention and norms with the
projections' biases and `self_attn.sinks`, the router's weight and bias, and each layer's experts packed, one tensor
per layer: `mlp.experts.gate_up_proj` (X, D, 2F) with gate and up interleaved (gate at the even columns) read as
(X, D, 2, F), its bias (X, 2F) as (X, 2, F), `down_proj` (X, F, D) and its bias (X, D). The release's MXFP4 form
(`*_blocks`, `*_scales` in place of gate_up_proj and down_proj) is dequantized as it is read (trainer/ckpt/mxfp4.py);
export writes float weights, no quantization_config."""
from __future__ import annotations

from models.hf import llama as llama_hf
from models.hf.deepseek import rope_keys
from models.spec import HFAdapter, Leaf

ARCH = "GptOssForCausalLM"
# the release's MXFP4 tensors: the packed weight each stands for (transformers' layout after dequantizing)
MXFP4 = ("gate_up_proj", "down_proj")


def check(hc: dict):
    if hc.get("attention_bias", True) is not True:
        raise ValueError(f"attention_bias={hc['attention_bias']!r} is not supported; meshtrain's gpt_oss has biases "
                         "on q, k, v and o (attention_bias=true)")
    if int(hc.get("num_local_experts") or 0) < 2:
        raise ValueError(f"num_local_experts={hc.get('num_local_experts')}: meshtrain's gpt_oss has at least 2 "
                         "experts")
    types = set(hc.get("layer_types") or ())
    if types - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types holds {sorted(types - {'sliding_attention', 'full_attention'})}; meshtrain's "
                         "gpt_oss has sliding_attention and full_attention layers")
    q = hc.get("quantization_config") or {}
    if q and q.get("quant_method") != "mxfp4":
        raise ValueError(f"quantization_config.quant_method={q.get('quant_method')!r} is not supported; meshtrain "
                         "reads gpt-oss's float and mxfp4 weights")


def layer_types(hc: dict) -> list:
    """HF's per-layer kinds, its default where absent (sliding first, alternating)."""
    L = int(hc["num_hidden_layers"])
    return hc.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]


def model_keys(hc: dict) -> dict:
    base = {k: v for k, v in llama_hf.model_keys({**hc, "rope_scaling": None, "rope_parameters": None}).items()
            if k not in ("rope_theta", "rope_scaling")}
    try:
        keys = {"n_experts": (int(hc["num_local_experts"]), "num_local_experts"),
                "n_experts_per_token": (int(hc["num_experts_per_tok"]), "num_experts_per_tok"),
                "router": ("topk_softmax", "architectures"),
                "swiglu_limit": (float(hc.get("swiglu_limit", 7.0)), "swiglu_limit"),
                "swiglu_alpha": (float(hc.get("swiglu_alpha", 1.702)), "swiglu_alpha"),
                "local_layers": ([t == "sliding_attention" for t in layer_types(hc)], "layer_types"),
                "window": (int(hc["sliding_window"]) if hc.get("sliding_window") else None, "sliding_window")}
    except KeyError as e:
        raise ValueError(f"lacks {e.args[0]}") from None
    if hc.get("output_router_logits"):  # the balancing loss on, at the folder's weight; off: model.router_aux_loss's
        keys["router_aux_loss"] = (float(hc.get("router_aux_loss_coef", 0.001)), "router_aux_loss_coef")
    rp = hc.get("rope_parameters") or {}
    theta = {"rope_theta": rp.get("rope_theta", hc.get("rope_theta", 150000.0))}
    return {**base, **keys, **rope_keys({**hc, **theta, "rope_parameters": {**rp, **theta}})}


def leaves(mc) -> list[Leaf]:
    D, H, K, E, X, L = mc.d_model, mc.n_heads, mc.n_kv_heads, mc.head_dim, mc.n_experts, mc.n_layers
    F = mc.expert_d_ff or mc.d_ff

    def per_layer(n):
        return [f"model.layers.{i}.{n}" for i in range(L)]
    out = [lf for lf in llama_hf.leaves(mc) if ".mlp." not in lf.names[0]]
    for k, (n, s, v, pm) in {"bq": ("self_attn.q_proj.bias", (H * E,), (H, E), (0, 1)),
                             "bk": ("self_attn.k_proj.bias", (K * E,), (K, E), (0, 1)),
                             "bv": ("self_attn.v_proj.bias", (K * E,), (K, E), (0, 1)),
                             "bo": ("self_attn.o_proj.bias", (D,), (D,), (0,)),
                             "sinks": ("self_attn.sinks", (H,), (H,), (0,)),
                             "router": ("mlp.router.weight", (X, D), (X, D), (1, 0)),
                             "b_router": ("mlp.router.bias", (X,), (X,), (0,)),
                             "expert_gate_up": ("mlp.experts.gate_up_proj", (X, D, 2 * F), (X, D, F, 2),
                                                (0, 1, 3, 2)),
                             "b_gate_up": ("mlp.experts.gate_up_proj_bias", (X, 2 * F), (X, F, 2), (0, 2, 1)),
                             "expert_down": ("mlp.experts.down_proj", (X, F, D), (X, F, D), (0, 1, 2)),
                             "b_down": ("mlp.experts.down_proj_bias", (X, D), (X, D), (0, 1))}.items():
        out.append(Leaf(("layers", k), per_layer(n), s, v, pm, True))
    return out


def hf_config(mc, dtype: str) -> dict:
    base = {k: v for k, v in llama_hf.hf_config(mc, dtype).items() if k not in llama_hf.LLAMA_ONLY + ("hidden_act",)}
    rope = {"rope_type": "default", "rope_theta": mc.rope_theta}
    if mc.yarn_factor:
        rope.update(rope_type="yarn", factor=mc.yarn_factor, original_max_position_embeddings=mc.yarn_original,
                    beta_fast=mc.yarn_beta_fast, beta_slow=mc.yarn_beta_slow, truncate=mc.yarn_truncate)
    local = mc.local_layers if mc.local_layers is not None else (mc.window is not None,) * mc.n_layers
    return {**base, "architectures": [ARCH], "model_type": "gpt_oss", "intermediate_size": mc.expert_d_ff or mc.d_ff,
            "num_local_experts": mc.n_experts, "num_experts_per_tok": mc.n_experts_per_token,
            "swiglu_limit": mc.swiglu_limit, "swiglu_alpha": mc.swiglu_alpha,
            "router_aux_loss_coef": mc.router_aux_loss or 0.001, "output_router_logits": mc.router_aux_loss > 0,
            "sliding_window": mc.window,
            "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
            "attention_bias": True, "rope_scaling": rope if mc.yarn_factor else None, "rope_parameters": rope}


def expressible(mc):
    llama_hf.heads_expressible(mc)
    if mc.capacity_factor > 0:
        raise ValueError(f"capacity_factor={mc.capacity_factor}: a capacity, which a {ARCH} (dropless) cannot express")
    if mc.router_z_loss > 0:
        raise ValueError(f"router_z_loss={mc.router_z_loss}: a z-loss, which a {ARCH} cannot express")
    if mc.yarn_factor and (mc.yarn_mscale != 1.0 or mc.yarn_mscale_all_dim):
        raise ValueError("yarn_mscale / yarn_mscale_all_dim set: DeepSeek's YaRN corrections, which a "
                         f"{ARCH} cannot express")


GPT_OSS_HF = HFAdapter(ARCH, check, model_keys, leaves, hf_config, expressible)
