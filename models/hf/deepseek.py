"""The DeepSeek-V3 family's Hugging Face adapters (`DeepseekV3ForCausalLM`; Kimi-K2's folders name the same
architecture with model_type `kimi_k2`; GLM-4.7-Flash's `Glm4MoeLiteForCausalLM`, the same attention, router and
tensor names with its dense layers named by `mlp_layer_types`): config.json <-> the family's keys (models/families/deepseek.py), and the
tensors: latent attention's projections, the first layers' dense MLPs (`first_layers`), the MoE layers' router, its
`e_score_correction_bias`, one tensor per expert stacked into (layers, experts, ...) and the shared experts. A
folder's multi-token-prediction layer, `model.layers.{num_hidden_layers}.*`, is left out (one log line,
trainer/ckpt/hf.py). Block-FP8 weights are dequantized as they are read (trainer/ckpt/quantized.py)."""
from __future__ import annotations

from models.hf import llama as llama_hf
from models.spec import HFAdapter, Leaf

ARCH = "DeepseekV3ForCausalLM"
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
EXPERTS = {"expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj"}
DENSE = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
SHARED = {"shared_gate": "gate_proj", "shared_up": "up_proj", "shared_down": "down_proj"}


def check(hc: dict):
    """Refuse what the family does not compute: another scoring function or choice method, biases on the
    projections, another activation."""
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("scoring_func", "sigmoid"),
                      ("topk_method", "noaux_tc")):
        if hc.get(key, want) != want:
            raise ValueError(f"{key}={hc[key]!r} is not supported; meshtrain's deepseek_v3 computes {key}={want!r}")
    if hc.get("model_type", MODEL_TYPES[0]) not in MODEL_TYPES + ("glm4_moe_lite",):
        raise ValueError(f"model_type={hc['model_type']!r} is not one meshtrain reads as {ARCH} "
                         f"({', '.join(MODEL_TYPES)})")
    if int(hc.get("n_routed_experts") or 0) < 2:
        raise ValueError(f"n_routed_experts={hc.get('n_routed_experts')}: meshtrain's deepseek_v3 has at least 2 "
                         "routed experts")


def rope_keys(hc: dict) -> dict:
    """RoPE's base and YaRN's keys from rope_parameters (transformers 5) or rope_theta + rope_scaling (the Hub's)."""
    rp = hc.get("rope_parameters") or {}
    sc = hc.get("rope_scaling") or rp
    keys = {"rope_theta": (float(rp.get("rope_theta", hc.get("rope_theta", 10000.0))), "rope_theta")}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return keys
    if kind != "yarn":
        raise ValueError(f"rope scaling of type '{kind}' is not supported; meshtrain's deepseek_v3 implements 'yarn'")
    try:
        keys.update(yarn_factor=(float(sc["factor"]), "rope_scaling.factor"),
                    yarn_original=(int(sc["original_max_position_embeddings"]),
                                   "rope_scaling.original_max_position_embeddings"))
    except KeyError as e:
        raise ValueError(f"yarn rope scaling lacks {e.args[0]}") from None
    for k, field, default in (("yarn_beta_fast", "beta_fast", 32.0), ("yarn_beta_slow", "beta_slow", 1.0),
                              ("yarn_mscale", "mscale", 1.0), ("yarn_mscale_all_dim", "mscale_all_dim", 0.0)):
        keys[k] = (float(sc.get(field) or default), f"rope_scaling.{field}")
    keys["yarn_truncate"] = (bool(sc.get("truncate", True)), "rope_scaling.truncate")
    return keys


def model_keys(hc: dict) -> dict:
    base = {k: v for k, v in llama_hf.model_keys({**hc, "rope_scaling": None, "rope_parameters": None}).items()
            if k not in ("rope_theta", "rope_scaling", "head_dim")}
    try:
        q = hc.get("q_lora_rank")
        keys = {"n_experts": (int(hc["n_routed_experts"]), "n_routed_experts"),
                "n_experts_per_token": (int(hc["num_experts_per_tok"]), "num_experts_per_tok"),
                "expert_d_ff": (int(hc["moe_intermediate_size"]), "moe_intermediate_size"),
                "shared_experts": (int(hc.get("n_shared_experts") or 0), "n_shared_experts"),
                "first_dense": (int(hc.get("first_k_dense_replace") or 0), "first_k_dense_replace"),
                "n_groups": (int(hc.get("n_group") or 1), "n_group"),
                "groups_kept": (int(hc.get("topk_group") or 1), "topk_group"),
                "routed_scale": (float(hc.get("routed_scaling_factor", 1.0)), "routed_scaling_factor"),
                "norm_topk_prob": (bool(hc.get("norm_topk_prob", True)), "norm_topk_prob"),
                "q_rank": (int(q) if q else None, "q_lora_rank"),
                "kv_rank": (int(hc["kv_lora_rank"]), "kv_lora_rank"),
                "nope_dim": (int(hc["qk_nope_head_dim"]), "qk_nope_head_dim"),
                "rope_dim": (int(hc["qk_rope_head_dim"]), "qk_rope_head_dim"),
                "v_dim": (int(hc["v_head_dim"]), "v_head_dim"),
                "rope_interleave": (bool(hc.get("rope_interleave", True)), "rope_interleave")}
    except KeyError as e:
        raise ValueError(f"lacks {e.args[0]}") from None
    return {**base, **keys, **rope_keys(hc)}


