"""The generic decoder in Flax NNX, with a pure functional forward: the module built from a family's inventory
(models/spec.py), the layer stack, embedding and head; the families in models/families/ (Llama: llama.py).

Dimension letters (tensor names carry their shape, e.g. x_BTD):
  B batch   T sequence   D d_model   H query heads   K kv heads   G = H/K
  E head_dim   F d_ff (MLP hidden)   V vocabulary   L layers

The module owns the parameters and their logical axis names; the math lives in pure functions over a dict of
arrays, so the trainer can jit, shard_map, pipeline and remat it without going through the module. Layers are
stacked on a leading `layers` axis and run by one `lax.scan` (one compiled layer). The model never names a mesh
axis: it calls `constrain(x, logical_axes)`, supplied by the trainer from meshes.rules.

`layer` is a family's attention half, then its MLP half (ModelSpec.attention, .mlp); the default halves here,
pre-norm GQA attention with RoPE and a SwiGLU MLP (Llama's), are built of models/layers.py's pieces: the plain
reference or, by `kernels_for`, models/kernels/fast_cpu.py's equal but faster forms on XLA:CPU (model.kernels).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import REMAT, Kernels, Placement, column_remat, kernels_for, rms_norm, rope_for, sublayer_remat
from models.lora import kaiming_a, kaiming_experts, layer_splits, merged, stored_dtype, with_adapters
from models.spec import LOCAL, LayerCall, Param, family, stacks

STACKS = ("first_layers", "layers")

Constrain = Callable[[jax.Array, tuple], jax.Array]
RESIDUAL = ("batch", "res_seq", "embed")  # the residual stream: its sequence over `model` too under sequence parallelism


def _no_constrain(x, logical):
    return x


def _identity(p):
    return p


# the attention's optional weights (qkv reads those a layer holds): q/k/v biases, per-head q/k RMSNorm weights
ATTENTION_OPTIONS = ("bq", "bk", "bv", "q_norm", "k_norm")


def inventory(c: ModelConfig) -> dict:
    """Every parameter of c's family (models/spec.py): {name: Param}, the stack's per-layer ones under "layers";
    with model.mtp_depth, the multi-token prediction modules' under "mtp" (per module: a decoder layer of the
    family, the MoE one of a family with first layers, and enorm, hnorm, eh_proj, post_norm)."""
    inv = family(c.family).inventory(c)
    if c.lora is not None:  # the base frozen, the adapters beside their weights, peft's modules_to_save trained
        inv = with_adapters(c, inv)
    if not c.mtp_depth:
        return inv
    D = c.d_model
    own = {"enorm": Param((D,), ("embed",), "ones", False), "hnorm": Param((D,), ("embed",), "ones", False),
           "eh_proj": Param((2 * D, D), (None, "embed"), "normal", True),
           "post_norm": Param((D,), ("embed",), "ones", False)}
    return {**inv, "mtp": {**inv["layers"], **own}}


def _make(c: ModelConfig, p: Param, rngs: nnx.Rngs, layers: int | None = None, stack: str = "layers") -> nnx.Param:
    """p as an nnx.Param (with a leading `layers` axis of that many layers), its declarations as metadata."""
    inits = {"normal": nnx.initializers.normal(c.init_std),
             # GPT-2 residual scaling
             "residual": nnx.initializers.normal(c.init_std / (2 * c.n_layers) ** 0.5),
             "ones": lambda key, shape, dtype: jnp.ones(shape, dtype),
             "zeros": lambda key, shape, dtype: jnp.zeros(shape, dtype),
             "lora_a": kaiming_a, "lora_a_experts": kaiming_experts}
    shape, axes = (p.shape, p.axes) if layers is None else ((layers,) + p.shape, (stack,) + p.axes)
    return nnx.Param(inits[p.init](rngs.params(), shape, stored_dtype(c, p)), logical_axes=axes, weight_decay=p.decay,
                     as_stored=p.as_stored, trainable=p.trainable)


class Stack(nnx.Module):
    """The decoder layers' weights, stacked on a leading `layers` axis: (L, ...) whatever the parallel layout
    or pipeline schedule, so that any checkpoint restores onto any of them; a schedule that needs another order
    re-lays them out itself. A family whose first layers differ (ModelSpec.first_layers) has a second, shorter
    stack of them, "first_layers", its leading axis `first_layers` (never split over `stage`: they run on the
    first stage, with the embedding)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs, name: str = "layers"):
        rows = c.mtp_depth if name == "mtp" else stacks(c)[name]
        for key, p in inventory(c)[name].items():
            setattr(self, key, _make(c, p, rngs, rows, name))


