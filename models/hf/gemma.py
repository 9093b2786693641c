"""Hugging Face adapters of the Gemma families (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`), both directions.
Llama's tensor names, but Gemma's four norms a layer (input_layernorm, post_attention_layernorm,
pre_feedforward_layernorm, post_feedforward_layernorm) and Gemma 3's q/k norms; config.json's layer_types,
soft-caps, query_pre_attn_scalar and RoPE parameters (transformers 5's nested `rope_parameters` per layer type,
or the older `rope_theta`, `rope_local_base_freq`, `rope_scaling`, `sliding_window_pattern`). A feature the
families do not compute is a ValueError naming the field."""
from __future__ import annotations

from models.hf import llama as llama_hf
from models.spec import HFAdapter, HFWrapper, Leaf

KINDS = {"sliding_attention": True, "full_attention": False}


def check(hc: dict):
    act = hc.get("hidden_activation") or hc.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={act!r} is not supported; meshtrain's Gemma computes "
                         "'gelu_pytorch_tanh'")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if hc.get(key):
            raise ValueError(f"{key}=true is not supported; meshtrain's Gemma computes {key}=false")
    kinds = set(hc.get("layer_types") or []) - set(KINDS)
    if kinds:
        raise ValueError(f"layer_types holds {sorted(kinds)}; meshtrain's Gemma has {' and '.join(KINDS)} layers")


def _rope(rp: dict, where: str) -> tuple[float, float | None]:
    """(theta, linear factor or None) of one layer type's RoPE parameters."""
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"{where} rope_type '{kind}' is not supported; meshtrain's Gemma implements 'default' "
                         "and 'linear'")
    return float(rp.get("rope_theta", 10000.0)), (float(rp["factor"]) if kind == "linear" else None)


def _layer_types(hc: dict, pattern_default: int) -> list[str]:
    if hc.get("layer_types"):
        return list(hc["layer_types"])
    pattern = int(hc.get("sliding_window_pattern") or pattern_default)  # the older Hub form
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(int(hc["num_hidden_layers"]))]


def model_keys(hc: dict, gemma3: bool = False) -> dict:
    base = {k: v for k, v in hc.items() if k not in ("rope_parameters", "rope_scaling")}
    keys = llama_hf.model_keys({**base, "tie_word_embeddings": hc.get("tie_word_embeddings", True)})
    rp = hc.get("rope_parameters") or {}
    if gemma3:
        if "full_attention" in rp:  # transformers 5.x: one set per layer type
            glob, loc = rp["full_attention"], rp.get("sliding_attention") or {}
        else:  # the older form
            glob = {"rope_theta": hc.get("rope_theta", 1e6), **(hc.get("rope_scaling") or {})}
            loc = {"rope_theta": hc.get("rope_local_base_freq", 10000.0)}
        theta, linear = _rope({"rope_theta": 1e6, **glob}, "rope_parameters.full_attention")
        local_theta, local_linear = _rope({"rope_theta": 10000.0, **loc}, "rope_parameters.sliding_attention")
        if local_linear is not None:
            raise ValueError("rope_parameters.sliding_attention rope_type 'linear' is not supported; meshtrain's "
                             "Gemma 3 scales the global layers' RoPE only")
    else:
        theta, linear = _rope({"rope_theta": hc.get("rope_theta", 10000.0), **rp, **(hc.get("rope_scaling") or {})},
                              "rope_parameters")
        local_theta = None
    types = _layer_types(hc, 6 if gemma3 else 2)
    if len(types) != keys["n_layers"][0]:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={keys['n_layers'][0]}")
    window = hc.get("sliding_window")
    if any(KINDS[t] for t in types) and not window:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is null; set sliding_window")
    cap = lambda k: None if hc.get(k) is None else float(hc[k])  # noqa: E731
    keys.update({
        "rope_theta": (theta, "rope_parameters"), "rope_scaling": (None, "rope_parameters"),
        "rope_linear": (linear, "rope_parameters"), "rope_local_theta": (local_theta, "rope_parameters"),
        "window": (int(window) if window else None, "sliding_window"),
        "local_layers": ([KINDS[t] for t in types], "layer_types"),
        "query_scale": (float(hc.get("query_pre_attn_scalar") or keys["head_dim"][0]), "query_pre_attn_scalar"),
        "attn_softcap": (cap("attn_logit_softcapping"), "attn_logit_softcapping"),
        "final_softcap": (cap("final_logit_softcapping"), "final_logit_softcapping"),
        "embed_scale": (True, "architectures"), "norm_plus_one": (True, "architectures")})
    return keys


