"""gpt-oss (`GptOssForCausalLM`): Llama's pre-norm layer with an MoE MLP, differing from the other families in

  - attention: biases on q, k, v and the output projection; a learned sink per head (`sinks` (H,): one more logit
    in every query's softmax, taking no value; every attention path takes it, models/kernels/attention.py); sliding-
    window (model.window, 128 in the release) and full layers alternating (model.local_layers, HF's layer_types:
    per-layer data of the spec, so the stack stays one scanned stack); RoPE YaRN-scaled (models/families/deepseek.py
    YarnKeys; the release sets truncate false);
  - the router: logits with a bias, the k largest chosen and their softmax the weights (model.router topk_softmax);
  - the experts: gate and up (one `gate_up_proj` in HF, interleaved; here (X, D, 2, F), gate first) and down, each
    with a bias, through the clamped SwiGLU: gate clamped above at swiglu_limit, up to +-swiglu_limit, out
    (up + 1) x gate x sigmoid(swiglu_alpha x gate) (`clamped_swiglu`, every formulation of
    models/kernels/experts.py takes it and the biases);
  - the load-balancing loss as transformers computes it (`load_balancing_loss_func`): the layers' router logits
    pooled over every token of the batch and every layer, X x sum_e f_e P_e with f_e the share of the choices of e
    and P_e the mean probability of e, weighted by model.router_aux_loss (HF's router_aux_loss_coef, on where
    output_router_logits): pooled, it is not a sum over rows, so the objective takes it from the step's whole sums
    (`balance_term`; ModelSpec.whole_batch).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from models.config import FLOAT32, POSITIVE, key
from models.families.deepseek import YarnKeys, yarn_rope
from models.families.gemma import LocalLayers, as_tuple, layer_data as local_data, windows as local_windows
from models.families.llama import llama_inventory
from models.families.moe import MOE, MoEConfig, capacity, kept, route
from models.hf.gpt_oss import GPT_OSS_HF
from models.kernels.attention import GLOBAL
from models.kernels.experts import grouped_mlp
from models.layers import rms_norm
from models.spec import LayerCall, ModelSpec, Param, register
from models.transformer import layer, qkv, repeat_kv

# the layer's aux outputs: the MoE MLP's statistics and z-loss, and each expert's choices and probability summed over
# the tokens (the pooled balancing loss's two tables, (X,) each)
BALANCE = ("load_balance/choices", "load_balance/probs")
AUX = ("load_balance", "z_loss", "moe/dropped", "moe/overflow") + BALANCE
ATTENTION = ("attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "sinks")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssConfig(MoEConfig, YarnKeys, LocalLayers):
    """gpt-oss's model: the MoE keys (router topk_softmax; router_aux_loss the pooled balancing loss's weight), YaRN's,
    local_layers (true: a sliding layer) and these."""
    swiglu_limit: float = key(7.0, POSITIVE, "gpt-oss experts: gate clamped above at this, up to +-this")
    swiglu_alpha: float = key(1.702, f">= 0 and <= {FLOAT32}", "gpt-oss experts: out = (up + 1) x gate x "
                              "sigmoid(alpha x gate)")

    def __post_init__(self):
        super().__post_init__()
        as_tuple(self)


def inventory(c: GptOssConfig) -> dict:
    inv = llama_inventory(c)
    D, H, K, E, X, F = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.n_experts, c.expert_d_ff or c.d_ff
    layers = {k: v for k, v in inv["layers"].items() if k not in ("w_gate", "w_up", "w_down")}
    layers.update(bq=Param((H, E), ("heads", "head_dim"), "zeros", False),
                  bk=Param((K, E), ("kv_heads", "head_dim"), "zeros", False),
                  bv=Param((K, E), ("kv_heads", "head_dim"), "zeros", False),
                  bo=Param((D,), ("embed",), "zeros", False),
                  sinks=Param((H,), ("heads",), "normal", False, as_stored=True),  # as transformers' init
                  router=Param((D, X), ("embed", None), "normal", False, as_stored=True),
                  b_router=Param((X,), (None,), "normal", False, as_stored=True),
                  expert_gate_up=Param((X, D, 2, F), ("experts", "embed", None, "mlp"), "normal", True),
                  b_gate_up=Param((X, 2, F), ("experts", None, "mlp"), "zeros", False),
                  expert_down=Param((X, F, D), ("experts", "mlp", "embed"), "residual", True),
                  b_down=Param((X, D), ("experts", "embed"), "zeros", False))
    return {**inv, "layers": layers}


def clamped_swiglu(limit: float, alpha: float, gate, up):
    """gpt-oss's gated unit: gate clamped above at `limit`, up to [-limit, limit], (up + 1) x gate x
    sigmoid(alpha x gate)."""
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)


def attention_half(c: GptOssConfig, p: dict, x_BTD, call: LayerCall):
    """x + attention(norm(x)) with the projections' biases and the heads' sinks, each layer's own window."""
    kn, constrain = call.kernels, call.constrain
    p = {k: p[k] if k == "sinks" else p[k].astype(x_BTD.dtype) for k in ATTENTION}
    q_BTHE, k_BTKE, v_BTKE = repeat_kv(call, *qkv(c, p, x_BTD, call.rope, constrain, kernels=kn))
    window = jnp.where(call.data["local"] > 0.5, c.window or GLOBAL, GLOBAL)
    o_BTHE = call.attention(q_BTHE, k_BTKE, v_BTKE, segments=call.segments, window=window,
                            windows=(c.window, None) if c.window else (None,), sinks=p["sinks"])
    B, T, D = x_BTD.shape
    HE = c.n_heads * c.head_dim
    o_BTX = constrain(o_BTHE, ("batch", "seq", "heads", "head_dim")).reshape(B, T, HE)
    (o_BTD,) = kn.project(o_BTX, (p["wo"].reshape(HE, D),))
    return constrain(x_BTD + o_BTD + p["bo"], ("batch", "res_seq", "embed"))


