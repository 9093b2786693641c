"""Hugging Face adapters of the Mixture-of-Experts families (`MixtralForCausalLM`, `Qwen3MoeForCausalLM`,
`Qwen2MoeForCausalLM`), both directions: Llama's, Qwen3's and Qwen2's attention tensors and config fields
(models/hf/llama.py, models/hf/qwen.py), the router, and one tensor per expert of each layer as `save_pretrained`
writes them, stacked into meshtrain's (layers, experts, ...) parameters (`Leaf.lead`) and read slice by slice.
A config feature the families do not compute (dense layers in the stack, router jitter, ...) is a ValueError
naming the field."""
from __future__ import annotations

from models.hf import llama as llama_hf

from models.hf import qwen as qwen_hf
from models.spec import HFAdapter, Leaf

# meshtrain's expert parameter -> (Mixtral's tensor, Qwen-MoE's); the HF (out, in) tensor is the transpose
EXPERTS = {"expert_gate": ("w1", "gate_proj"), "expert_up": ("w3", "up_proj"), "expert_down": ("w2", "down_proj")}
SHARED = {"shared_gate": "gate_proj", "shared_up": "up_proj", "shared_down": "down_proj"}
DENSE = ".mlp."  # the dense MLP's tensors in the base family's leaves (model.layers.L.mlp.*)


def n_experts(hc: dict) -> int:
    """The expert count: the Hub's `num_experts` (Qwen-MoE) or transformers 5's `num_local_experts`."""
    n = hc.get("num_local_experts", hc.get("num_experts"))
    if n is None:
        raise ValueError("lacks num_local_experts (or num_experts)")
    return int(n)


def _check_moe(hc: dict):
    """The routing features every MoE family shares: at least 2 experts, no router jitter."""
    if n_experts(hc) < 2:
        raise ValueError(f"num_local_experts={n_experts(hc)}: meshtrain's MoE families have at least 2 experts")
    if float(hc.get("router_jitter_noise") or 0.0) > 0:
        raise ValueError(f"router_jitter_noise={hc['router_jitter_noise']} is not supported (meshtrain's router adds "
                         "no noise); set router_jitter_noise to 0")


def mixtral_check(hc: dict):
    llama_hf.check(hc)
    _check_moe(hc)


def qwen_check(hc: dict):
    """Qwen's attention (qwen_hf.check) and every layer sparse: decoder_sparse_step 1, no mlp_only_layers, no
    first_k_dense_replace; Qwen2-MoE's q/k/v biases on."""
    qwen_hf.check(hc)
    _check_moe(hc)
    if int(hc.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"decoder_sparse_step={hc['decoder_sparse_step']} is not supported (dense layers in the "
                         "stack); meshtrain's MoE families have every layer sparse (decoder_sparse_step=1)")
    for key in ("mlp_only_layers", "first_k_dense_replace"):
        if hc.get(key):
            raise ValueError(f"{key}={hc[key]} is not supported (dense layers in the stack); meshtrain's MoE "
                             f"families have every layer sparse ({key} empty)")
    if hc.get("qkv_bias") is False:
        raise ValueError("qkv_bias=false is not supported; meshtrain's qwen2_moe has q/k/v biases (qkv_bias=true)")


def _moe_keys(hc: dict, expert_width: str) -> dict:
    try:
        return {"n_experts": (n_experts(hc), "num_local_experts"),
                "n_experts_per_token": (int(hc["num_experts_per_tok"]), "num_experts_per_tok"),
                "expert_d_ff": (int(hc[expert_width]), expert_width)}
    except KeyError as e:
        raise ValueError(f"lacks {e.args[0]}") from None


def mixtral_keys(hc: dict) -> dict:
    window = hc.get("sliding_window")
    return {**llama_hf.model_keys(hc), **_moe_keys(hc, "intermediate_size"),
            "router": ("topk_softmax", "architectures"), "window": (int(window) if window else None, "sliding_window")}


def qwen_keys(hc: dict, shared: bool) -> dict:
    keys = {**llama_hf.model_keys(hc), **_moe_keys(hc, "moe_intermediate_size"),
            "router": ("softmax_topk", "architectures"),
            "norm_topk_prob": (bool(hc.get("norm_topk_prob", False)), "norm_topk_prob")}
    if shared:
        if not hc.get("shared_expert_intermediate_size"):
            raise ValueError("lacks shared_expert_intermediate_size (the shared expert's width, which "
                             "Qwen2MoeForCausalLM always has)")
        keys["shared_expert_d_ff"] = (int(hc["shared_expert_intermediate_size"]), "shared_expert_intermediate_size")
    return keys


