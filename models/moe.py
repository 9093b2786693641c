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
(its token keeps the residual), decoding drops nothing. The experts' matmuls: FORMULATIONS, one per platform
(BY_PLATFORM, measured by scripts/bench/moe_formulations.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import DIM, FLOAT32, ModelConfig, key
from models.layers import rms_norm
from models.moe_hf import MIXTRAL_HF, QWEN2_MOE_HF, QWEN3_MOE_HF
from models.moe_tpu import megablox
from models.qwen import qwen2_inventory, qwen3_inventory
from models.spec import LOCAL, LayerCall, ModelSpec, Param, register
from models.transformer import layer, llama_inventory, mlp_half as dense_half

ROUTERS = ("topk_softmax", "softmax_topk")
AUX = ("load_balance", "z_loss", "moe/dropped")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(ModelConfig):
    """An MoE family's model: the shared keys and these (n_experts <= 1: the dense SwiGLU MLP of d_ff)."""
    n_experts: int = key(8, ">= 0 and <= 65536", "MoE: experts per layer; 0 or 1: the dense MLP")
    n_experts_per_token: int = key(2, "> 0 and <= 65536", "MoE: experts each token is routed to (top-k)")
    expert_d_ff: int | None = key(None, DIM, "MoE: each expert's hidden units; null: d_ff")
    capacity_factor: float = key(0.0, f">= -{FLOAT32} and <= {FLOAT32}", "MoE: slots per expert per row = "
                                 "ceil(T k / n_experts x this); <= 0: dropless")
    router_aux_loss: float = key(0.0, f">= 0 and <= {FLOAT32}", "MoE: weight of the per-row load-balancing loss in "
                                 "the objective (logged as aux/load_balance)")
    router_z_loss: float = key(0.0, f">= 0 and <= {FLOAT32}", "MoE: weight of the router z-loss in the objective "
                               "(logged as aux/z_loss)")
    router: str = key("topk_softmax", ROUTERS, "MoE: topk_softmax (Mixtral) or softmax_topk (Qwen-MoE)")
    norm_topk_prob: bool = key(True, None, "MoE softmax_topk: the k probabilities divided by their sum")
    shared_expert_d_ff: int | None = key(None, DIM, "MoE: a shared expert of this width behind a sigmoid gate "
                                         "(Qwen2-MoE); null: none")

    @property
    def sparse(self) -> bool:
        return self.n_experts > 1

    @property
    def experts_active(self) -> int:
        """Experts a token runs (models/counts.py counts an expert weight at this many of its n_experts)."""
        return self.n_experts_per_token

    def experts_over(self, ranks: int) -> str | None:
        """Why this model's experts cannot be split over `ranks` data ranks (trainer/config: expert parallelism),
        or None."""
        if not self.sparse:
            return f"model.n_experts={self.n_experts} is a dense MLP: nothing to split"
        if self.n_experts % ranks:
            return (f"model.n_experts={self.n_experts} is not divisible by mesh.data={ranks} (each data rank holds "
                    f"n_experts / mesh.data experts)")
        return None

    def expert_collectives(self, tokens: int, ranks: int, a: int) -> list[tuple[str, str, float, bool, bool]]:
        """One MoE layer's forward collectives over `data` under expert parallelism (grouped_mlp), for `tokens` tokens
        per rank on `ranks` ranks, a bytes of the compute dtype (trainer/plan/comm.py): (kind, what, bytes of the
        array as trainer/plan/comm.py counts it, whether its transpose runs in the backward, whether a recomputed
        forward runs it again: what the backward reads)."""
        K, D, T = self.n_experts_per_token, self.d_model, self.seq_len
        C = capacity(self, T)
        if C is None:  # _experts_gathered: every rank's tokens, choices and weights gathered, the outputs scattered
            n = ranks * tokens  # (the outputs are weighted before their sum: the backward does not read them)
            return [("all-gather", "tokens to every rank", n * D * a, True, True),
                    ("all-gather", "choices", n * K * 4, False, True),
                    ("all-gather", "routing weights", n * K * a, True, True),
                    ("reduce-scatter", "expert outputs summed to their tokens", n * D * a, True, False)]
        slots = self.n_experts * (tokens // T) * C * D * a  # _experts_all_to_all: this rank's buffer
        # (the outputs come back unweighted: the routing weights' gradient reads them)
        return [("all-to-all", "tokens to their experts' slots", slots, True, True),
                ("all-to-all", "the slots' outputs back", slots, True, True)]

    def widths_over_model(self, tp: int) -> dict:
        """The fields of one `model` rank's widths (trainer/plan/memory.py): each expert's and the shared expert's
        hidden units split over `model`, as the dense MLP's."""
        return {k: getattr(self, k) // tp for k in ("expert_d_ff", "shared_expert_d_ff") if getattr(self, k)}

    def dispatch_rows(self, tokens: int, platform: str) -> int:
        """Rows the expert MLP's dispatch holds for `tokens` tokens on `platform` (trainer/plan/memory.py): one per
        choice; on CPU (tile_scan) each expert's padded to whole tiles."""
        M = tokens * self.n_experts_per_token
        return padded_tiles(M, self.n_experts) * TILE if BY_PLATFORM.get(platform) == "tile_scan" else M


def moe_inventory(base):
    """The inventory of `base` (a dense family's) with the MLP's weights replaced by the router and the experts."""
    def inventory(c: MoEConfig) -> dict:
        inv = base(c)
        if not c.sparse:
            return inv
        D, X, F = c.d_model, c.n_experts, c.expert_d_ff or c.d_ff
        layers = {k: v for k, v in inv["layers"].items() if k not in ("w_gate", "w_up", "w_down")}
        layers.update(router=Param((D, X), ("embed", None), "normal", False),
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
    """Which choices take a slot (B, T, k) bool: every non-padding choice when dropless; with `slots` per expert
    per row, the first ones in (choice rank, position) order (slot_of)."""
    valid_BTK = jnp.broadcast_to(valid_BT[..., None], idx_BTK.shape)
    if slots is None:
        return valid_BTK
    return (slot_of(idx_BTK, valid_BT, X) < slots) & valid_BTK


def router_losses(c: MoEConfig, logits_BTX, probs_BTX, idx_BTK, valid_BT):
    """(the rows' load-balancing losses summed, the tokens' z-losses summed): per row, X x sum_e f_e P_e over its
    non-padding tokens (f_e the stop-gradient count of their choices of e / their number, so the f_e sum to k;
    P_e their mean probability of e); per token, logsumexp(logits)^2."""
    X = c.n_experts
    v_BT = valid_BT.astype(jnp.float32)
    n_B = jnp.sum(v_BT, axis=1)
    per_B = jnp.where(n_B > 0, n_B, 1.0)
    chosen_BTX = jnp.sum(jax.nn.one_hot(idx_BTK, X, dtype=jnp.float32), axis=2)
    f_BX = jax.lax.stop_gradient(jnp.einsum("btx,bt->bx", chosen_BTX, v_BT) / per_B[:, None])
    p_BX = jnp.einsum("btx,bt->bx", probs_BTX, v_BT) / per_B[:, None]
    balance = X * jnp.sum(f_BX * p_BX)
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_BTX, axis=-1)) * v_BT)
    return balance, z


def all_experts(h_ND, idx_NK, w_NK, weights, silu):
    """Every expert on every token, each output weighted by the token's weight for it (0 unless chosen)."""
    gate, up, down = weights
    comb_NX = jnp.einsum("nk,nkx->nx", w_NK, jax.nn.one_hot(idx_NK, gate.shape[0], dtype=w_NK.dtype))
    a_XNF = silu(jnp.einsum("nd,xdf->xnf", h_ND, gate)) * jnp.einsum("nd,xdf->xnf", h_ND, up)
    return jnp.einsum("xnf,xfd->nd", a_XNF * comb_NX.T[:, :, None], down)


def _by_expert(idx_NK, keep_NK, X: int):
    """The choices sorted by expert, a dropped one after the last: (order (M,) of the choices, each sorted
    choice's expert (M,), X for a dropped one, the kept choices of each expert (X,) int32)."""
    e_M = jnp.where(keep_NK, idx_NK, X).reshape(-1)
    order_M = jnp.argsort(e_M, stable=True)
    return order_M, e_M[order_M], jnp.sum(jax.nn.one_hot(e_M, X, dtype=jnp.int32), axis=0)


def ragged(h_ND, idx_NK, keep_NK, w_NK, weights, silu):
    """The choices sorted by expert, each expert's rows through its weights by jax.lax.ragged_dot."""
    gate, up, down = weights
    K = idx_NK.shape[1]
    order_M, _, sizes_X = _by_expert(idx_NK, keep_NK, gate.shape[0])
    token_M = order_M // K
    x_MD = h_ND[token_M]
    a_MF = silu(jax.lax.ragged_dot(x_MD, gate, sizes_X)) * jax.lax.ragged_dot(x_MD, up, sizes_X)
    y_MD = jax.lax.ragged_dot(a_MF, down, sizes_X) * w_NK.reshape(-1)[order_M][:, None]
    return jnp.zeros_like(h_ND).at[token_M].add(y_MD)


TILE = 128  # rows of a tile of `tiles` and `tile_scan`


def padded_tiles(M: int, X: int, t: int = TILE) -> int:
    """Tiles of t rows that hold M choices, each expert's padded to whole tiles: sum over experts of
    ceil(rows / t) is at most this."""
    return -(-M // t) + X


def _tiles(idx_NK, keep_NK, X: int, t: int):
    """The choices sorted by expert and each expert's rows padded to whole tiles of t rows: (order (M,), each
    sorted choice's row in the tiles ((M,), past the end for a dropped one), the tiles' experts (nT,))."""
    M = idx_NK.size
    nT = padded_tiles(M, X, t)
    order_M, e_M, sizes_X = _by_expert(idx_NK, keep_NK, X)
    padded_X = -(-sizes_X // t) * t
    start_X, pstart_X = jnp.cumsum(sizes_X) - sizes_X, jnp.cumsum(padded_X) - padded_X
    e = jnp.minimum(e_M, X - 1)
    row_M = jnp.where(e_M < X, pstart_X[e] + jnp.arange(M) - start_X[e], nT * t)
    tile_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded_X), jnp.arange(nT) * t, side="right"), X - 1)
    return order_M, row_M, tile_expert, nT