def mlp_half(c: GptOssConfig, p: dict, x_BTD, call: LayerCall):
    """x + the experts of norm(x) (biased router, biased clamped-SwiGLU experts); aux: the z-loss, the dropped and
    overflow statistics (models/families/moe.py's), and the pooled balancing loss's tables over the non-padding
    tokens (each expert's choices, its probabilities summed; models/families/moe.py routes the same way)."""
    B, T, D = x_BTD.shape
    K, X, dt = c.n_experts_per_token, c.n_experts, x_BTD.dtype
    h_BTD = rms_norm(x_BTD, p["mlp_norm"].astype(dt), c.norm_eps)
    logits_BTX = jnp.einsum("btd,dx->btx", h_BTD.astype(jnp.float32), p["router"].astype(jnp.float32)) \
        + p["b_router"].astype(jnp.float32)
    probs_BTX, idx_BTK, w_BTK = route(c, logits_BTX)
    valid_BT = jnp.ones((B, T), bool) if call.segments is None else call.segments != 0
    slots = None if call.decoding else capacity(c, T)
    keep_BTK, slot_BTK = kept(idx_BTK, valid_BT, X, slots)
    w_BTK = jnp.where(keep_BTK, w_BTK, 0.0)
    gu, bgu = p["expert_gate_up"].astype(dt), p["b_gate_up"].astype(dt)
    weights = (gu[:, :, 0], gu[:, :, 1], p["expert_down"].astype(dt), bgu[:, 0], bgu[:, 1], p["b_down"].astype(dt))
    if slots is not None:
        slots = (slot_BTK.reshape(B * T, K), slots, T)
    y_ND, over_N = grouped_mlp(h_BTD.reshape(B * T, D), idx_BTK.reshape(B * T, K), keep_BTK.reshape(B * T, K),
                               w_BTK.reshape(B * T, K).astype(dt), weights, call.kernels.silu, call.kernels.platform,
                               collectives=call.collectives, slots=slots, routed=c.dispatch_factor, overflow=True,
                               recompute=c.remat != "none",
                               glu=functools.partial(clamped_swiglu, c.swiglu_limit, c.swiglu_alpha))
    v_BT = valid_BT.astype(jnp.float32)
    chosen_BTX = jnp.sum(jax.nn.one_hot(idx_BTK, X, dtype=jnp.float32), axis=2)
    aux = {"load_balance": jnp.zeros((), jnp.float32),  # the objective's, of the pooled tables (balance_term)
           "z_loss": jnp.sum(jnp.square(jax.nn.logsumexp(logits_BTX, axis=-1)) * v_BT),
           "moe/dropped": jnp.sum((~keep_BTK & valid_BT[..., None]).astype(jnp.float32)),
           "moe/overflow": jnp.sum(over_N),
           "load_balance/choices": jax.lax.stop_gradient(jnp.einsum("btx,bt->x", chosen_BTX, v_BT)),
           "load_balance/probs": jnp.einsum("btx,bt->x", probs_BTX, v_BT)}
    return call.constrain(x_BTD + y_ND.reshape(B, T, D), ("batch", "res_seq", "embed")), aux


