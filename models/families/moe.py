"""Mixture of Experts: the MoE MLP (a router, top-k experts per token, dropless or with a capacity per row of the
batch, the load-balancing and z losses) and the families that use it, each Llama's attention with this MLP:

  mixtral    Llama's attention (`MixtralForCausalLM`)
  qwen3_moe  Qwen3's (q/k norms) (`Qwen3MoeForCausalLM`)
  qwen2_moe  Qwen2's (q/k/v biases) (`Qwen2MoeForCausalLM`), usually with model.shared_expert_d_ff

Letters as in models/transformer.py, plus N tokens (B*T), X experts (n_experts), k = n_experts_per_token,
M = N*k choices, C slots per expert per row, F each expert's width (expert_d_ff).

Routers (model.router): `topk_softmax`, the softmax over the k largest logits (Mixtral); `softmax_topk`, the softmax
over all logits, then the k largest probabilities, divided by their sum where model.norm_topk_prob (Qwen3-MoE,
Qwen2-MoE). Capacity (model.capacity_factor > 0): each row of the batch has C = ceil(T k / X x factor) slots per
expert, filled in (choice rank, position) order; a padding token takes none, a dropped choice contributes nothing
(its token keeps the residual), decoding drops nothing. The experts' matmuls and their dispatch under expert
parallelism: models/kernels/experts.py.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from models.config import DIM, FLOAT32, ModelConfig, key
from models.layers import rms_norm
from models.hf.moe import MIXTRAL_HF, QWEN2_MOE_HF, QWEN3_MOE_HF
from models.kernels.experts import BY_PLATFORM, TILE, buffer_rows, grouped_mlp, padded_tiles
from models.families.qwen import qwen2_inventory, qwen3_inventory
from models.spec import LOCAL, LayerCall, ModelSpec, Param, register
from models.families.llama import llama_inventory
from models.transformer import layer, mlp_half as dense_half

ROUTERS = ("topk_softmax", "softmax_topk")
AUX = ("load_balance", "z_loss", "moe/dropped", "moe/overflow")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(ModelConfig):
    """An MoE family's model: the shared keys and these (n_experts <= 1: the dense SwiGLU MLP of d_ff)."""
    n_experts: int = key(8, ">= 0 and <= 65536", "MoE: experts per layer; 0 or 1: the dense MLP")
    n_experts_per_token: int = key(2, "> 0 and <= 65536", "MoE: experts each token is routed to (top-k)")
    expert_d_ff: int | None = key(None, DIM, "MoE: each expert's hidden units; null: d_ff")
    capacity_factor: float = key(0.0, f">= -{FLOAT32} and <= {FLOAT32}", "MoE: slots per expert per row = "
                                 "ceil(T k / n_experts x this); <= 0: dropless")
    router_aux_loss: float = key(0.0, f">= 0 and <= {FLOAT32}", "MoE: weight of the load-balancing loss (per row and "
                                 "MoE layer, averaged) in the objective (logged as aux/load_balance)")
    router_z_loss: float = key(0.0, f">= 0 and <= {FLOAT32}", "MoE: weight of the router z-loss (averaged over "
                               "tokens and MoE layers) in the objective (logged as aux/z_loss)")
    router: str = key("topk_softmax", ROUTERS, "MoE: topk_softmax (Mixtral) or softmax_topk (Qwen-MoE)")
    norm_topk_prob: bool = key(True, None, "MoE softmax_topk: the k probabilities divided by their sum")
    shared_expert_d_ff: int | None = key(None, DIM, "MoE: a shared expert of this width behind a sigmoid gate "
                                         "(Qwen2-MoE); null: none")
    dispatch_factor: float = key(2.0, f">= -{FLOAT32} and <= {FLOAT32}", "MoE dropless under expert parallelism: "
                                 "each rank's all-to-all buffer per destination holds this x the balanced share of its "
                                 "choices; a layer where one overflows dispatches by the exact path, a ring of experts, "
                                 "instead (logged as moe/overflow); <= 0: always by all-gather")

    @property
    def sparse(self) -> bool:
        return self.n_experts > 1


def experts_active(c: MoEConfig) -> int | None:
    """Experts a token runs (models/counts.py counts an expert weight at this many of its n_experts); None: dense."""
    return c.n_experts_per_token if c.sparse else None


