"""Low-rank adapters (LoRA, as peft computes them): for each chosen projection W (out x in in Hugging Face's terms),
y = W x + scale B A x, A (r, in) drawn as peft draws it (Kaiming-uniform), B (out, r) zero (step 0 is the base),
scale = alpha / r (alpha / sqrt(r) with use_rslora). The base is frozen: only the adapters (and model.lora.modules,
whole weights trained too, peft's modules_to_save) are trained.

Which projections: named as the family's Hugging Face adapter names them (`q_proj`, `down_proj`, ...; "all-linear":
every projection of a decoder layer), found through its leaves (models/hf/), so that every family with an adapter
takes them. Each adapter lives in its layer's stack beside its base weight, `<weight>_lora_a` with the base's input
axes (and its logical names) and the rank last, `<weight>_lora_b` the rank first and the base's output axes: sharded,
gathered (ZeRO-3), pipelined and checkpointed as the base weight is, on every layout. A layer's weights are merged as
the layer runs (`merged`: W + scale (A B) laid out as W, the base behind a stop-gradient), so every family's layer
function, kernel and context strategy runs unchanged.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.spec import Param

A, B = "_lora_a", "_lora_b"
MERGED = "lora_merged"  # the checkpoint name of a merged weight W + scale A B
# peft's target_parameters of transformers 5's packed experts ((E, 2F, D) gate then up, (E, D, F) down) and the
# adapters meshtrain holds for them: gate/up share one A (X, D, r) and one B (X, r, 2, F); down A (X, F, r), B (X, r, D)
EXPERTS = {"mlp.experts.gate_up_proj": "experts_gate_up", "mlp.experts.down_proj": "experts_down"}


@dataclasses.dataclass(frozen=True)
class Lora:
    """model.lora: the rank (0: off), alpha, dropout (of the adapters' input), rsLoRA's scale, the target projections
    (HF module names, or "all-linear"), the whole weights trained beside (HF module names: embed_tokens, lm_head)."""
    rank: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False
    targets: tuple = ("q_proj", "v_proj")
    modules: tuple = ()
    base_dtype: str = "float32"  # the frozen base's storage (bfloat16: half its bytes); adapters float32
    fused_gate_up: bool = False  # the experts' gate_up adapter at 2 rank and 2 alpha (peft's rank/alpha_pattern)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def gate_up(self) -> tuple[int, float]:
        """(rank, scale) of the experts' gate_up adapter: twice the rank and alpha where fused."""
        k = 2 if self.fused_gate_up else 1
        return k * self.rank, k * self.alpha / (math.sqrt(k * self.rank) if self.rslora else k * self.rank)


def hf_module(name: str) -> str:
    """The module name peft targets of an HF tensor name: 'model.layers.3.self_attn.q_proj.weight' -> 'q_proj'."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]


def targets(c, leaves) -> dict:
    """{stack param name: (HF module name, the Leaf)} of the projections model.lora adapts: each stacked 2-D HF weight
    of a decoder layer whose module name is a target (every one for "all-linear"); a target the family has not is a
    ValueError naming the ones it has."""
    lora = c.lora
    layer = {lf.path[1]: lf for lf in leaves if lf.stacked and lf.path[0] == "layers" and len(lf.hf_shape) == 2
             and lf.names[0].endswith(".weight") and not lf.lead}
    have = {hf_module(lf.names[0]): k for k, lf in layer.items() if "norm" not in hf_module(lf.names[0])}
    wanted = tuple(have) if "all-linear" in lora.targets else tuple(t for t in lora.targets if t not in EXPERTS)
    if missing := [t for t in wanted if t not in have]:
        raise ValueError(f"model.lora.targets names {', '.join(missing)}, which {c.family} has not; its projections: "
                         f"{', '.join(sorted(have))} (or all-linear)")
    return {have[t]: (t, layer[have[t]]) for t in wanted}


def split_axes(leaf) -> tuple[list[int], list[int]]:
    """(the base parameter's axes that are HF's input, those that are its output) of a 2-D (out, in) HF weight: the
    leaf's view splits out into its first view axes and in into the rest; the parameter is the view transposed."""
    out, k = leaf.hf_shape[0], 0
    while math.prod(leaf.view[:k]) != out:
        k += 1
    # per-layer parameter axis j is view axis leaf.perm[j]
    return [j for j, v in enumerate(leaf.perm) if v >= k], [j for j, v in enumerate(leaf.perm) if v < k]


def adapter_params(c, base: dict, leaves) -> dict:
    """The adapters' inventory entries of a stack's base params: A (input axes..., r), B (r, output axes...), each
    axis the base's logical name, trainable, not decayed (peft's default: the optimizer decays what the run decays;
    meshtrain decays matmul weights, so these are)."""
    out = {}
    for k, (_, leaf) in targets(c, leaves).items():
        p = base[k]
        ins, outs = split_axes(leaf)
        r = c.lora.rank
        out[k + A] = Param(tuple(p.shape[j] for j in ins) + (r,), tuple(p.axes[j] for j in ins) + (None,),
                           "lora_a", True)
        out[k + B] = Param((r,) + tuple(p.shape[j] for j in outs), (None,) + tuple(p.axes[j] for j in outs),
                           "zeros", True)
    return out


def expert_targets(c) -> tuple:
    """The packed-expert parameters model.lora adapts (EXPERTS' keys), of a family whose experts are expert_gate,
    expert_up and expert_down; a family without them is a ValueError."""
    chosen = tuple(t for t in c.lora.targets if t in EXPERTS)
    if chosen:
        from models.spec import family
        layers = family(c.family).inventory(c)["layers"]
        if not {"expert_gate", "expert_up", "expert_down"} <= set(layers):
            raise ValueError(f"model.lora.targets names {', '.join(chosen)}, but {c.family} has no experts of gate, up "
                             "and down projections")
    return chosen


def expert_params(c, base: dict) -> dict:
    """The packed experts' adapters (EXPERTS), their axes the experts' logical names."""
    out, r = {}, c.lora.rank
    for t in expert_targets(c):
        if EXPERTS[t] == "experts_gate_up":
            X, D, F = base["expert_gate"].shape
            rg = c.lora.gate_up[0]
            out["experts_gate_up" + A] = Param((X, D, rg), ("experts", "embed", None), "lora_a_experts", True)
            out["experts_gate_up" + B] = Param((X, rg, 2, F), ("experts", None, None, "mlp"), "zeros", True)
        else:
            X, F, D = base["expert_down"].shape
            out["experts_down" + A] = Param((X, F, r), ("experts", "mlp", None), "lora_a_experts", True)
            out["experts_down" + B] = Param((X, r, D), ("experts", None, "embed"), "zeros", True)
    return out


def merged_experts(c, layer: dict, out: dict) -> dict:
    """`out` with the experts' adapters (one layer's) merged into expert_gate, expert_up and expert_down."""
    s = c.lora.gate_up[1]
    if "experts_gate_up" + A in layer:
        a, b = layer["experts_gate_up" + A], layer["experts_gate_up" + B]
        for i, k in enumerate(("expert_gate", "expert_up")):
            w = jax.lax.stop_gradient(layer[k]).astype(jnp.promote_types(layer[k].dtype, a.dtype))
            d = jnp.einsum("xdr,xrf->xdf", a.astype(w.dtype), b[:, :, i].astype(w.dtype))
            out[k] = checkpoint_name(w + jnp.asarray(s, w.dtype) * d, MERGED)
    if "experts_down" + A in layer:
        a, b, k = layer["experts_down" + A], layer["experts_down" + B], "expert_down"
        w = jax.lax.stop_gradient(layer[k]).astype(jnp.promote_types(layer[k].dtype, a.dtype))
        d = jnp.einsum("xfr,xrd->xfd", a.astype(w.dtype), b.astype(w.dtype))
        out[k] = checkpoint_name(w + jnp.asarray(c.lora.scale, w.dtype) * d, MERGED)
    return out


def adapter_of(param: str) -> str:
    """The name of the A that adapts a layer parameter (whether it exists or not)."""
    return {"expert_gate": "experts_gate_up", "expert_up": "experts_gate_up"}.get(param, param) + A


def kaiming_a(key, shape, dtype, lead: int = 1):
    """peft's A: torch's kaiming_uniform_(a=sqrt(5)) of an (r, in) weight, bound 1 / sqrt(in), for a stacked A of
    `lead` leading axes (layers; layers and experts), its input axes, then the rank."""
    bound = 1.0 / math.sqrt(math.prod(shape[lead:-1]))
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def kaiming_experts(key, shape, dtype):
    return kaiming_a(key, shape, dtype, lead=2)


def delta(a, b, ins: list[int], outs: list[int]):
    """A B laid out as the base parameter: A (ins..., r), B (r, outs...) -> (ins..., outs...) transposed to the
    parameter's axis order."""
    d = jnp.tensordot(a, b, axes=1)
    order = ins + outs
    return jnp.transpose(d, [order.index(j) for j in range(len(order))])


def merged(c, layer: dict, splits: dict) -> dict:
    """One layer's weights (no leading layers axis) with each adapted weight W + scale A B and the adapters dropped;
    the base behind a stop-gradient (frozen). `splits`: {param: (input axes, output axes)} (`layer_splits`)."""
    if not splits and not any(k.endswith(A) for k in layer):
        return layer
    out = merged_experts(c, layer, {k: v for k, v in layer.items() if not k.endswith((A, B))})
    for k, (ins, outs) in splits.items():
        a = layer[k + A]
        w = jax.lax.stop_gradient(layer[k]).astype(jnp.promote_types(layer[k].dtype, a.dtype))  # a bfloat16 base
        d = delta(a.astype(w.dtype), layer[k + B].astype(w.dtype), ins, outs)
        # named: the planner counts the merged weights its backward keeps as weights, not activations
        out[k] = checkpoint_name(w + jnp.asarray(c.lora.scale, w.dtype) * d, MERGED)
    return out


def layer_splits(c) -> dict:
    """{adapted stack param: (its input axes, its output axes)} of c's model.lora ({} without)."""
    if c.lora is None:
        return {}
    from models.spec import family
    leaves = family(c.family).hf.leaves(c)
    return {k: split_axes(leaf) for k, (_, leaf) in targets(c, leaves).items()}


def saved_modules(c, leaves) -> dict:
    """{param name: its Leaf} of model.lora.modules (peft's modules_to_save, by HF module name: embed_tokens,
    lm_head): whole weights outside the layers, trained; a name the family has not is a ValueError naming its own."""
    whole = {hf_module(lf.names[0]): lf for lf in leaves if not lf.stacked and not lf.copy and len(lf.hf_shape) == 2}
    if missing := [m for m in c.lora.modules if m not in whole]:
        raise ValueError(f"model.lora.modules names {', '.join(missing)}, which {c.family} has not; its whole weights: "
                         f"{', '.join(sorted(whole))}")
    return {whole[m].path[0]: whole[m] for m in c.lora.modules}


def with_adapters(c, inv: dict) -> dict:
    """A family's inventory with every weight frozen but model.lora's modules, and the adapters in the layers'
    stack."""
    from models.spec import family
    trained = saved_modules(c, family(c.family).hf.leaves(c))

    def freeze(name, p):
        return p if name in trained else p._replace(trainable=False)
    out = {k: ({n: freeze(n, q) for n, q in v.items()} if isinstance(v, dict) else freeze(k, v)) for k, v in inv.items()}
    out["layers"] = {**out["layers"], **adapter_params(c, inv["layers"], family(c.family).hf.leaves(c)),
                     **expert_params(c, inv["layers"])}
    return out


def stored_dtype(c, p):
    """The dtype parameter p is held in: a frozen base weight (not one read as stored, a router's) in
    model.lora.base_dtype, every other float32."""
    if c.lora is not None and not p.trainable and not p.as_stored and c.lora.base_dtype == "bfloat16":
        return jnp.bfloat16
    return jnp.float32
