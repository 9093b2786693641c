"""The DeepSeek-V3 family (`DeepseekV3ForCausalLM`: DeepSeek-V3, R1, V3.1, Kimi-K2; `glm4_moe_lite`, the same
model in GLM-4.7-Flash's Hugging Face form, `Glm4MoeLiteForCausalLM`): multi-head latent attention
(models/families/mla.py) in every layer; the first `first_dense` layers a dense SwiGLU MLP of d_ff (a stack of their
own, "first_layers", ModelSpec.first_layers), the rest Mixtures of Experts routed by DeepSeek's router
(models/families/sigmoid_router.py: sigmoid scores, group-limited choice, a correction bias the weights never see,
routed_scale) beside `shared_experts` always-on experts with no gate.

The correction bias, `router_bias` (layers, experts), is state the step sets, not a weight (Param.trainable False):
no gradient, no optimizer state, no decay; after each optimizer step the guard accepts, trainer/step.py moves it by
auxiliary-loss-free balancing (sigmoid_router.balanced_bias, model.bias_rate) from the step's loads, the choices
per expert of each MoE layer counted over the whole step batch (the layers' aux output `moe/loads`, summed like
every aux output over microbatches, data and context ranks and stages; padding is left out where the model keeps to
documents; tokens of loss weight 0, a prompt's, are counted: they run through the experts all the same, and the
bias balances the experts' work). Logged: moe/imbalance, the largest of the layers' max load / mean load.

Letters as in models/families/moe.py and mla.py."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import DIM, FLOAT32, POSITIVE, key
from models.families import sigmoid_router as router
from models.families.mla import absorbed_attention, latent_attention, latents
from models.families.moe import AUX as MOE_AUX, MOE, MoEConfig, capacity, kept, router_losses
from models.hf.deepseek import DEEPSEEK_V3_HF, GLM4_MOE_LITE_HF
from models.kernels.experts import grouped_mlp
from models.layers import rms_norm, rope_tables, yarn_attention_factor, yarn_inv_freq, yarn_softmax_factor
from models.spec import LayerCall, ModelSpec, Param, register
from models.transformer import mlp_half as dense_half

AUX = MOE_AUX + ("seq_balance", "moe/loads")
MLA_KEYS = ("attn_norm", "wq", "wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b", "wo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnKeys:
    """YaRN's keys (transformers' `yarn` rope type), declared once for the family configs that take them (DeepSeek-V3's,
    gpt-oss's, each with ModelConfig): the RoPE tables `yarn_rope` builds."""
    yarn_factor: float | None = key(None, POSITIVE, "YaRN: the context's factor over the original; null: plain RoPE")
    yarn_original: int = key(4096, DIM, "YaRN: original_max_position_embeddings")
    yarn_beta_fast: float = key(32.0, POSITIVE, "YaRN: beta_fast")
    yarn_beta_slow: float = key(1.0, POSITIVE, "YaRN: beta_slow")
    yarn_mscale: float = key(1.0, f">= 0 and <= {FLOAT32}", "YaRN: mscale (DeepSeek's cos/sin correction)")
    yarn_mscale_all_dim: float = key(0.0, f">= 0 and <= {FLOAT32}", "YaRN: mscale_all_dim (DeepSeek's softmax "
                                     "correction)")
    yarn_truncate: bool = key(True, None, "YaRN: the ramp's ends rounded outwards (truncate; gpt-oss sets false)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekConfig(MoEConfig, YarnKeys):
    """DeepSeek-V3's model: the MoE keys (n_experts, n_experts_per_token, expert_d_ff: moe_intermediate_size,
    norm_topk_prob, capacity_factor, dispatch_factor, router_aux_loss, router_z_loss) and these."""
    first_dense: int = key(0, ">= 0 and <= 65536", "DeepSeek: the first layers with a dense MLP of d_ff "
                           "(first_k_dense_replace), the rest MoE")
    shared_experts: int = key(0, ">= 0 and <= 65536", "DeepSeek: experts every token runs, no gate "
                              "(n_shared_experts), each expert_d_ff wide")
    n_groups: int = key(1, "> 0 and <= 65536", "DeepSeek router: groups of experts (n_group)")
    groups_kept: int = key(1, "> 0 and <= 65536", "DeepSeek router: the best groups a token chooses in (topk_group)")
    routed_scale: float = key(1.0, POSITIVE, "DeepSeek router: the routed weights x this (routed_scaling_factor)")
    bias_rate: float = key(0.001, f">= 0 and <= {FLOAT32}", "auxiliary-loss-free balancing: each expert's bias "
                           "moves by this x sign(mean load - its load) after each step; 0: the bias stays")
    seq_balance_loss: float = key(0.0, f">= 0 and <= {FLOAT32}", "DeepSeek-V3's sequence-wise balance loss weight "
                                  "(alpha), per document (logged as aux/seq_balance)")
    q_rank: int | None = key(None, DIM, "MLA: the queries' low rank (q_lora_rank); null: one projection")
    kv_rank: int = key(512, DIM, "MLA: the keys' and values' latent width (kv_lora_rank)")
    nope_dim: int = key(128, DIM, "MLA: each head's query/key width without RoPE (qk_nope_head_dim)")
    rope_dim: int = key(64, DIM, "MLA: the RoPE'd width (qk_rope_head_dim), its key shared by the heads")
    v_dim: int = key(128, DIM, "MLA: each head's value width (v_head_dim)")
    rope_interleave: bool = key(True, None, "MLA: RoPE on interleaved pairs (DeepSeek's weights)")
    def __post_init__(self):
        object.__setattr__(self, "head_dim", self.nope_dim + self.rope_dim)  # the queries' and keys' width
        super().__post_init__()


def attention_inventory(c: DeepseekConfig) -> dict:
    D, H, E, Rkv, Er = c.d_model, c.n_heads, c.head_dim, c.kv_rank, c.rope_dim
    out = {"attn_norm": Param((D,), ("embed",), "ones", False)}
    if c.q_rank:
        out.update(wq_a=Param((D, c.q_rank), ("embed", None), "normal", True),
                   q_norm=Param((c.q_rank,), (None,), "ones", False),
                   wq_b=Param((c.q_rank, H, E), (None, "heads", "head_dim"), "normal", True))
    else:
        out["wq"] = Param((D, H, E), ("embed", "heads", "head_dim"), "normal", True)
    out.update(wkv_a=Param((D, Rkv + Er), ("embed", None), "normal", True),
               kv_norm=Param((Rkv,), (None,), "ones", False),
               wkv_b=Param((Rkv, H, c.nope_dim + c.v_dim), (None, "heads", "head_dim"), "normal", True),
               wo=Param((H, c.v_dim, D), ("heads", "head_dim", "embed"), "residual", True),
               mlp_norm=Param((D,), ("embed",), "ones", False))
    return out


def inventory(c: DeepseekConfig) -> dict:
    D, X, F, V = c.d_model, c.n_experts, c.expert_d_ff or c.d_ff, c.vocab_size
    moe = {**attention_inventory(c),
           "router": Param((D, X), ("embed", None), "normal", False, as_stored=True),
           "router_bias": Param((X,), (None,), "zeros", False, as_stored=True, trainable=False),
           "expert_gate": Param((X, D, F), ("experts", "embed", "mlp"), "normal", True),
           "expert_up": Param((X, D, F), ("experts", "embed", "mlp"), "normal", True),
           "expert_down": Param((X, F, D), ("experts", "mlp", "embed"), "residual", True)}
    if c.shared_experts:
        S = c.shared_experts * F
        moe.update(shared_gate=Param((D, S), ("embed", "mlp"), "normal", True),
                   shared_up=Param((D, S), ("embed", "mlp"), "normal", True),
                   shared_down=Param((S, D), ("mlp", "embed"), "residual", True))
    out = {"embed": Param((V, D), ("vocab", "embed"), "normal", True, as_stored=True)}
    if c.first_dense:
        out["first_layers"] = {**attention_inventory(c),
                               "w_gate": Param((D, c.d_ff), ("embed", "mlp"), "normal", True),
                               "w_up": Param((D, c.d_ff), ("embed", "mlp"), "normal", True),
                               "w_down": Param((c.d_ff, D), ("mlp", "embed"), "residual", True)}
    out["layers"] = moe
    if not c.tie_embeddings:
        out["lm_head"] = Param((D, V), ("embed", "vocab"), "normal", True, as_stored=True)
    out["final_norm"] = Param((D,), ("embed",), "ones", False, as_stored=True)
    return out


def yarn_rope(c, E: int, T: int, positions_BT=None) -> tuple:
    """(cos, sin) of E RoPE'd dimensions for a config with YaRN's keys (YarnKeys): plain RoPE of
    c.rope_theta where c.yarn_factor is null, else YaRN's frequencies with its cos/sin factor."""
    if not c.yarn_factor:
        return rope_tables(T, E, c.rope_theta, None, positions_BT)
    inv = yarn_inv_freq(E, c.rope_theta, c.yarn_factor, c.yarn_original, c.yarn_beta_fast, c.yarn_beta_slow,
                        c.yarn_truncate)
    factor = yarn_attention_factor(c.yarn_factor, c.yarn_mscale, c.yarn_mscale_all_dim)
    pos = jnp.arange(T, dtype=jnp.float32) if positions_BT is None else positions_BT.astype(jnp.float32)
    ang = pos[..., None] * inv
    return jnp.cos(ang) * factor, jnp.sin(ang) * factor


def softmax_scale(c: DeepseekConfig) -> float:
    """The attention's softmax scale: 1 / sqrt(the query width), times YaRN's correction where mscale_all_dim set."""
    scale = c.head_dim ** -0.5
    if c.yarn_factor and c.yarn_mscale_all_dim:
        scale *= yarn_softmax_factor(c.yarn_factor, c.yarn_mscale_all_dim)
    return scale


def rope(c: DeepseekConfig, T: int, positions_BT=None) -> tuple:
    """(cos, sin) of the RoPE'd part (rope_dim wide): plain, or YaRN's frequencies with its cos/sin factor."""
    return yarn_rope(c, c.rope_dim, T, positions_BT)


def attention_half(c: DeepseekConfig, p: dict, x_BTD, call: LayerCall):
    """x + multi-head latent attention(norm(x)), through the call's attention (any strategy and kernel)."""
    p = {k: p[k].astype(x_BTD.dtype) for k in MLA_KEYS if k in p}
    h_BTD = rms_norm(x_BTD, p["attn_norm"], c.norm_eps)
    cos, sin = call.rope[:2]
    if call.cache is not None:  # decoding: the latent cache, the up-projections absorbed (mla.absorbed_attention)
        cached = call.cache.write(**dict(zip(("latent", "rope_key"), latents(p, h_BTD, cos, sin, c.rope_interleave,
                                                                            c.norm_eps))))
        o_BTD = absorbed_attention(p, h_BTD, cos, sin, (cached["latent"], cached["rope_key"]), call.cache.q_pos,
                                   call.cache.k_pos, softmax_scale(c), c.nope_dim, c.rope_interleave, c.norm_eps)
    else:
        o_BTD = latent_attention(p, h_BTD, cos, sin, call.attention, softmax_scale(c), c.nope_dim,
                                 c.rope_interleave, c.norm_eps, segments=call.segments)
    return call.constrain(x_BTD + o_BTD, ("batch", "res_seq", "embed"))


def decode_cache(c: DeepseekConfig, batch: int, length: int, dtype) -> dict:
    """Every layer's decoding cache: each token's normed latent and RoPE'd key, kv_rank + rope_dim numbers."""
    return {"latent": jnp.zeros((c.n_layers, batch, length, c.kv_rank), dtype),
            "rope_key": jnp.zeros((c.n_layers, batch, length, c.rope_dim), dtype)}


def moe_half(c: DeepseekConfig, p: dict, x_BTD, call: LayerCall):
    """x + the routed experts of norm(x) (DeepSeek's router) + the shared experts; aux: the MoE's sums, the
    sequence-wise balance loss's and this layer's row of the loads table (moe/loads: choices per expert, padding
    left out)."""
    kn, constrain = call.kernels, call.constrain
    B, T, D = x_BTD.shape
    K, X = c.n_experts_per_token, c.n_experts
    h_BTD = rms_norm(x_BTD, p["mlp_norm"].astype(x_BTD.dtype), c.norm_eps)
    # the router's logits and its bias in float32 whatever the compute dtype (as transformers keeps them)
    logits_BTX = jnp.einsum("btd,dx->btx", h_BTD.astype(jnp.float32), p["router"].astype(jnp.float32))
    scores_NX, idx_NK, w_NK = router.route(logits_BTX.reshape(B * T, X), p["router_bias"].astype(jnp.float32),
                                           c.n_groups, c.groups_kept, K, c.norm_topk_prob, c.routed_scale)
    scores_BTX, idx_BTK = scores_NX.reshape(B, T, X), idx_NK.reshape(B, T, K)
    valid_BT = jnp.ones((B, T), bool) if call.segments is None else call.segments != 0
    slots = None if call.decoding else capacity(c, T)
    keep_BTK, slot_BTK = kept(idx_BTK, valid_BT, X, slots)
    w_BTK = jnp.where(keep_BTK, w_NK.reshape(B, T, K), 0.0)
    weights = tuple(p[k].astype(x_BTD.dtype) for k in ("expert_gate", "expert_up", "expert_down"))
    if slots is not None:
        slots = (slot_BTK.reshape(B * T, K), slots, T)
    y_ND, over_N = grouped_mlp(h_BTD.reshape(B * T, D), idx_NK, keep_BTK.reshape(B * T, K),
                               w_BTK.reshape(B * T, K).astype(x_BTD.dtype), weights, kn.silu, kn.platform,
                               collectives=call.collectives, slots=slots, routed=c.dispatch_factor, overflow=True,
                               recompute=c.remat != "none")
    y_BTD = y_ND.reshape(B, T, D)
    if "shared_gate" in p:
        s = {k: p[k].astype(x_BTD.dtype) for k in ("shared_gate", "shared_up", "shared_down")}
        gate_BTS, up_BTS = kn.project(h_BTD, (s["shared_gate"], s["shared_up"]))
        (shared_BTD,) = kn.project(constrain(kn.silu(gate_BTS) * up_BTS, ("batch", "seq", "mlp")), (s["shared_down"],))
        y_BTD = y_BTD + shared_BTD
    share_BTX = scores_BTX / jnp.sum(scores_BTX, axis=-1, keepdims=True)  # the affinities normalised per token
    balance, z = router_losses(c, logits_BTX, share_BTX, idx_BTK, valid_BT, call.collectives)
    chosen_X = jnp.sum(jax.nn.one_hot(idx_BTK, X, dtype=jnp.float32) * (keep_BTK & valid_BT[..., None])[..., None],
                       axis=(0, 1, 2))
    # this layer's row of the loads table: the MoE layers', then the multi-token prediction modules' (index n_layers on)
    row = jax.nn.one_hot(call.index - c.first_dense, c.n_layers - c.first_dense + c.mtp_depth, dtype=jnp.float32)
    seq = router.sequence_balance(scores_BTX, idx_BTK, call.segments if call.segments is not None
                                  else jnp.ones((B, T), jnp.float32), valid_BT,
                                  call.collectives)[0] if c.seq_balance_loss else 0.0
    aux = {"load_balance": balance, "z_loss": z,
           "moe/dropped": jnp.sum((~keep_BTK & valid_BT[..., None]).astype(jnp.float32)),
           "moe/overflow": jnp.sum(over_N), "seq_balance": jnp.asarray(seq, jnp.float32),
           "moe/loads": row[:, None] * chosen_X[None, :]}
    return constrain(x_BTD + y_BTD, ("batch", "res_seq", "embed")), aux


def dense_mlp_half(c: DeepseekConfig, p: dict, x_BTD, call: LayerCall):
    """A first layer's dense SwiGLU MLP; its aux outputs zero (every MoE name, the loads table too)."""
    y, _ = dense_half(c, p, x_BTD, call)
    return y, {k: jnp.zeros(aux_shapes(c).get(k, ()), jnp.float32) for k in AUX}


def moe_layer(c: DeepseekConfig, p: dict, x_BTD, call: LayerCall):
    x_BTD = call.half(lambda p, x: attention_half(c, p, x, call))(p, x_BTD)
    return call.half(lambda p, x: moe_half(c, p, x, call))(p, x_BTD)


def dense_layer(c: DeepseekConfig, p: dict, x_BTD, call: LayerCall):
    x_BTD = call.half(lambda p, x: attention_half(c, p, x, call))(p, x_BTD)
    return call.half(lambda p, x: dense_mlp_half(c, p, x, call))(p, x_BTD)


def aux_shapes(c: DeepseekConfig) -> dict:
    """The loads table: a row per MoE layer, then one per multi-token prediction module (model.mtp_depth)."""
    return {"moe/loads": (c.n_layers - c.first_dense + c.mtp_depth, c.n_experts)}


def aux_counts(c: DeepseekConfig, batch: dict) -> dict:
    """Each aux output's count over a batch, over the MoE layers alone (MOE's, of n_layers - first_dense layers);
    the sequence-wise loss's: the batch's documents (a row without documents is one) x the MoE layers."""
    moe = dataclasses.replace(c, n_layers=c.n_layers - c.first_dense)
    seg = batch["segment_ids"]
    if c.documents:  # documents of a row: its distinct nonzero segment ids, each a run of equal ids
        starts = (seg != 0) & jnp.concatenate([jnp.ones(seg.shape[:1] + (1,), bool), seg[:, 1:] != seg[:, :-1]], 1)
        docs = jnp.sum(starts.astype(jnp.float32))
    else:
        docs = jnp.asarray(seg.shape[0], jnp.float32)
    return {**MOE["aux_counts"](moe, batch), "seq_balance": docs * moe.n_layers,
            "moe/loads": jnp.ones((), jnp.float32)}


def aux_weights(c: DeepseekConfig) -> dict:
    return {**MOE["aux_weights"](c), "seq_balance": c.seq_balance_loss, "moe/loads": 0.0}


def after_step(c: DeepseekConfig, params: dict, aux: dict) -> tuple[dict, dict]:
    """Auxiliary-loss-free balancing after the optimizer's update: each MoE layer's bias moved by bias_rate x
    sign(mean load - load) from the step's loads (summed over the whole step batch); the metrics moe/imbalance (the
    largest of the layers' max load / mean load) and moe/imbalance/<layer> for each MoE layer."""
    loads = aux["moe/loads"]
    ratio = jnp.max(loads, axis=-1) / jnp.maximum(jnp.mean(loads, axis=-1), 1e-30)
    metrics = {"moe/imbalance": jnp.max(ratio), **{f"moe/imbalance/{c.first_dense + i}": ratio[i]
                                                     for i in range(loads.shape[0])}}
    if c.bias_rate > 0:  # each stack's bias by its own rows: the MoE layers', the modules' (their own loads)
        L = c.n_layers - c.first_dense
        for stack, rows in (("layers", loads[:L]), ("mtp", loads[L:])):
            if stack in params:
                bias = router.balanced_bias(params[stack]["router_bias"], rows, c.bias_rate)
                params = {**params, stack: {**params[stack], "router_bias": bias}}
    return params, metrics


def tp_reductions(c: DeepseekConfig, stack: str, remat: str) -> list:
    """The widths one layer all-reduces over `model` per microbatch (trainer/plan/comm.py): forward, the attention's
    output (after wo) and each MLP's partial sums (the dense one; the routed experts' and the shared experts'); in
    the backward the input gradients of the heads-split up-projections (wq_b of q_rank, or wq of d_model; wkv_b of
    kv_rank) and of each MLP; full remat recomputes the attention's and the shared experts' outputs (the MoE's routed
    sum and a dense MLP's output the backward does not read)."""
    D = c.d_model
    mlps = 1 if stack == "first_layers" else 1 + bool(c.shared_experts)
    widths = [D] + [D] * mlps + [c.q_rank or D, c.kv_rank] + [D] * mlps
    again = 1 + (stack == "layers" and bool(c.shared_experts))  # the attention's output, the shared experts'
    return widths + ([D] * again if remat == "full" else [])


def first_layers(c: DeepseekConfig) -> int:
    return c.first_dense


def checks(c: DeepseekConfig) -> list:
    X, G = c.n_experts, c.n_groups
    return MOE["checks"](c) + [
        (c.first_dense < c.n_layers, f"model.first_dense={c.first_dense} leaves no MoE layer of model.n_layers="
         f"{c.n_layers}; set first_dense below n_layers"),
        (X % G == 0, f"model.n_experts={X} is not divisible by model.n_groups={G}; choose groups of equal size"),
        (c.groups_kept <= G, f"model.groups_kept={c.groups_kept} exceeds model.n_groups={G}"),
        (c.groups_kept * (X // max(G, 1)) >= c.n_experts_per_token, f"model.groups_kept={c.groups_kept} groups of "
         f"{X // max(G, 1)} experts hold fewer than model.n_experts_per_token={c.n_experts_per_token}"),
        (c.n_kv_heads == c.n_heads, f"model.n_kv_heads={c.n_kv_heads} must equal model.n_heads={c.n_heads} (latent "
         "attention has a key and value per head)"),
        (c.rope_dim % 2 == 0, f"model.rope_dim={c.rope_dim} must be even (RoPE turns pairs)")]


SPEC = {**MOE, "config": DeepseekConfig, "aux": AUX, "aux_counts": aux_counts, "aux_weights": aux_weights,
        "checks": checks, "split_keys": {"mlp": ("expert_d_ff",)}}
SPEC.pop("mlp")
FAMILY = dict(rope=rope, first_layers=first_layers, first_layer=dense_layer, aux_shapes=aux_shapes,
              after_step=after_step, decode_cache=decode_cache, qk_v_width=lambda c: c.head_dim + c.v_dim,
              tp_reductions=tp_reductions, **SPEC)
DEEPSEEK_V3 = register(ModelSpec("deepseek_v3", inventory, moe_layer, DEEPSEEK_V3_HF, **FAMILY))
# GLM-4.7-Flash: the same model, its Hugging Face form its own
GLM4_MOE_LITE = register(ModelSpec("glm4_moe_lite", inventory, moe_layer, GLM4_MOE_LITE_HF, **FAMILY))