def experts_over(c: MoEConfig, ranks: int, axis: str = "data") -> str | None:
    """Why this model's experts cannot be split over `ranks` ranks of the mesh axis `axis` (trainer/config: expert
    parallelism), or None."""
    if not c.sparse:
        return f"model.n_experts={c.n_experts} is a dense MLP: nothing to split"
    if c.n_experts % ranks:
        return (f"model.n_experts={c.n_experts} is not divisible by mesh.{axis}={ranks} (each {axis} rank holds "
                f"n_experts / mesh.{axis} experts)")
    return None


def experts_line(c: MoEConfig, ranks: int, over: str | None) -> str:
    """The train banner's words for the experts' layout: split over `ranks` ranks of the mesh axis `over`, or
    replicated over `ranks` data ranks (over None); '' for a dense MLP."""
    if not c.sparse:
        return ""
    if over:
        return f"experts {c.n_experts} over {over}={ranks} ({c.n_experts // ranks} per {over} rank) | "
    return f"experts {c.n_experts} replicated over data={ranks} | "


def expert_collectives(c: MoEConfig, tokens: int, ranks: int, a: int) -> list[tuple]:
    """One MoE layer's forward collectives over the expert-parallel axis (grouped_mlp), for `tokens` tokens per rank
    on `ranks` ranks, a bytes of the compute dtype (trainer/plan/comm.py): (kind, what, bytes of the array as
    trainer/plan/comm.py counts it, whether its transpose runs in the backward, whether a recomputed forward runs it
    again: what the backward reads[, True: only where a dispatch buffer overflows, the exact path])."""
    K, D, T = c.n_experts_per_token, c.d_model, c.seq_len
    C = capacity(c, T)
    if C is None:  # _experts_gathered: every rank's tokens, choices and weights gathered, the outputs scattered
        n = ranks * tokens  # (the outputs are weighted before their sum: the backward does not read them)
        gathered = [("all-gather", "tokens to every rank", n * D * a, True, True),
                    ("all-gather", "choices", n * K * 4, False, True),
                    ("all-gather", "routing weights", n * K * a, True, True),
                    ("reduce-scatter", "expert outputs summed to their tokens", n * D * a, True, False)]
        if c.dispatch_factor <= 0:
            return gathered
        # _experts_routed: buffers of buffer_rows per destination each way; the ring where one overflows: R steps,
        # each passing a block of tokens, choices, weights and the outputs' accumulator on (collective-permutes)
        rows, n = ranks * buffer_rows(tokens * K, ranks, c.dispatch_factor), ranks * tokens
        return [("all-to-all", "tokens to their experts' ranks", rows * D * a, True, True),
                ("all-to-all", "their experts there", rows * 4, False, True),
                ("all-to-all", "their routing weights", rows * a, True, True),
                ("all-to-all", "the weighted outputs back", rows * D * a, True, False),
                ("all-reduce", "whether a buffer overflowed", 4, False, True),
                ("collective-permute", "exact path: the ring's token blocks", n * D * a, True, True, True),
                ("collective-permute", "exact path: the ring's choices", n * K * 4, False, True, True),
                ("collective-permute", "exact path: the ring's routing weights", n * K * a, True, True, True),
                ("collective-permute", "exact path: the ring's output accumulators", n * D * a, True, True, True)]
    slots = c.n_experts * (tokens // T) * C * D * a  # _experts_all_to_all: this rank's buffer
    # (the outputs come back unweighted: the routing weights' gradient reads them)
    return [("all-to-all", "tokens to their experts' slots", slots, True, True),
            ("all-to-all", "the slots' outputs back", slots, True, True)]


def context_refusal(c: MoEConfig, context: int) -> str | None:
    """Why this MoE cannot run with each row split over `context` ranks (None: it can): a capacity fills each
    row's slots in row order, which would need a prefix sum over the ranks."""
    if c.sparse and c.capacity_factor > 0 and context > 1:
        return (f"model.capacity_factor={c.capacity_factor} with mesh.context={context} is not supported yet: "
                "a row's capacity slots would need a prefix sum over context; use model.capacity_factor=0 "
                "(dropless)")
    return None


def dispatch_run(c: MoEConfig, tokens: int, ranks: int) -> int | None:
    """The choices a rank runs at once where the dropless dispatch over `ranks` expert-parallel ranks is routed
    (models/kernels/experts.py: one sender's buffer, `buffer_rows` of its tokens' choices), None where it is not
    (trainer/plan/memory.py)."""
    if not c.sparse or ranks < 2 or c.dispatch_factor <= 0 or capacity(c, c.seq_len) is not None:
        return None
    return buffer_rows(tokens * c.n_experts_per_token, ranks, c.dispatch_factor)


def dispatch_rows(c: MoEConfig, tokens: int, platform: str) -> int:
    """Rows the expert MLP's dispatch holds for `tokens` tokens on `platform` (trainer/plan/memory.py): one per
    choice; on CPU (tile_scan) each expert's padded to whole tiles."""
    M = tokens * c.n_experts_per_token
    return padded_tiles(M, c.n_experts) * TILE if BY_PLATFORM.get(platform) == "tile_scan" else M


def moe_inventory(base):
    """The inventory of `base` (a dense family's) with the MLP's weights replaced by the router and the experts."""
    def inventory(c: MoEConfig) -> dict:
        inv = base(c)
        if not c.sparse:
            return inv
        D, X, F = c.d_model, c.n_experts, c.expert_d_ff or c.d_ff
        layers = {k: v for k, v in inv["layers"].items() if k not in ("w_gate", "w_up", "w_down")}
        layers.update(router=Param((D, X), ("embed", None), "normal", False, as_stored=True),
                      expert_gate=Param((X, D, F), ("experts", "embed", "mlp"), "normal", True),
                      expert_up=Param((X, D, F), ("experts", "embed", "mlp"), "normal", True),
                      expert_down=Param((X, F, D), ("experts", "mlp", "embed"), "residual", True))
        if c.shared_expert_d_ff:
            S = c.shared_expert_d_ff
            layers.update(shared_gate=Param((D, S), ("embed", "mlp"), "normal", True),
                          shared_up=Param((D, S), ("embed", "mlp"), "normal", True),
                          shared_down=Param((S, D), ("mlp", "embed"), "residual", True),
                          shared_expert_gate=Param((D, 1), ("embed", None), "normal", False))
        return {**inv, "layers": layers}
    return inventory


def top_k(x_NX, k: int):
    """jax.lax.top_k over the last axis (the values, their indices; among equal values the lower index first) as k
    argmaxes: elementwise work the compiler partitions over any batch axis, where its partitioner gathers a sharded
    batch to every device for lax.top_k (XLA:CPU, jax 0.10.2: the whole batch's router logits per MoE layer)."""
    chosen, idx = jnp.zeros(x_NX.shape, bool), []
    for _ in range(k):
        i = jnp.argmax(jnp.where(chosen, -jnp.inf, x_NX), axis=-1)
        idx.append(i)
        chosen = chosen | jax.nn.one_hot(i, x_NX.shape[-1], dtype=bool)
    idx_NK = jnp.stack(idx, axis=-1).astype(jnp.int32)
    return jnp.take_along_axis(x_NX, idx_NK, axis=-1), idx_NK


def route(c: MoEConfig, logits_NX):
    """(probabilities (N, X) of the softmax over every logit, the chosen experts (N, k) int32, their weights
    (N, k) float32) of the router (c.router)."""
    probs_NX = jax.nn.softmax(logits_NX, axis=-1)
    if c.router == "topk_softmax":
        top_NK, idx_NK = top_k(logits_NX, c.n_experts_per_token)
        return probs_NX, idx_NK, jax.nn.softmax(top_NK, axis=-1)
    w_NK, idx_NK = top_k(probs_NX, c.n_experts_per_token)
    if c.norm_topk_prob:
        w_NK = w_NK / jnp.sum(w_NK, axis=-1, keepdims=True)
    return probs_NX, idx_NK, w_NK


def capacity(c: MoEConfig, T: int) -> int | None:
    """Slots per expert per row of T tokens; None: dropless."""
    if c.capacity_factor <= 0:
        return None
    return math.ceil(T * c.n_experts_per_token / c.n_experts * c.capacity_factor)


def slot_of(idx_BTK, valid_BT, X: int):
    """Each choice's slot (B, T, k) int32, 0-based: its place among its row's non-padding choices of its expert in
    (choice rank, position) order (rank 0 of every token first, then rank 1, ...)."""
    valid_BTK = jnp.broadcast_to(valid_BT[..., None], idx_BTK.shape)
    B, T, K = idx_BTK.shape
    hot_BKTX = jax.nn.one_hot(jnp.swapaxes(idx_BTK, 1, 2), X, dtype=jnp.int32)
    hot_BKTX = hot_BKTX * jnp.swapaxes(valid_BTK, 1, 2)[..., None].astype(jnp.int32)
    order_BKTX = jnp.cumsum(hot_BKTX.reshape(B, K * T, X), axis=1).reshape(hot_BKTX.shape)  # 1-based slot
    return jnp.swapaxes(jnp.sum(order_BKTX * hot_BKTX, axis=-1), 1, 2) - 1


def kept(idx_BTK, valid_BT, X: int, slots: int | None):
    """(which choices take a slot (B, T, k) bool, each choice's slot (slot_of) or None): every non-padding choice
    when dropless (`slots` None); with `slots` per expert per row, the first ones in (choice rank, position) order."""
    valid_BTK = jnp.broadcast_to(valid_BT[..., None], idx_BTK.shape)
    if slots is None:
        return valid_BTK, None
    slot_BTK = slot_of(idx_BTK, valid_BT, X)
    return (slot_BTK < slots) & valid_BTK, slot_BTK


def router_losses(c: MoEConfig, logits_BTX, probs_BTX, idx_BTK, valid_BT, collectives=LOCAL):
    """(the rows' load-balancing losses summed, the tokens' z-losses summed): per row, X x sum_e f_e P_e over its
    non-padding tokens (f_e the stop-gradient count of their choices of e / their number, so the f_e sum to k;
    P_e their mean probability of e); per token, logsumexp(logits)^2. Where each row's tokens are split over
    context ranks this code runs manual over, the counts are the row's (summed over `seq`) and P_e this rank's share
    of the row's mean: the ranks' losses add up to the row's, each token's gradient from its own rank."""
    X = c.n_experts
    v_BT = valid_BT.astype(jnp.float32)
    n_B = collectives.psum(jnp.sum(v_BT, axis=1), "seq")
    per_B = jnp.where(n_B > 0, n_B, 1.0)
    chosen_BTX = jnp.sum(jax.nn.one_hot(idx_BTK, X, dtype=jnp.float32), axis=2)
    f_BX = jax.lax.stop_gradient(collectives.psum(jnp.einsum("btx,bt->bx", chosen_BTX, v_BT), "seq") / per_B[:, None])
    p_BX = jnp.einsum("btx,bt->bx", probs_BTX, v_BT) / per_B[:, None]
    balance = X * jnp.sum(f_BX * p_BX)
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_BTX, axis=-1)) * v_BT)
    return balance, z