def moe_leaves(base, mixtral: bool):
    """The leaves of a dense family's adapter (`base`) with the MLP's replaced by the router and the experts (and the
    shared expert where the model has one)."""
    def leaves(mc) -> list[Leaf]:
        D, X, L, F = mc.d_model, mc.n_experts, mc.n_layers, mc.expert_d_ff or mc.d_ff
        mlp = "block_sparse_moe" if mixtral else "mlp"
        layer = lambda n: [f"model.layers.{i}.{mlp}.{n}.weight" for i in range(L)]  # noqa: E731
        out = [lf for lf in base(mc) if DENSE not in lf.names[0]]
        out.append(Leaf(("layers", "router"), layer("gate"), (X, D), (X, D), (1, 0), True))
        for k, names in EXPERTS.items():
            n = names[0 if mixtral else 1]
            shape = (D, F) if k == "expert_down" else (F, D)
            out.append(Leaf(("layers", k), [f"model.layers.{i}.{mlp}.experts.{e}.{n}.weight" for i in range(L)
                                            for e in range(X)], shape, shape, (1, 0), True, (L, X)))
        if mc.shared_expert_d_ff:
            S = mc.shared_expert_d_ff
            for k, n in SHARED.items():
                shape = (D, S) if k == "shared_down" else (S, D)
                out.append(Leaf(("layers", k), layer(f"shared_expert.{n}"), shape, shape, (1, 0), True))
            out.append(Leaf(("layers", "shared_expert_gate"), layer("shared_expert_gate"), (1, D), (1, D), (1, 0),
                            True))
        return out
    return leaves


def _moe_fields(mc) -> dict:
    return {"num_experts_per_tok": mc.n_experts_per_token, "router_aux_loss_coef": mc.router_aux_loss,
            "output_router_logits": mc.router_aux_loss > 0}


def mixtral_config(mc, dtype: str) -> dict:
    base = {k: v for k, v in llama_hf.hf_config(mc, dtype).items() if k not in llama_hf.LLAMA_ONLY}
    return {**base, **_moe_fields(mc), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": mc.expert_d_ff or mc.d_ff, "num_local_experts": mc.n_experts,
            "router_jitter_noise": 0.0, "sliding_window": mc.window}


def qwen_config(arch: str, model_type: str, dense):
    def config(mc, dtype: str) -> dict:
        out = {**dense(mc, dtype), **_moe_fields(mc), "architectures": [arch], "model_type": model_type,
               "num_experts": mc.n_experts, "moe_intermediate_size": mc.expert_d_ff or mc.d_ff,
               "norm_topk_prob": mc.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": []}
        if mc.shared_expert_d_ff:
            out.update(shared_expert_intermediate_size=mc.shared_expert_d_ff, qkv_bias=True)
        return out
    return config


def moe_expressible(router: str, shared: bool, base):
    """Raise ValueError unless the HF architecture holds the model: sparse, its router, a shared expert exactly
    where the architecture has one."""
    def expressible(mc):
        base(mc)
        if not mc.sparse:
            raise ValueError(f"n_experts={mc.n_experts}: a dense MLP, which an MoE Hugging Face model cannot express")
        if mc.router != router:
            raise ValueError(f"router={mc.router}, which this architecture cannot express (it routes by {router})")
        if bool(mc.shared_expert_d_ff) != shared:
            raise ValueError("shared_expert_d_ff is " + ("null; this architecture has a shared expert" if shared
                                                         else "set; this architecture has no shared expert"))
    return expressible


MIXTRAL_HF = HFAdapter("MixtralForCausalLM", mixtral_check, mixtral_keys, moe_leaves(llama_hf.leaves, True),
                       mixtral_config, moe_expressible("topk_softmax", False, llama_hf.heads_expressible))
QWEN3_MOE_HF = HFAdapter("Qwen3MoeForCausalLM", qwen_check, lambda hc: qwen_keys(hc, False),
                         moe_leaves(qwen_hf.qwen3_leaves, False),
                         qwen_config("Qwen3MoeForCausalLM", "qwen3_moe", qwen_hf.QWEN3_HF.config),
                         moe_expressible("softmax_topk", False, llama_hf.expressible))
QWEN2_MOE_HF = HFAdapter("Qwen2MoeForCausalLM", qwen_check, lambda hc: qwen_keys(hc, True),
                         moe_leaves(qwen_hf.qwen2_leaves, False),
                         qwen_config("Qwen2MoeForCausalLM", "qwen2_moe", qwen_hf.QWEN2_HF.config),
                         moe_expressible("softmax_topk", True, llama_hf.expressible))