def leaves(mc, qk_norm: bool = False) -> list[Leaf]:
    D, E, L = mc.d_model, mc.head_dim, mc.n_layers
    out = [lf for lf in llama_hf.leaves(mc) if lf.path != ("layers", "mlp_norm")]
    per_layer = {"mlp_norm": ("pre_feedforward_layernorm", D), "post_attn_norm": ("post_attention_layernorm", D),
                 "post_mlp_norm": ("post_feedforward_layernorm", D)}
    if qk_norm:
        per_layer.update({"q_norm": ("self_attn.q_norm", E), "k_norm": ("self_attn.k_norm", E)})
    return out + [Leaf(("layers", k), [f"model.layers.{i}.{n}.weight" for i in range(L)], (d,), (d,), (0,), True)
                  for k, (n, d) in per_layer.items()]


def hf_config(mc, dtype: str, gemma3: bool = False) -> dict:
    base = {k: v for k, v in llama_hf.hf_config(mc, dtype).items()
            if k not in llama_hf.LLAMA_ONLY + ("hidden_act", "rope_scaling", "rope_theta", "rope_parameters")}
    types = [("sliding_attention" if x else "full_attention") for x in (mc.local_layers or (False,) * mc.n_layers)]
    linear = mc.rope_linear if gemma3 else None  # Gemma 2's config has no RoPE keys of its own
    glob = {"rope_type": "linear", "factor": linear} if linear else {"rope_type": "default"}
    rope = ({"full_attention": {**glob, "rope_theta": mc.rope_theta},
             "sliding_attention": {"rope_type": "default", "rope_theta": mc.rope_local_theta}} if gemma3
            else {**glob, "rope_theta": mc.rope_theta})
    arch = "Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM"
    return {**base, "architectures": [arch], "model_type": "gemma3_text" if gemma3 else "gemma2",
            "hidden_activation": "gelu_pytorch_tanh", "rope_parameters": rope, "layer_types": types,
            "sliding_window": mc.window, "query_pre_attn_scalar": mc.query_scale,
            "attn_logit_softcapping": mc.attn_softcap, "final_logit_softcapping": mc.final_softcap,
            "attention_bias": False, "use_bidirectional_attention": False}


def expressible(mc):
    llama_hf.heads_expressible(mc)
    if mc.rope_scaling is not None:
        raise ValueError("rope_scaling (llama3) is set, which a Gemma config cannot express")


GEMMA2_HF = HFAdapter("Gemma2ForCausalLM", check, model_keys, leaves, hf_config, expressible)
# Gemma 3's multimodal model: its text tower is a Gemma3ForCausalLM, under `model.language_model.` as
# transformers 5 saves it or `language_model.model.` as the older Hub checkpoints hold it
GEMMA3_VLM = HFWrapper("Gemma3ForConditionalGeneration", "text_config",
                       (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head.")),
                       ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                        "multi_modal_projector."))
GEMMA3_HF = HFAdapter("Gemma3ForCausalLM", check, lambda hc: model_keys(hc, True),
                      lambda mc: leaves(mc, True), lambda mc, dt: hf_config(mc, dt, True), expressible,
                      (GEMMA3_VLM,))