class Transformer(nnx.Module):
    """Token embedding -> L x the family's layer (Llama's: norm, GQA attention, norm, SwiGLU) -> head."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs):
        self.config = c
        for name, p in inventory(c).items():  # in the inventory's order: each draws the next random key
            setattr(self, name, Stack(c, rngs, name) if name in STACKS + ("mtp",) else _make(c, p, rngs))

    def __call__(self, tokens_BT, dtype=jnp.float32):
        return forward(self.config, params_of(self), tokens_BT, dtype=dtype)


def params_of(model: nnx.Module) -> dict:
    """The module's parameters as a plain nested dict of arrays."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def logical_axes_of(model: nnx.Module) -> dict:
    """The logical axis names of every parameter, as a dict shaped like params_of()."""
    state = nnx.state(model, nnx.Param)
    return nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata()["logical_axes"]), state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _metadata_of(model: nnx.Module, key: str) -> dict:
    """One metadata field of every parameter, as a dict shaped like params_of(); each must declare it."""
    def get(path, v):
        if key not in v.get_metadata():
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} does not declare {key}; declare it where "
                             "the parameter is created")
        return v.get_metadata()[key]
    return nnx.to_pure_dict(jax.tree_util.tree_map_with_path(get, nnx.state(model, nnx.Param),
                                                             is_leaf=lambda x: isinstance(x, nnx.Variable)))


def weight_decay_of(model: nnx.Module) -> dict:
    """Whether each parameter is weight-decayed, as declared where it was created (a dict like params_of())."""
    return _metadata_of(model, "weight_decay")


def frozen_of(model: nnx.Module) -> dict:
    """Whether each parameter is state the step sets itself rather than a weight (Param.trainable False)."""
    return jax.tree.map(lambda t: not t, _metadata_of(model, "trainable"))


class Abstract(NamedTuple):
    params: dict  # ShapeDtypeStructs
    logical: dict  # logical axis names
    decay: dict  # weight decay on or off
    frozen: dict  # not trained: the optimizer leaves it (Param.trainable False)


def abstract_model(mc: ModelConfig, seed: int = 0) -> Abstract:
    """Parameter shapes, logical axes and weight-decay declarations, without allocating anything."""
    m = nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(seed)))
    return Abstract(params_of(m), logical_axes_of(m), weight_decay_of(m), frozen_of(m))


def layer_call(c: ModelConfig, rope, constrain: Constrain = _no_constrain, kernels: Kernels | None = None,
               half: Callable = _identity, segments=None, index=0, data=None, kv_repeat: int = 1,
               collectives=LOCAL, attention: Callable | None = None, column: Callable = _identity) -> LayerCall:
    """A LayerCall (models/spec.py) with `attention` as its strategy (default: the kernels' own, whole rows; the
    collectives' local form unless given)."""
    kn = kernels or kernels_for(c)
    return LayerCall(rope, constrain, kn, half, segments, attention or kn.attention, index, data or {}, kv_repeat,
                     collectives, column=column)