def moe_half(c: MoEConfig, p: dict, x_BTD, call: LayerCall):
    """x + the experts of norm(x) (and the shared expert, where there is one); aux: the sums of the router losses,
    of the dropped choices and of the tokens whose rank dispatched them by the exact path after a buffer overflowed
    (models/kernels/experts.py _experts_routed) (their counts, every MoE layer's rows, tokens, choices and every
    token padding included, are `aux_counts`'s: the stack's losses are means over its MoE layers and rows (tokens),
    as MaxText's; a dense layer adds 0)."""
    if not c.sparse:
        y, _ = dense_half(c, p, x_BTD, call)
        z = jnp.zeros((), jnp.float32)
        return y, {k: z for k in AUX}
    kn, constrain = call.kernels, call.constrain
    B, T, D = x_BTD.shape
    K = c.n_experts_per_token
    h_BTD = rms_norm(x_BTD, p["mlp_norm"].astype(x_BTD.dtype), c.norm_eps)
    # the router's matmul from float32 inputs whatever the compute dtype (as MaxText and Megatron-LM): its weight in
    # bfloat16 would round the gaps between logits that choose the experts (the weight is read as stored: as_stored)
    logits_BTX = jnp.einsum("btd,dx->btx", h_BTD.astype(jnp.float32), p["router"].astype(jnp.float32))
    probs_BTX, idx_BTK, w_BTK = route(c, logits_BTX)
    valid_BT = jnp.ones((B, T), bool) if call.segments is None else call.segments != 0
    slots = None if call.decoding else capacity(c, T)
    keep_BTK, slot_BTK = kept(idx_BTK, valid_BT, c.n_experts, slots)
    w_BTK = jnp.where(keep_BTK, w_BTK, 0.0)
    weights = tuple(p[k].astype(x_BTD.dtype) for k in ("expert_gate", "expert_up", "expert_down"))
    if slots is not None:  # each kept choice's slot, for the dispatch of expert parallelism
        slots = (slot_BTK.reshape(B * T, K), slots, T)
    y_ND, over_N = grouped_mlp(h_BTD.reshape(B * T, D), idx_BTK.reshape(B * T, K), keep_BTK.reshape(B * T, K),
                               w_BTK.reshape(B * T, K).astype(x_BTD.dtype), weights, kn.silu, kn.platform,
                               collectives=call.collectives, slots=slots, routed=c.dispatch_factor, overflow=True,
                               recompute=c.remat != "none")
    y_BTD = y_ND.reshape(B, T, D)
    if "shared_gate" in p:
        s = {k: p[k].astype(x_BTD.dtype) for k in ("shared_gate", "shared_up", "shared_down", "shared_expert_gate")}
        gate_BTS, up_BTS = kn.project(h_BTD, (s["shared_gate"], s["shared_up"]))
        a_BTS = constrain(kn.silu(gate_BTS) * up_BTS, ("batch", "seq", "mlp"))
        (shared_BTD,) = kn.project(a_BTS, (s["shared_down"],))
        y_BTD = y_BTD + jax.nn.sigmoid(jnp.einsum("btd,do->bto", h_BTD, s["shared_expert_gate"])) * shared_BTD
    balance, z = router_losses(c, logits_BTX, probs_BTX, idx_BTK, valid_BT, call.collectives)
    aux = {"load_balance": balance, "z_loss": z,
           "moe/dropped": jnp.sum((~keep_BTK & valid_BT[..., None]).astype(jnp.float32)),
           "moe/overflow": jnp.sum(over_N)}
    return constrain(x_BTD + y_BTD, ("batch", "res_seq", "embed")), aux