def pooled_balance(c: GptOssConfig, choices_X, probs_X):
    """transformers' load_balancing_loss_func of the pooled tables: X x sum_e (choices_e / n) (probs_e / n), n the
    tokens x layers pooled (the choices' total / k)."""
    n = jnp.maximum(jnp.sum(choices_X) / c.n_experts_per_token, 1.0)
    return c.n_experts * jnp.sum(choices_X * probs_X) / (n * n)


def balance_term(c: GptOssConfig, aux: dict, collectives) -> dict:
    """{"load_balance": pooled_balance of this rank's aux sums}, the choices summed over every rank's rows (a
    statistic: no gradient flows through it), the probabilities this rank's: linear in them, so the ranks' values
    add up to the whole batch's loss and its gradient (the objective weights it by router_aux_loss, its count 1)."""
    if BALANCE[0] not in aux:
        return {}
    choices = jax.lax.stop_gradient(collectives.psum(collectives.psum(aux[BALANCE[0]], "batch"), "seq"))
    return {"load_balance": pooled_balance(c, choices, aux[BALANCE[1]])}


def whole_batch(c: GptOssConfig) -> str | None:
    if c.router_aux_loss:
        return (f"model.router_aux_loss={c.router_aux_loss} (gpt-oss's balancing loss pools the router over the "
                "whole batch and every layer)")
    return None


def aux_counts(c: GptOssConfig, batch: dict) -> dict:
    seg = batch["segment_ids"]
    v = (seg != 0).astype(jnp.float32) if c.documents else jnp.ones(seg.shape, jnp.float32)
    tokens = jnp.sum(v) * c.n_layers
    return {"load_balance": jnp.ones((), jnp.float32), "z_loss": tokens, "moe/dropped": tokens * c.n_experts_per_token,
            "moe/overflow": jnp.asarray(seg.size * c.n_layers, jnp.float32), **dict.fromkeys(BALANCE, tokens)}


def aux_weights(c: GptOssConfig) -> dict:
    """The pooled balancing loss and the z-loss weighted; the rest statistics."""
    return {"load_balance": c.router_aux_loss, "z_loss": c.router_z_loss, "moe/dropped": 0.0, "moe/overflow": 0.0,
            **dict.fromkeys(BALANCE, 0.0)}


def aux_shapes(c: GptOssConfig) -> dict:
    return dict.fromkeys(BALANCE, (c.n_experts,))


def checks(c: GptOssConfig) -> list:
    n = len(c.local_layers or ())
    return MOE["checks"](c) + [
        (c.sparse, f"model.n_experts={c.n_experts}: gpt-oss's MLP is experts; set n_experts > 1"),
        (c.router == "topk_softmax", f"model.router={c.router}: gpt-oss routes by topk_softmax (the softmax over the "
         "k largest biased logits); leave model.router out"),
        (not c.shared_expert_d_ff, "model.shared_expert_d_ff is set: gpt-oss has no shared expert; leave it null"),
        (c.local_layers is None or n == c.n_layers, f"model.local_layers has {n} entries but model.n_layers="
         f"{c.n_layers}; give one true (sliding) or false (full) per layer")]


def rope(c: GptOssConfig, T: int, positions_BT=None) -> tuple:
    return yarn_rope(c, c.head_dim, T, positions_BT)


GPT_OSS = register(ModelSpec(
    "gpt_oss", inventory, layer, GPT_OSS_HF,
    **{**MOE, "config": GptOssConfig, "mlp": mlp_half, "aux": AUX, "aux_counts": aux_counts,
       "aux_weights": aux_weights, "checks": checks},
    attention=attention_half, layer_data=local_data, windows=local_windows, rope=rope, aux_shapes=aux_shapes,
    aux_objective=balance_term, whole_batch=whole_batch))