def layer(c: ModelConfig, p: dict, x_BTD, call: LayerCall):
    """One decoder layer on weights `p` (no leading layers axis): the family's attention half, then its MLP half
    (ModelSpec.attention, .mlp; None: Llama's), each through call.half; the MLP's auxiliary outputs."""
    spec = family(c.family)
    x_BTD = call.half(functools.partial(spec.attention or attention_half, c, call=call))(p, x_BTD)
    out = call.half(functools.partial(spec.mlp or mlp_half, c, call=call))(p, x_BTD)
    # a half the planner measures without (its identity) returns x alone
    return out if isinstance(out, tuple) else (out, {})


def attention_half(c: ModelConfig, p: dict, x_BTD, call: LayerCall):
    """x + attention(norm(x)): norm, q/k/v, RoPE, attention (call.attention), output projection, residual add."""
    kn, constrain = call.kernels, call.constrain
    p = {k: p[k].astype(x_BTD.dtype) for k in ("attn_norm", "wq", "wk", "wv", "wo") + ATTENTION_OPTIONS if k in p}
    q_BTHE, k_BTKE, v_BTKE = repeat_kv(call, *qkv(c, p, x_BTD, call.rope, constrain, kernels=kn,
                                                   column=call.column))
    o_BTHE = call.attention(q_BTHE, k_BTKE, v_BTKE, segments=call.segments)
    return attn_out(c, p, x_BTD, o_BTHE, constrain, kn)


def repeat_kv(call: LayerCall, q_BTHE, k_BTKE, v_BTKE):
    """q, k, v with each kv head repeated call.kv_repeat times: kv head i becomes heads i*r .. i*r+r-1, one per
    rank, next to its query heads."""
    if call.kv_repeat > 1:
        k_BTKE, v_BTKE = (call.constrain(jnp.repeat(a, call.kv_repeat, axis=2), ("batch", "seq", "heads", "head_dim"))
                          for a in (k_BTKE, v_BTKE))
    return q_BTHE, k_BTKE, v_BTKE


def qkv(c: ModelConfig, p: dict, x_BTD, rope, constrain: Constrain = _no_constrain, offset=0,
        kernels: Kernels | None = None, plus_one: bool = False, column: Callable = _identity):
    """One layer's queries, keys and values, RoPE'd for tokens at positions offset, offset+1, ...; with the
    options its weights hold (ATTENTION_OPTIONS): q/k/v biases (Qwen2), RMSNorm of each q and k head over head_dim
    before RoPE, one weight shared by the heads (Qwen3). `plus_one`: every norm's gain applied as (1 + w) (Gemma);
    `column` wraps the norm and projections (LayerCall.column)."""
    kn = kernels or kernels_for(c)

    def projections(w, x_BTD):  # the norm over the whole sequence: gathered here under sequence parallelism
        h_BTD = constrain(rms_norm(x_BTD, w["attn_norm"], c.norm_eps, plus_one), ("batch", "seq", "embed"))
        # same-shaped weights in one call: the fast path shares their backward
        groups = ((w["wq"], w["wk"], w["wv"]),) if c.fused_qkv else ((w["wq"],), (w["wk"], w["wv"]))
        return tuple(y for ws in groups for y in kn.project(h_BTD, ws))
    q_BTHE, k_BTKE, v_BTKE = column(projections)({k: p[k] for k in ("attn_norm", "wq", "wk", "wv")}, x_BTD)
    if "bq" in p:
        q_BTHE, k_BTKE, v_BTKE = (a + p[b].astype(a.dtype) for a, b in zip((q_BTHE, k_BTKE, v_BTKE), ("bq", "bk", "bv")))
    if "q_norm" in p:
        q_BTHE, k_BTKE = (rms_norm(a, p[n], c.norm_eps, plus_one) for a, n in ((q_BTHE, "q_norm"),
                                                                               (k_BTKE, "k_norm")))
    q_BTHE = constrain(kn.rope(q_BTHE, *rope, offset), ("batch", "seq", "heads", "head_dim"))
    k_BTKE = constrain(kn.rope(k_BTKE, *rope, offset), ("batch", "seq", "kv_heads", "head_dim"))
    return q_BTHE, k_BTKE, constrain(v_BTKE, ("batch", "seq", "kv_heads", "head_dim"))


