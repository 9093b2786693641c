"""Parameter and FLOP counts, read from the family's inventory (models/spec.py).

FLOP convention (used for MFU everywhere in meshtrain):
  training FLOPs per token = 6 * N  +  6 * L * T * H * Dh   (Dh: (the query/key width + the value width) / 2,
                                                             the family's qk_v_width / 2: head_dim for most)
  N   = parameters that take part in matmuls (attention and MLP weights of every layer,
        plus the output head; the embedding lookup is a gather and norms are elementwise,
        so neither is counted). A tied head counts its V*D once, as the head.
  6   = 2 FLOPs per multiply-add x (1 forward + 2 backward).
  attention: QK^T and PV are 2 * 2 * T * Dh FLOPs per head per token forward; x3 for
        training gives 12 * L * T * H * Dh; causal masking halves the useful work -> 6.
Multi-token prediction (model.mtp_depth = D) adds D layers (each with its eh_proj, 2D x D) and D more heads.
Remat recomputation is not model FLOPs; `hardware_flops_per_token` adds it.
The matmul weights are the inventory's per-layer parameters with an `embed` axis and at least one other (norm
weights and biases are elementwise). A Mixture of Experts counts its active weights: an expert weight (axis
`experts`, E experts) counts k/E of its size (k = model.n_experts_per_token: a token runs k of the E experts), its
router and a shared expert whole; what a formulation of the experts' matmuls executes beyond that (every expert
on every token, groups padded to whole tiles) is not model FLOPs. With a sliding window (model.window = w < T)
the attention term counts the keys each query sees: 12 * L * H * Dh * (w - w^2 / 2T) in place of
12 * L * H * Dh * T / 2 (`attended`); a stack whose layers differ in window (its family's `windows`: Gemma's local
and global layers) counts each layer by its own.
"""
from __future__ import annotations

import math

from models.config import ModelConfig
from models.spec import family, stacks
from models.transformer import STACKS, inventory


def active_size(c: ModelConfig, p) -> int:
    """The part of parameter `p` a token uses: of an expert weight (axis `experts`) its k experts, else all of it."""
    k = family(c.family).experts_active(c)  # an MoE family's top-k (models/spec.py); None, no routing: every expert
    if "experts" not in p.axes or k is None:
        return math.prod(p.shape)
    return math.prod(p.shape) // p.shape[p.axes.index("experts")] * k


def _matmul(p) -> bool:
    """Whether an inventory entry is a matmul weight: two or more dimensions besides an `experts` one, mapping the
    embedding to something or back (an `embed` axis) or a low rank up (a first axis of no logical name: latent
    attention's up-projections); biases (an expert's (X, D) too) and norm weights are elementwise."""
    dims = [a for a in p.axes if a != "experts"]
    return len(dims) >= 2 and ("embed" in p.axes or p.axes[0] is None)


def layer_matmul_params(c: ModelConfig, stack: str = "layers") -> int:
    """Active matmul weights of one layer of a stack (models/spec.py `stacks`), each by `active_size`."""
    return sum(active_size(c, p) for p in inventory(c)[stack].values() if _matmul(p))


def with_modules(c: ModelConfig) -> dict:
    """`stacks`, and the multi-token-prediction modules (model.mtp_depth) as a stack "mtp" of that many layers (each
    a decoder layer with its eh_proj)."""
    return {**stacks(c), **({"mtp": c.mtp_depth} if c.mtp_depth else {})}


def stack_matmul_params(c: ModelConfig) -> int:
    """Active matmul weights of every layer of every stack, the prediction modules' included."""
    return sum(rows * layer_matmul_params(c, stack) for stack, rows in with_modules(c).items())


def _all_params(c: ModelConfig, size) -> int:
    inv = inventory(c)
    outer = sum(math.prod(p.shape) for k, p in inv.items() if k not in STACKS + ("mtp",))
    return outer + sum(rows * sum(size(p) for p in inv[stack].values()) for stack, rows in with_modules(c).items())


def param_count(c: ModelConfig) -> int:
    """All parameters (embedding, norms and head included)."""
    return _all_params(c, lambda p: math.prod(p.shape))


def active_param_count(c: ModelConfig) -> int:
    """The parameters a token uses: param_count with each expert weight at k/E (`active_size`)."""
    return _all_params(c, lambda p: active_size(c, p))


def matmul_param_count(c: ModelConfig) -> int:
    """N of the FLOP convention: active layer matmul weights plus the output head (tied or not), which each
    prediction module runs once more."""
    return stack_matmul_params(c) + (1 + c.mtp_depth) * c.d_model * c.vocab_size


def attended(c: ModelConfig, t: int) -> float:
    """Keys a query attends to on average over the stack's layers, by the convention: t / 2 (causal); with a
    sliding window w < t, w - w^2 / (2t) (each query sees min(position + 1, w) keys, in the same continuous form;
    equal at w = t); a stack whose layers differ in window averages its layers' counts."""
    def one(w):
        return t / 2 if not w or w >= t else w - w * w / (2 * t)
    windows = family(c.family).windows(c)
    if windows is None:
        return one(c.window)
    return sum(one(w) for w in windows) / len(windows)


def flops_per_token(c: ModelConfig, seq_len: int | None = None) -> float:
    """Model training FLOPs per token (the convention above)."""
    t = seq_len or c.seq_len
    layers = c.n_layers + c.mtp_depth  # each prediction module's layer attends as the stack's do
    return 6 * matmul_param_count(c) + 6 * layers * attended(c, t) * c.n_heads * family(c.family).qk_v_width(c)


def hardware_flops_per_token(c: ModelConfig, seq_len: int | None = None) -> float:
    """FLOPs executed per token, counting remat's recomputed forward (same convention).

    full: the layer forward runs again, except its last projection (the MLP's output, d_ff x d_model), whose
    output the backward pass does not need; dots: projection outputs are saved, but the attention score/value
    products (batched dots) are recomputed; sublayer: as full, less the attention's output projection too (each
    half's backward needs its input, not its output). An MoE's experts' down projection runs again too: the routing
    weight multiplies its output, which the router's gradient needs (a shared expert's, for its sigmoid gate).
    """
    t = seq_len or c.seq_len
    attn_fwd = 2 * c.n_layers * attended(c, t) * c.n_heads * family(c.family).qk_v_width(c)
    full = attn_fwd
    for stack, rows in stacks(c).items():
        experts = any("experts" in p.axes for p in inventory(c)[stack].values())
        full += 2 * rows * (layer_matmul_params(c, stack) - (0 if experts else c.d_model * c.d_ff))
    v_width = family(c.family).qk_v_width(c) - c.head_dim  # the output projection maps H values of this width
    wo = 2 * c.n_layers * c.n_heads * v_width * c.d_model
    extra = {"none": 0, "full": full, "dots": attn_fwd, "sublayer": full - wo}[c.remat]
    return flops_per_token(c, seq_len) + extra