def _attention(mc, i: int) -> dict:
    """One layer's attention tensors: {meshtrain name: (HF name, HF shape, view, perm)}."""
    D, H, E, Ev, Rkv, Er = mc.d_model, mc.n_heads, mc.head_dim, mc.v_dim, mc.kv_rank, mc.rope_dim
    a = f"model.layers.{i}.self_attn."
    out = {"attn_norm": (f"model.layers.{i}.input_layernorm.weight", (D,), (D,), (0,))}
    if mc.q_rank:
        R = mc.q_rank
        out.update(wq_a=(a + "q_a_proj.weight", (R, D), (R, D), (1, 0)),
                   q_norm=(a + "q_a_layernorm.weight", (R,), (R,), (0,)),
                   wq_b=(a + "q_b_proj.weight", (H * E, R), (H, E, R), (2, 0, 1)))
    else:
        out["wq"] = (a + "q_proj.weight", (H * E, D), (H, E, D), (2, 0, 1))
    En = mc.nope_dim
    out.update(wkv_a=(a + "kv_a_proj_with_mqa.weight", (Rkv + Er, D), (Rkv + Er, D), (1, 0)),
               kv_norm=(a + "kv_a_layernorm.weight", (Rkv,), (Rkv,), (0,)),
               wkv_b=(a + "kv_b_proj.weight", (H * (En + Ev), Rkv), (H, En + Ev, Rkv), (2, 0, 1)),
               wo=(a + "o_proj.weight", (D, H * Ev), (D, H, Ev), (1, 2, 0)),
               mlp_norm=(f"model.layers.{i}.post_attention_layernorm.weight", (D,), (D,), (0,)))
    return out


def _stack(stack: str, rows: range, per_layer) -> list[Leaf]:
    """Leaves of one stack: per_layer(i) -> {name: (HF name, shape, view, perm)} for each layer i of `rows`."""
    tables = [per_layer(i) for i in rows]
    return [Leaf((stack, k), [t[k][0] for t in tables], s, v, pm, True) for k, (_, s, v, pm) in tables[0].items()]


def leaves(mc) -> list[Leaf]:
    D, V, L, k, X = mc.d_model, mc.vocab_size, mc.n_layers, mc.first_dense, mc.n_experts
    F, Fd, S = mc.expert_d_ff or mc.d_ff, mc.d_ff, mc.shared_experts * (mc.expert_d_ff or mc.d_ff)

    def mlp(names: dict, width: int, i: int, part: str) -> dict:
        shapes = {m: (D, width) if m.endswith("down") else (width, D) for m in names}
        return {m: (f"model.layers.{i}.{part}.{n}.weight", shapes[m], shapes[m], (1, 0)) for m, n in names.items()}

    def dense(i):
        return {**_attention(mc, i), **mlp(DENSE, Fd, i, "mlp")}

    def moe(i):
        out = {**_attention(mc, i), "router": (f"model.layers.{i}.mlp.gate.weight", (X, D), (X, D), (1, 0)),
               "router_bias": (f"model.layers.{i}.mlp.gate.e_score_correction_bias", (X,), (X,), (0,))}
        return {**out, **(mlp(SHARED, S, i, "mlp.shared_experts") if S else {})}

    def module(i):  # a multi-token-prediction module: an MoE layer and its own weights (DeepSeek's release names)
        own = {"enorm": ("enorm", (D,), (D,), (0,)), "hnorm": ("hnorm", (D,), (D,), (0,)),
               "eh_proj": ("eh_proj", (D, 2 * D), (D, 2 * D), (1, 0)),
               "post_norm": ("shared_head.norm", (D,), (D,), (0,))}
        return {**moe(i), **{m: (f"model.layers.{i}.{n}.weight", *rest) for m, (n, *rest) in own.items()}}

    out = [Leaf(("embed",), ["model.embed_tokens.weight"], (V, D), (V, D), (0, 1), False)]
    out += _stack("first_layers", range(k), dense) if k else []
    stacks = [("layers", range(k, L), moe)] + ([("mtp", range(L, L + mc.mtp_depth), module)] if mc.mtp_depth else [])
    for stack, rows, table in stacks:
        out += _stack(stack, rows, table)
        for m, n in EXPERTS.items():
            shape = (D, F) if m == "expert_down" else (F, D)
            out.append(Leaf((stack, m), [f"model.layers.{i}.mlp.experts.{e}.{n}.weight" for i in rows
                                         for e in range(X)], shape, shape, (1, 0), True, (len(rows), X)))
    for i in range(L, L + mc.mtp_depth):  # the release's copies of the embedding and the head in each module
        out.append(Leaf(("embed",), [f"model.layers.{i}.embed_tokens.weight"], (V, D), (V, D), (0, 1), False,
                        copy=True))
        if not mc.tie_embeddings:
            out.append(Leaf(("lm_head",), [f"model.layers.{i}.shared_head.head.weight"], (V, D), (V, D), (1, 0),
                            False, copy=True))
    out.append(Leaf(("final_norm",), ["model.norm.weight"], (D,), (D,), (0,), False))
    if not mc.tie_embeddings:
        out.append(Leaf(("lm_head",), ["lm_head.weight"], (V, D), (V, D), (1, 0), False))
    return out