def attn_out(c: ModelConfig, p: dict, x_BTD, o_BTHE, constrain: Constrain = _no_constrain,
             kernels: Kernels | None = None):
    """x + the attention output projected back to d_model."""
    kn = kernels or kernels_for(c)
    (B, T), D = o_BTHE.shape[:2], x_BTD.shape[-1]  # x's tokens may be a sequence-parallel rank's (the planner's)
    HE = c.n_heads * c.head_dim
    o_BTX = constrain(o_BTHE, ("batch", "seq", "heads", "head_dim")).reshape(B, T, HE)
    (o_BTD,) = kn.project(o_BTX, (p["wo"].astype(x_BTD.dtype).reshape(HE, D),))
    return constrain(x_BTD + constrain(o_BTD, RESIDUAL), RESIDUAL)  # the partial sums reduced into its layout first


def mlp_half(c: ModelConfig, p: dict, x_BTD, call: LayerCall):
    """x + SwiGLU(norm(x)); no auxiliary outputs."""
    kn, constrain = call.kernels, call.constrain
    p = {k: p[k].astype(x_BTD.dtype) for k in ("mlp_norm", "w_gate", "w_up", "w_down")}

    def projections(w, x_BTD):  # the norm over the whole sequence: gathered here under sequence parallelism
        h_BTD = constrain(rms_norm(x_BTD, w["mlp_norm"], c.norm_eps), ("batch", "seq", "embed"))
        return tuple(kn.project(h_BTD, (w["w_gate"], w["w_up"])))
    gate_BTF, up_BTF = call.column(projections)({k: p[k] for k in ("mlp_norm", "w_gate", "w_up")}, x_BTD)
    a_BTF = constrain(kn.silu(gate_BTF) * up_BTF, ("batch", "seq", "mlp"))
    (down_BTD,) = kn.project(a_BTF, (p["w_down"],))
    return constrain(x_BTD + constrain(down_BTD, RESIDUAL), RESIDUAL), {}


def layer_stack(c: ModelConfig, layers: dict, x_BTD, *, constrain: Constrain = _no_constrain,
                gather: Callable[[dict], dict] = _identity, remat: str | None = None, documents=None, index=None,
                placement: Placement = Placement(), stack: str = "layers"):
    """Run a stack of layers (leading axis = layers), optionally remat'd, scanned or unrolled (c.scan_layers):
    (x_BTD, aux), aux the layers' auxiliary outputs summed over the stack ({name: sum}). `stack`: which of the
    family's stacks (models/spec.py `stacks`) `layers` is: "layers", or "first_layers", run by ModelSpec.first_layer.

    `gather` maps one layer's (possibly ZeRO-sharded) weights to the weights it computes with;
    it runs per layer (inside the scan body when scanned), so ZeRO-3 all-gathers one layer at a
    time. `documents` = (segment_ids, positions), each (B, T), or None (one document per row).
    `index` (int32, one per layer of `layers`): each layer's index in the whole stack (a pipeline stage runs a
    slice of it); None: 0, 1, ... (after the first layers, for "layers"). `placement`: the platform whose kernels it runs, the kv heads' repeat, the
    collectives its layers get and, under context parallelism (placement.context, models/context_parallel/gather.py), the
    attention strategy the trainer chose, which attends this chunk of each row by the tokens' original positions
    (RoPE too); without, whole rows by index.
    """
    remat = c.remat if remat is None else remat
    segments, positions = (None, None) if documents is None else documents
    # segment ids travel as float32 (exact below 2^24): every constant a remat'd half closes over is then
    # differentiable, as jax.closure_convert and the sub-layer remat's branches need
    segments = None if segments is None else segments.astype(jnp.float32)
    kernels = kernels_for(c, placement.platform)
    attention, rope = _attention_and_rope(c, kernels, placement, x_BTD, positions)

    L = jax.tree.leaves(layers)[0].shape[0]
    # auto: unroll short stacks without remat. With remat the loop stays: unrolled, XLA has been
    # seen to merge a recomputed ZeRO-3 all-gather with the forward one (memory not freed).
    scan = c.scan_layers or (c.scan_layers is None and (L > 8 or remat != "none"))
    half = sublayer_remat if remat == "sublayer" else _identity
    spec = family(c.family)
    tables = {k: jnp.asarray(v) for k, v in spec.layer_data(c).items()}
    first = spec.first_layers(c) if stack == "layers" else 0
    index = jnp.arange(first, first + L, dtype=jnp.int32) if index is None else index
    run = spec.first_layer if stack == "first_layers" else spec.layer

    splits = layer_splits(c) if stack == "layers" else {}

    def body(x, pi):
        p, i = pi
        call = layer_call(c, rope, constrain, kernels, half, segments, i, {k: v[i] for k, v in tables.items()},
                          placement.kv_repeat, placement.collectives, attention,
                          column_remat(placement.platform) if placement.sequence_parallel else _identity)
        return run(c, merged(c, gather(p), splits), x, call)

    if remat in REMAT:
        # prevent_cse: outside a scan, XLA's CSE could merge the recomputation with the forward
        # pass (remat undone); inside one it cannot, and the barrier only costs.
        body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=not scan)
    if scan:
        return _scanned(body, layers, index, x_BTD, aux_zeros(c))
    return _unrolled(body, layers, index, x_BTD, L)