def aux_counts(c: MoEConfig, batch: dict) -> dict:
    """Each aux output's count over a batch: its rows with a token that is not padding, those tokens, and their
    choices, each over every MoE layer (padding: segment id 0 where the model keeps to documents)."""
    seg = batch["segment_ids"]
    v = (seg != 0).astype(jnp.float32) if c.documents else jnp.ones(seg.shape, jnp.float32)
    tokens, layers = jnp.sum(v), c.n_layers if c.sparse else 0  # every layer of a sparse stack is an MoE layer
    return {"load_balance": jnp.sum(jnp.max(v, axis=1)) * layers, "z_loss": tokens * layers,
            "moe/dropped": tokens * c.n_experts_per_token * layers,
            "moe/overflow": jnp.asarray(seg.size * layers, jnp.float32)}


def aux_weights(c: MoEConfig) -> dict:
    """The losses' weights in the objective; the dropped and overflow fractions are statistics (weight 0: logged
    only)."""
    return {"load_balance": c.router_aux_loss, "z_loss": c.router_z_loss, "moe/dropped": 0.0, "moe/overflow": 0.0}


def checks(c: MoEConfig) -> list:
    k, X = c.n_experts_per_token, c.n_experts
    return [(not c.sparse or k <= X, f"model.n_experts_per_token={k} exceeds model.n_experts={X}; route each "
             "token to at most n_experts experts"),
            (c.sparse or c.capacity_factor <= 0, f"model.capacity_factor={c.capacity_factor} needs model.n_experts "
             f"> 1 (it is {X}: a dense MLP drops nothing); set n_experts or leave capacity_factor at 0"),
            (c.sparse or not c.shared_expert_d_ff, f"model.shared_expert_d_ff={c.shared_expert_d_ff} needs "
             f"model.n_experts > 1 (it is {X}); set n_experts or leave shared_expert_d_ff null")]


# every ModelSpec field of the MoE MLP (models/spec.py's contract): a family with it gives **MOE
MOE = dict(config=MoEConfig, mlp=moe_half, aux=AUX, aux_counts=aux_counts, aux_weights=aux_weights, checks=checks,
           experts_active=experts_active, experts_over=experts_over, expert_collectives=expert_collectives,
           dispatch_rows=dispatch_rows, dispatch_run=dispatch_run, experts_line=experts_line,
           context_refusal=context_refusal,
           split_keys={"mlp": ("expert_d_ff", "shared_expert_d_ff")})
MIXTRAL = register(ModelSpec("mixtral", moe_inventory(llama_inventory), layer, MIXTRAL_HF, **MOE))
QWEN3_MOE = register(ModelSpec("qwen3_moe", moe_inventory(qwen3_inventory), layer, QWEN3_MOE_HF, **MOE))
QWEN2_MOE = register(ModelSpec("qwen2_moe", moe_inventory(qwen2_inventory), layer, QWEN2_MOE_HF, **MOE))