def hf_config(mc, dtype: str) -> dict:
    rope = {"rope_type": "default", "rope_theta": mc.rope_theta}
    if mc.yarn_factor:
        rope.update(rope_type="yarn", factor=mc.yarn_factor, original_max_position_embeddings=mc.yarn_original,
                    beta_fast=mc.yarn_beta_fast, beta_slow=mc.yarn_beta_slow, mscale=mc.yarn_mscale,
                    mscale_all_dim=mc.yarn_mscale_all_dim, truncate=mc.yarn_truncate)
    return {"architectures": [ARCH], "model_type": "deepseek_v3", "hidden_size": mc.d_model, "vocab_size": mc.vocab_size,
            "intermediate_size": mc.d_ff, "moe_intermediate_size": mc.expert_d_ff or mc.d_ff,
            "num_hidden_layers": mc.n_layers, "num_attention_heads": mc.n_heads, "num_key_value_heads": mc.n_heads,
            "n_shared_experts": mc.shared_experts, "n_routed_experts": mc.n_experts,
            "routed_scaling_factor": mc.routed_scale, "kv_lora_rank": mc.kv_rank, "q_lora_rank": mc.q_rank,
            "qk_rope_head_dim": mc.rope_dim, "qk_nope_head_dim": mc.nope_dim, "v_head_dim": mc.v_dim,
            "head_dim": mc.rope_dim, "n_group": mc.n_groups, "topk_group": mc.groups_kept,
            "num_experts_per_tok": mc.n_experts_per_token, "first_k_dense_replace": mc.first_dense,
            "norm_topk_prob": mc.norm_topk_prob, "rope_interleave": mc.rope_interleave, "hidden_act": "silu",
            "num_nextn_predict_layers": mc.mtp_depth,
            "max_position_embeddings": mc.seq_len, "rms_norm_eps": mc.norm_eps, "rope_theta": mc.rope_theta,
            "rope_scaling": rope if mc.yarn_factor else None, "rope_parameters": rope,
            "tie_word_embeddings": mc.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
            "initializer_range": mc.init_std, "use_cache": True, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "torch_dtype": dtype, "dtype": dtype}


def expressible(mc):
    if mc.window:
        raise ValueError(f"window={mc.window}: a sliding window, which a {ARCH} cannot express")
    if mc.capacity_factor > 0:
        raise ValueError(f"capacity_factor={mc.capacity_factor}: a capacity, which a {ARCH} (dropless) cannot express")


def skipped(mc) -> tuple:
    """(tensor name prefixes a folder may hold that the model leaves out, why): the multi-token-prediction layer."""
    first = mc.n_layers + mc.mtp_depth  # the modules model.mtp_depth asks for are read; the rest left out
    return tuple(f"model.layers.{i}." for i in range(first, first + 16)), "its multi-token-prediction layers"


DEEPSEEK_V3_HF = HFAdapter(ARCH, check, model_keys, leaves, hf_config, expressible, skipped=skipped)


GLM_ARCH = "Glm4MoeLiteForCausalLM"


def glm_first_dense(hc: dict) -> int:
    """GLM-4.7-Flash's dense layers: the leading "dense" entries of mlp_layer_types, every later one "sparse"
    (transformers' default: the first layer dense)."""
    types = hc.get("mlp_layer_types") or ["dense"] + ["sparse"] * (int(hc.get("num_hidden_layers", 1)) - 1)
    k = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    if any(t != "sparse" for t in types[k:]):
        raise ValueError(f"mlp_layer_types={types} has a dense layer after a sparse one; meshtrain's deepseek_v3 "
                         "stack is its dense layers first, then its MoE layers")
    return k


def glm_keys(hc: dict) -> dict:
    return {**model_keys({**hc, "first_k_dense_replace": None}),
            "first_dense": (glm_first_dense(hc), "mlp_layer_types")}


def glm_config(mc, dtype: str) -> dict:
    out = {k: v for k, v in hf_config(mc, dtype).items() if k != "first_k_dense_replace"}
    return {**out, "architectures": [GLM_ARCH], "model_type": "glm4_moe_lite",
            "mlp_layer_types": ["dense"] * mc.first_dense + ["sparse"] * (mc.n_layers - mc.first_dense)}


GLM4_MOE_LITE_HF = HFAdapter(GLM_ARCH, check, glm_keys, leaves, glm_config, expressible, skipped=skipped)