def aux_zeros(c: ModelConfig) -> dict:
    """The layers' aux outputs, zero: float32 scalars, or arrays of the family's aux_shapes."""
    shapes = family(c.family).aux_shapes(c)
    return {k: jnp.zeros(shapes.get(k, ()), jnp.float32) for k in family(c.family).aux}


def run_stacks(c: ModelConfig, params: dict, x_BTD, *, gather: Callable[[dict], dict] | dict = _identity, **kw):
    """(x_BTD, aux) of every stack of the model in turn (models/spec.py `stacks`): the first layers where the family
    has them, then "layers", each layer's weights through `gather`: one function for "layers" (the first layers'
    weights then arrive whole), or {stack: its per-layer gather} (ZeRO-3, trainer/step.py); kw: layer_stack's."""
    gathers = gather if isinstance(gather, dict) else {"layers": gather}
    aux = None
    if "first_layers" in params:
        x_BTD, aux = layer_stack(c, params["first_layers"], x_BTD, stack="first_layers",
                                 gather=gathers.get("first_layers", _identity), **kw)
    x_BTD, more = layer_stack(c, params["layers"], x_BTD, gather=gathers["layers"], **kw)
    return x_BTD, more if aux is None else _add_aux(aux, more)


def _attention_and_rope(c: ModelConfig, kernels: Kernels, placement: Placement, x_BTD, positions):
    """The attention the stack's layers run and their RoPE: under context parallelism (placement.context) the
    trainer's strategy, by each token's original position unless `positions` are given; else the kernels'
    attention, RoPE by `positions` (None: by index)."""
    attention = kernels.attention
    if placement.context is not None:  # the trainer's strategy, on each token's original position
        B, T = x_BTD.shape[:2]
        pos_T = placement.context.positions(placement.collectives, T)
        positions = jnp.broadcast_to(pos_T.astype(jnp.int32), (B, T)) if positions is None else positions
        attention = placement.context.attention(attention, placement.collectives, pos_T)
    return attention, rope_for(c, x_BTD.shape[1], positions)


def _add_aux(acc, aux):
    """Two layers' auxiliary outputs ({name: sum}) added."""
    return jax.tree.map(jnp.add, acc, aux)