def tiles(h_ND, idx_NK, keep_NK, w_NK, weights, silu, t: int = TILE):
    """Sorted and padded to tiles of t rows (_tiles); every tile through its expert's weights, gathered
    per tile, in one batched matmul."""
    gate, up, down = weights
    (N, D), K = h_ND.shape, idx_NK.shape[1]
    order_M, row_M, tile_expert, nT = _tiles(idx_NK, keep_NK, gate.shape[0], t)
    x_PD = jnp.zeros((nT * t, D), h_ND.dtype).at[row_M].set(h_ND[order_M // K], mode="drop")
    x_JtD = x_PD.reshape(nT, t, D)
    a_JtF = silu(jnp.einsum("jtd,jdf->jtf", x_JtD, gate[tile_expert])) * jnp.einsum("jtd,jdf->jtf", x_JtD,
                                                                                   up[tile_expert])
    y_PD = jnp.einsum("jtf,jfd->jtd", a_JtF, down[tile_expert]).reshape(nT * t, D)
    y_MD = y_PD.at[row_M].get(mode="fill", fill_value=0) * w_NK.reshape(-1)[order_M][:, None]
    return jnp.zeros_like(h_ND).at[order_M // K].add(y_MD)


def tile_scan(h_ND, idx_NK, keep_NK, w_NK, weights, silu, t: int = TILE):
    """As `tiles`, the tiles run one at a time by lax.scan, each indexing its expert's weights (no per-tile copy of
    the weights, forward or backward: `_expert_tiles`)."""
    gate, up, down = weights
    (N, D), K = h_ND.shape, idx_NK.shape[1]
    order_M, row_M, tile_expert, nT = _tiles(idx_NK, keep_NK, gate.shape[0], t)
    x_PD = jnp.zeros((nT * t, D), h_ND.dtype).at[row_M].set(h_ND[order_M // K], mode="drop")
    y_PD = _expert_tiles(silu, x_PD.reshape(nT, t, D), tile_expert, gate, up, down).reshape(nT * t, D)
    y_MD = y_PD.at[row_M].get(mode="fill", fill_value=0) * w_NK.reshape(-1)[order_M][:, None]
    return jnp.zeros_like(h_ND).at[order_M // K].add(y_MD)


def _tile_mlp(silu, x_tD, g_DF, u_DF):
    h_tF, u_tF = x_tD @ g_DF, x_tD @ u_DF
    return silu(h_tF) * u_tF, (h_tF, u_tF)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _expert_tiles(silu, x_JtD, e_J, gate, up, down):
    """Tile j of rows (J, t, D) through expert e_J[j]'s SwiGLU MLP, by lax.scan. Autodiff of the scan would save
    each tile's slice of the weights and stack each tile's weight gradient (J copies of an expert's weights);
    here the backward scan adds each tile's weight gradients into the experts' in place, and keeps only the
    tiles' two (t, F) hidden projections."""
    return _expert_tiles_fwd(silu, x_JtD, e_J, gate, up, down)[0]


def _expert_tiles_fwd(silu, x_JtD, e_J, gate, up, down):
    def one(_, xe):
        x_tD, e = xe
        a_tF, hu = _tile_mlp(silu, x_tD, gate[e], up[e])
        return None, (a_tF @ down[e], hu)
    y_JtD, hu_J = jax.lax.scan(one, None, (x_JtD, e_J))[1]
    return y_JtD, (x_JtD, e_J, gate, up, down, hu_J)


def _expert_tiles_bwd(silu, res, dy_JtD):
    x_JtD, e_J, gate, up, down, hu_J = res

    def one(grads, xs):
        x_tD, e, (h_tF, u_tF), dy_tD = xs
        (s_tF, silu_vjp) = jax.vjp(silu, h_tF)
        da_tF = dy_tD @ down[e].T
        dh_tF, du_tF = silu_vjp(da_tF * u_tF)[0], da_tF * s_tF
        f32 = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)  # summed over tiles in float32
        dg, du, dd = grads
        dg = dg.at[e].add(f32(x_tD.T, dh_tF))
        du = du.at[e].add(f32(x_tD.T, du_tF))
        dd = dd.at[e].add(f32((s_tF * u_tF).T, dy_tD))
        return (dg, du, dd), dh_tF @ gate[e].T + du_tF @ up[e].T
    zeros = tuple(jnp.zeros(w.shape, jnp.float32) for w in (gate, up, down))
    grads, dx_JtD = jax.lax.scan(one, zeros, (x_JtD, e_J, hu_J, dy_JtD))
    return (dx_JtD, None, *(g.astype(w.dtype) for g, w in zip(grads, (gate, up, down))))


_expert_tiles.defvjp(_expert_tiles_fwd, _expert_tiles_bwd)


FORMULATIONS = {"all_experts": lambda h, i, k, w, ws, f: all_experts(h, i, w, ws, f), "ragged_dot": ragged,
                "tiles": tiles, "tile_scan": tile_scan, "megablox": megablox}
# the formulation each platform runs (scripts/bench/moe_formulations.py measured the CPU's; docs/performance.md);
# `megablox`: the TPU's Pallas kernel (models/moe_tpu.py), in Pallas's interpreter off TPU
BY_PLATFORM = {"cpu": "tile_scan", "gpu": "ragged_dot", "tpu": "megablox"}
TOKENS, CHOICES = ("batch", "embed"), ("batch", None)
IN_AXES = (TOKENS, CHOICES, CHOICES, CHOICES,
           (("experts", "embed", "mlp"), ("experts", "embed", "mlp"), ("experts", "mlp", "embed")))


def grouped_mlp(h_ND, idx_NK, keep_NK, w_NK, weights, silu, platform: str = "cpu", impl: str | None = None,
                collectives=LOCAL, slots: tuple | None = None):
    """sum over each token's kept choices of weight x SwiGLU expert(h): the platform's formulation, or `impl`.
    Where the run's rules split the experts over `data` (expert parallelism), each rank's tokens reach the ranks
    holding their experts: with a capacity (`slots`: (each choice's slot (N, k), slots per expert per row, tokens
    per row)) by all-to-all in fixed per-row slots; dropless, the ranks' tokens gathered and the results
    reduce-scattered (_experts_gathered)."""
    name = impl or BY_PLATFORM.get(platform, "ragged_dot")
    fn = FORMULATIONS[name]
    if name == "megablox":
        fn = functools.partial(fn, interpret=platform != "tpu")

    # manual over every axis (XLA cannot partition megablox's Mosaic kernel; the others gain by it too): each data
    # rank sorts and runs its own tokens (a sort over the whole batch gathered it onto every rank: 4.9x the planner's
    # bytes at (8,1,1), tests/test_moe_plan.py), through its slice of the experts' hidden units, the down
    # projection's partial sums added over `mlp` once, after the combine (N x D, not N x k x D)
    def rank(h, i, k, w, ws, slot):
        if collectives.axis_size("experts") == 1:
            y = fn(h, i, k, w, ws, silu)
        elif slots is None:
            y = _experts_gathered(fn, collectives, h, i, k, w, ws, silu)
        else:
            y = _experts_all_to_all(collectives, h, i, k, w, ws, silu, slot, *slots[1:])
        return collectives.psum(y, "mlp")
    slot_NK = jnp.zeros_like(idx_NK) if slots is None else slots[0]
    return collectives.region(rank, IN_AXES + (CHOICES,), TOKENS)(h_ND, idx_NK, keep_NK, w_NK, tuple(weights),
                                                                   slot_NK)


def _local_choices(coll, idx_NK, keep_NK, El: int):
    """(each choice's expert among this rank's El (clipped), whether it is kept and this rank's)."""
    local_NK = idx_NK - coll.axis_index("experts") * El
    return jnp.clip(local_NK, 0, El - 1), keep_NK & (local_NK >= 0) & (local_NK < El)


def _experts_gathered(fn, coll, h_ND, idx_NK, keep_NK, w_NK, weights, silu):
    """Dropless expert parallelism: every rank's tokens and choices gathered over `experts` (in rank order: the
    batch's order, so each expert sees its tokens in the order one device does), this rank's experts run on the
    choices of them, the results summed over the ranks and scattered back to the tokens' ranks (MaxText's ring of
    experts: no buffer sized by the worst case)."""
    gather = functools.partial(coll.all_gather, logical="experts", axis=0)
    X = weights[0].shape[0] * coll.axis_size("experts")
    # a choice that is not kept (padding) travels as expert X, held by no rank
    h, idx, w = gather(h_ND), gather(jnp.where(keep_NK, idx_NK, X)), gather(w_NK)
    local, mine = _local_choices(coll, idx, jnp.ones(idx.shape, bool), weights[0].shape[0])
    y = fn(h, local, mine, jnp.where(mine, w, 0), weights, silu)
    return coll.reduce_scatter(y, "experts", 0)


def _experts_all_to_all(coll, h_ND, idx_NK, keep_NK, w_NK, weights, silu, slot_NK, C: int, T: int):
    """Expert parallelism with a capacity (GShard's dispatch): each rank's kept choices written into a buffer of C
    slots per expert per row, (X, rows, C, D), whose experts' blocks go to the ranks holding them by all-to-all over
    `experts`; each rank runs its experts on every slot it received (an empty slot is zeros and gives zeros), and
    the results come back by the reverse all-to-all and are combined with the routing weights. Bytes known before
    the step: X x rows x C x D each way."""
    gate, up, down = weights
    (N, D), K, El, R = h_ND.shape, idx_NK.shape[1], gate.shape[0], coll.axis_size("experts")
    X, B = El * R, N // T
    row_NK = jnp.broadcast_to((jnp.arange(N) // T)[:, None], (N, K))
    at_NK = jnp.where(keep_NK, (idx_NK * B + row_NK) * C + slot_NK, X * B * C)  # past the end: dropped
    token_NK = jnp.broadcast_to(jnp.arange(N)[:, None], (N, K))
    buf = jnp.zeros((X * B * C, D), h_ND.dtype).at[at_NK.reshape(-1)].set(h_ND[token_NK.reshape(-1)], mode="drop")
    got = coll.all_to_all(buf.reshape(X, B, C, D), "experts", 0, 1)  # (El, R B, C, D): my experts' slots
    x = got.reshape(El, R * B * C, D)
    a = silu(jnp.einsum("end,edf->enf", x, gate)) * jnp.einsum("end,edf->enf", x, up)
    y = jnp.einsum("enf,efd->end", a, down).reshape(El, R * B, C, D)
    back = coll.all_to_all(y, "experts", 1, 0).reshape(X * B * C, D)  # (X, B, C, D): my tokens' outputs
    y_NKD = back.at[at_NK].get(mode="fill", fill_value=0)
    return jnp.einsum("nk,nkd->nd", w_NK, y_NKD)


def moe_half(c: MoEConfig, p: dict, x_BTD, call: LayerCall):
    """x + the experts of norm(x) (and the shared expert, where there is one); aux: the router losses and the
    dropped choices, each (sum, count) (the counts of the two losses given by layer 0 of the stack only, call.data
    ["first"], so that the stack's are the rows and tokens: a mean over rows of the losses summed over layers)."""
    if not c.sparse:
        y, _ = dense_half(c, p, x_BTD, call)
        z = jnp.zeros((), jnp.float32)
        return y, {k: (z, z) for k in AUX}
    kn, constrain = call.kernels, call.constrain
    B, T, D = x_BTD.shape
    K = c.n_experts_per_token
    h_BTD = rms_norm(x_BTD, p["mlp_norm"].astype(x_BTD.dtype), c.norm_eps)
    logits_BTX = jnp.einsum("btd,dx->btx", h_BTD, p["router"].astype(h_BTD.dtype),
                            preferred_element_type=jnp.float32)
    probs_BTX, idx_BTK, w_BTK = route(c, logits_BTX)
    valid_BT = jnp.ones((B, T), bool) if call.segments is None else call.segments != 0
    slots = None if call.decoding else capacity(c, T)
    keep_BTK = kept(idx_BTK, valid_BT, c.n_experts, slots)
    w_BTK = jnp.where(keep_BTK, w_BTK, 0.0)
    weights = tuple(p[k].astype(x_BTD.dtype) for k in ("expert_gate", "expert_up", "expert_down"))
    if slots is not None:  # each kept choice's slot, for the dispatch of expert parallelism
        slots = (slot_of(idx_BTK, valid_BT, c.n_experts).reshape(B * T, K), slots, T)
    y_ND = grouped_mlp(h_BTD.reshape(B * T, D), idx_BTK.reshape(B * T, K), keep_BTK.reshape(B * T, K),
                       w_BTK.reshape(B * T, K).astype(x_BTD.dtype), weights, kn.silu, kn.platform,
                       collectives=call.collectives, slots=slots)
    y_BTD = y_ND.reshape(B, T, D)
    if "shared_gate" in p:
        s = {k: p[k].astype(x_BTD.dtype) for k in ("shared_gate", "shared_up", "shared_down", "shared_expert_gate")}
        gate_BTS, up_BTS = kn.project(h_BTD, (s["shared_gate"], s["shared_up"]))
        a_BTS = constrain(kn.silu(gate_BTS) * up_BTS, ("batch", "seq", "mlp"))
        (shared_BTD,) = kn.project(a_BTS, (s["shared_down"],))
        y_BTD = y_BTD + jax.nn.sigmoid(jnp.einsum("btd,do->bto", h_BTD, s["shared_expert_gate"])) * shared_BTD
    balance, z = router_losses(c, logits_BTX, probs_BTX, idx_BTK, valid_BT)
    v = valid_BT.astype(jnp.float32)
    first = call.data["first"]
    rows, tokens = jnp.sum(jnp.max(v, axis=1)), jnp.sum(v)
    aux = {"load_balance": (balance, rows * first), "z_loss": (z, tokens * first),
           "moe/dropped": (jnp.sum((~keep_BTK & valid_BT[..., None]).astype(jnp.float32)), tokens * K)}
    return constrain(x_BTD + y_BTD, ("batch", "seq", "embed")), aux


def layer_data(c: MoEConfig) -> dict:
    """1.0 at the stack's first layer (which reports the losses' counts): float32, as a remat'd half may close
    over floats only."""
    return {"first": np.asarray([1.0] + [0.0] * (c.n_layers - 1), np.float32)}


def aux_counts(c: MoEConfig, batch: dict) -> dict:
    """Each aux output's count over a batch: its rows with a token that is not padding, those tokens, and their
    choices over every layer (padding: segment id 0 where the model keeps to documents)."""
    seg = batch["segment_ids"]
    v = (seg != 0).astype(jnp.float32) if c.documents else jnp.ones(seg.shape, jnp.float32)
    tokens = jnp.sum(v)
    return {"load_balance": jnp.sum(jnp.max(v, axis=1)), "z_loss": tokens,
            "moe/dropped": tokens * c.n_experts_per_token * c.n_layers}


def aux_weights(c: MoEConfig) -> dict:
    """The losses' weights in the objective; the dropped fraction is a statistic (weight 0: logged only)."""
    return {"load_balance": c.router_aux_loss, "z_loss": c.router_z_loss, "moe/dropped": 0.0}


def checks(c: MoEConfig) -> list:
    k, X = c.n_experts_per_token, c.n_experts
    return [(not c.sparse or k <= X, f"model.n_experts_per_token={k} exceeds model.n_experts={X}; route each "
             "token to at most n_experts experts"),
            (c.sparse or c.capacity_factor <= 0, f"model.capacity_factor={c.capacity_factor} needs model.n_experts "
             f"> 1 (it is {X}: a dense MLP drops nothing); set n_experts or leave capacity_factor at 0"),
            (c.sparse or not c.shared_expert_d_ff, f"model.shared_expert_d_ff={c.shared_expert_d_ff} needs "
             f"model.n_experts > 1 (it is {X}); set n_experts or leave shared_expert_d_ff null")]


SPEC = dict(config=MoEConfig, mlp=moe_half, layer_data=layer_data, aux=AUX, aux_counts=aux_counts, aux_weights=aux_weights, checks=checks)
MIXTRAL = register(ModelSpec("mixtral", moe_inventory(llama_inventory), layer, MIXTRAL_HF, **SPEC))
QWEN3_MOE = register(ModelSpec("qwen3_moe", moe_inventory(qwen3_inventory), layer, QWEN3_MOE_HF, **SPEC))
QWEN2_MOE = register(ModelSpec("qwen2_moe", moe_inventory(qwen2_inventory), layer, QWEN2_MOE_HF, **SPEC))