def _scanned(body, layers, index, x_BTD, aux0):
    """The stack as one lax.scan of `body` (one compiled layer): (x_BTD, the layers' aux outputs summed)."""

    def step(carry, pi):
        x, aux = body(carry[0], pi)
        return (x, _add_aux(carry[1], aux)), None

    return jax.lax.scan(step, (x_BTD, aux0), (layers, index))[0]


def _unrolled(body, layers, index, x_BTD, L: int):
    """The stack unrolled: one copy of the layer per layer in the program. Longer compiles, but no loop: residuals
    are not stacked into (L, ...) buffers and read back with dynamic slices. lax.split: its transpose is one
    concatenate (indexing w[i] would transpose to L zero-padded full-size gradients summed together)."""
    leaves, tree = jax.tree.flatten(layers)
    parts = [jax.lax.split(w, [1] * L) for w in leaves]
    total = None
    for i in range(L):
        x_BTD, aux = body(x_BTD, (tree.unflatten([ps[i][0] for ps in parts]), index[i]))
        total = aux if total is None else _add_aux(total, aux)
    return x_BTD, total


def embed(c: ModelConfig, params: dict, tokens_BT, dtype, constrain: Constrain = _no_constrain):
    # whole along the sequence first (the vocab-split rows summed), then cut to the residual's layout: under sequence
    # parallelism a lookup straight into it gathered the whole table, its gradient a whole-table scatter-add
    x = constrain(jnp.take(params["embed"], tokens_BT, axis=0), ("batch", "seq", "embed")).astype(dtype)
    return constrain(scale_embedding(c, x), RESIDUAL)


def scale_embedding(c: ModelConfig, x_BTD):
    """The embeddings x sqrt(d_model) where the family scales them (Ends.scaled: Gemma), the factor rounded to the
    compute dtype as transformers rounds it."""
    return x_BTD * jnp.asarray(c.d_model ** 0.5, x_BTD.dtype) if family(c.family).ends(c).scaled else x_BTD


def softcap(logits, cap: float | None):
    """cap * tanh(logits / cap) (Gemma's soft-capping); cap None: the logits as they are."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def final_norm(c: ModelConfig, params: dict, x_BTD):
    """The hidden state the output projection reads."""
    return rms_norm(x_BTD, params["final_norm"], c.norm_eps, family(c.family).ends(c).plus_one)


def head_weight(c: ModelConfig, params: dict):
    """(the output projection's weight, its layout: "vd" the tied embedding (V, D), "dv" the head's (D, V))."""
    return (params["embed"], "vd") if c.tie_embeddings else (params["lm_head"], "dv")


def head_only(c: ModelConfig) -> tuple:
    """The weights only the head reads (the final norm and an untied head's projection; none where the head is the
    tied embedding, which the lookup reads too)."""
    return () if c.tie_embeddings else ("final_norm", "lm_head")


def head(c: ModelConfig, params: dict, x_BTD, constrain: Constrain = _no_constrain, normed: bool = False):
    """Final norm and output projection; logits in float32. `normed`: x is normed already (a multi-token
    prediction module's output, its own norm applied): the projection alone."""
    x = x_BTD if normed else final_norm(c, params, x_BTD)
    w, layout = head_weight(c, params)
    w_DV = w.T if layout == "vd" else w
    logits = jnp.einsum("btd,dv->btv", x, w_DV.astype(x.dtype), preferred_element_type=jnp.float32)
    return constrain(softcap(logits, family(c.family).ends(c).cap), ("batch", "seq", "vocab"))


def forward(c: ModelConfig, params: dict, tokens_BT, *, dtype=jnp.float32,
            constrain: Constrain = _no_constrain, gather: Callable[[dict], dict] = _identity,
            remat: str | None = None, placement: Placement = Placement()):
    """Logits (B, T, V) in float32 for integer tokens (B, T)."""
    x = embed(c, params, tokens_BT, dtype, constrain)
    x = run_stacks(c, params, x, constrain=constrain, gather=gather, remat=remat, placement=placement)[0]
    return head(c, params, x, constrain)
