"""Model families: one registry, `model.family` names an entry. This module is the whole contract between a family
and the rest of meshtrain: the trainer, the planner, the counters and the checkpoint code ask a model only what its
`ModelSpec` declares here (and the shared fields of models/config.py's ModelConfig); nothing outside this module
calls getattr or hasattr on a model config (tests/test_architecture.py).

A family is a module that calls `register(ModelSpec(...))`: models/families/ holds the built-in ones (llama.py the
default); a module anywhere else (a test, a user's module imported before the run) registers the same way.

What a family must give:
  name        the model.family value
  inventory   (c) -> {name: Param}: every parameter once (shape, logical axes, initializer, weight decay, precision),
              the stack's per-layer ones under "layers" (a leaf with the logical axis `experts` is an expert weight)
  layer       (c, p, x_BTD, call: LayerCall) -> (x_BTD, aux): one layer on its own weights; each collective through
              call.collectives (LocalCollectives' methods over logical axes), each activation's layout through
              call.constrain, each residual half through call.half, attention through call.attention

What it may give (a ModelSpec field each; [its default]; who reads it):
  config      [ModelConfig] a frozen kw_only subclass: its fields are the family's; those declared with models/config.py
              `key` are model.* keys (the config schema is written when trainer.config is imported: a family registered
              after that, a plug-in, runs with its fields' defaults)
  hf          [None] HFAdapter: trainer/ckpt/hf.py imports and exports Hugging Face folders through it
  attention, mlp  [Llama's] the two halves of models/transformer.py's `layer`, for a family that uses it
  layer_data  [{}] per-layer tables (call.data); rope [plain RoPE] call.rope
  windows     [c.window everywhere] each layer's window: the FLOP count, the KV cache, the kernels
  ends        [Ends()] what the shared embedding, final norm, head and tiled loss do for it
  checks      [[]] (ok, message) of its own fields, said by trainer/config's validate in one line
  aux, aux_counts, aux_weights  [(), {}, 1 each] the layer's auxiliary outputs: their names (each layer returns
              each one's sum), each one's count over a batch (the step's scale and the logged mean's divisor, from the
              batch alone) and weight in the objective (models/objectives/objective.py, the pipeline's loss)
  experts_active  [None: no routing] experts a token runs: models/counts.py counts an expert weight at k of its E;
              not None makes the model `sparse`: the planner traces its layers at each row count and adds the experts'
              working set (trainer/plan/memory.py), trainer/config warns where its experts stay replicated
  experts_over  [refused: no experts] why the experts cannot split over n expert-parallel ranks of a mesh axis, or
              None: mesh.expert, or train.expert_parallel over `data` (trainer/config expert_parallel; the rules entry
              `experts` then maps to that axis)
  expert_collectives  [[]] one layer's forward collectives over the expert-parallel axis (trainer/plan/comm.py)
  dispatch_rows  [one per choice] rows an MoE layer's dispatch holds (trainer/plan/memory.py)
  dispatch_run  [None] the choices a rank runs at once under a buffered expert-parallel dispatch (the planner's
              MLP working set, trainer/plan/memory.py)
  experts_line  [""] the train banner's words for the experts' layout (trainer/run/context.py)
  split_keys  [{}] {logical axis: the config's own fields holding a width of it, most specific first}: divided by
              mesh.model in the planner's one-device view (`widths_over_model`), named where mesh.model does not divide
              one (`width_keys`, trainer/config/widths.py)
  context_refusal  [None] why the model cannot run with its rows split over n context ranks: trainer/config refuses
              mesh.context, the planner's search skips those layouts

What it gets with no line elsewhere: state created sharded on every layout (data, ZeRO 0-3, every pipeline schedule,
model, context, experts over `data`) by the rules table from its inventory's logical axes; the optimizer's decay mask;
remat; the planner (memory, communication, search); parameter and FLOP counts (models/counts.py); checkpoints in one
(L, ...) layout on any mesh; decoding (models/decode.py); Hugging Face import and export where it gives `hf`.

Pieces a family may reuse: models/transformer.py (layer, attention_half, mlp_half), models/layers.py,
models/families/llama.py's and qwen.py's inventories, models/hf/'s adapters, models/kernels/experts.py's grouped_mlp
(the experts' matmuls and their expert-parallel dispatch), and of models/families/moe.py's MoE MLP its MoEConfig,
moe_inventory and MOE (every ModelSpec field of that MLP); its other functions are its own.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple


class Param(NamedTuple):
    """One parameter of an inventory: per layer for the stack's (which adds the leading `layers` axis)."""
    shape: tuple
    axes: tuple  # logical axis names
    init: str  # "normal" | "residual" (GPT-2's scaled residual outputs) | "ones"
    decay: bool  # weight decay applies (the optimizer reads it, trainer/optim.py)
    as_stored: bool = False  # read as stored (float32): a ZeRO-3 gather must not cast it first (models/precision.py)
    # False: state the step sets itself, not a weight (DeepSeek's router bias): no gradient reaches it, the
    # optimizer leaves it (no state, no decay); checkpoints, layouts and exports carry it as they carry a weight
    trainable: bool = True


class LocalCollectives:
    """The collectives a layer gets (LayerCall.collectives), in their local form: one rank on every logical axis
    (size 1, index 0, each collective the identity), for decoding, the planner and one device. The trainer passes
    its own, of the same methods, over the mesh axes the rules map each logical axis to (meshes/collectives.py);
    each method acts on one rank's blocks, as inside a shard_map:
      axis_size(lg), axis_index(lg); psum(x, lg); all_gather(x, lg, axis) (blocks concatenated along axis);
      reduce_scatter(x, lg, axis) (summed, each rank keeps its block of axis); all_to_all(x, lg, split_axis,
      concat_axis) (block j of split_axis to rank j, rank i's arriving as block i of concat_axis); shift(x, lg)
      (each rank's block to the next rank, around a ring);
      region(fn, in_axes, out_axes, over=None): fn on each rank's blocks, manual over the logical axes `over`
      (None: every axis), the arguments' and the result's layouts given by their logical axes."""

    def axis_size(self, logical: str) -> int:
        return 1

    def axis_index(self, logical: str):
        return 0

    def psum(self, x, logical: str):
        return x

    def all_gather(self, x, logical: str, axis: int = 0):
        return x

    def reduce_scatter(self, x, logical: str, axis: int = 0):
        return x

    def all_to_all(self, x, logical: str, split_axis: int, concat_axis: int):
        return x

    def shift(self, x, logical: str):
        return x

    def region(self, fn, in_axes, out_axes, over=None):
        return fn


LOCAL = LocalCollectives()


class LayerCall(NamedTuple):
    """What a layer function gets besides its weights and input. `index` and `data` change from layer to layer;
    the rest is the stack's."""
    rope: tuple  # RoPE tables (models/layers.py rope_tables), per token where the batch has positions
    constrain: Callable  # (x, logical axes) -> x: the trainer's sharding constraint
    kernels: Any  # models/layers.py Kernels: the projections, SiLU, RoPE of the target platform
    half: Callable  # wraps each residual half: the identity, or sublayer remat
    segments: Any  # (B, T) float32 document of each token, or None (one per row)
    attention: Callable  # the attention strategy: (q_BTHE, k_BTKE, v_BTKE, segments=) -> o_BTHE; a
    # context-parallel implementation plugs in here
    index: Any  # the layer's index in the whole stack (int32 scalar; traced inside a scan or a pipeline stage)
    data: dict  # this layer's entries of the family's layer_data tables ({} for a stack of equal layers)
    # each kv head repeated this many times before attention (the caller's Placement: kv heads replicated over
    # tensor-parallel ranks, each rank then holds the kv head of its query heads, split like them)
    kv_repeat: int = 1
    # collectives over logical axes (LocalCollectives' methods; the caller's Placement): e.g. tokens sent to the
    # data rank that holds their expert by all_to_all over `experts`
    collectives: Any = LOCAL
    # KV-cache decoding (models/decode.py): an MoE layer then drops no token whatever its capacity
    decoding: bool = False
    # decoding a family with its own cache (ModelSpec.decode_cache): this layer's (models/decode.py CacheView)
    cache: Any = None
    # wraps f(p, x) -> the column-parallel projections of norm(x): the identity, or under sequence parallelism a
    # remat that keeps x (split over `model` along the sequence), not its gathered norm (models/layers.py
    # sublayer_remat), which each projection's weight gradient would otherwise hold (the Placement's)
    column: Callable = lambda f: f


class Ends(NamedTuple):
    """What the pieces every family shares do at the model's two ends for a family: the embeddings x sqrt(d_model)
    (rounded to the compute dtype), the final norm's gain applied as (1 + w), the logits soft-capped as
    cap * tanh(logits / cap) (in the tiled loss's forward and backward too; None: as they are)."""
    scaled: bool = False
    plus_one: bool = False
    cap: float | None = None


def no_aux(c, batch) -> dict:
    return {}


def no_weights(c) -> dict:
    return {}


def no_layer_data(c) -> dict:
    return {}


def no_checks(c) -> list:
    return []


def plain_ends(c) -> Ends:
    return Ends()


def no_windows(c) -> None:
    return None


def no_routing(c) -> None:
    return None


def no_experts(c, ranks: int, axis: str = "data") -> str:
    return "the model has no experts"


def no_expert_collectives(c, tokens: int, ranks: int, a: int) -> list:
    return []


def one_row_per_choice(c, tokens: int, platform: str) -> int:
    return tokens * (family(c.family).experts_active(c) or 0)


def no_dispatch_run(c, tokens: int, ranks: int) -> None:
    return None


def no_experts_line(c, ranks: int, over: str | None) -> str:
    return ""


def any_context(c, context: int) -> None:
    return None


def no_first(c) -> int:
    return 0


def no_aux_shapes(c) -> dict:
    return {}


def two_heads_wide(c) -> int:
    return 2 * c.head_dim


def nothing_after(c, params: dict, aux: dict) -> tuple[dict, dict]:
    return params, {}


def no_aux_objective(c, aux: dict, collectives) -> dict:
    return {}


def any_batch(c) -> None:
    return None


# the Hugging Face form's types live in models/hf/types.py; importable from here as before
from models.hf.types import HFAdapter, HFWrapper, Leaf, leading, leaf_shape  # noqa: E402,F401


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    # (ModelConfig) -> {name: Param}; the stack's per-layer parameters under "layers"; the embedding "embed"
    # (vocab, embed), the final norm and the untied head as the model's `final_norm` / `head_weight` read them
    inventory: Callable
    # (c, p, x_BTD, call: LayerCall) -> (x_BTD, aux): one layer on its weights p (no layers axis), each residual
    # half through call.half, attention through call.attention. aux: {name: sum} float32 scalars (their counts are
    # aux_counts'), {} for a dense layer (an MoE's router losses and dropped fraction); see "The layer contract" in
    # docs/models.md.
    # models/transformer.py's `layer` is the attention half, then the MLP half, each the spec's own (below)
    layer: Callable
    hf: HFAdapter | None = None  # None: the family has no Hugging Face form
    # (c) -> {name: array (n_layers,)}: per-layer data for a stack whose layers differ (a kind, a window, a RoPE
    # base); the layer reads its own entries as call.data
    layer_data: Callable = no_layer_data
    # the names of the layer's auxiliary outputs (every layer returns each of them)
    aux: tuple = ()
    # (c, batch) -> {name: count}: each aux output's count over a batch, from the batch alone (known before the
    # backward: the step scales each aux sum by 1/its count over the whole step batch where its backward starts,
    # as it does the token loss)
    aux_counts: Callable = no_aux
    # the family's config: None, models/config.py's ModelConfig; else a frozen kw_only subclass of it whose own fields
    # (each declared with models/config.py's `key`, its default the family's) are the family's model.* keys: a config
    # that sets one for a family without it is an error naming the family
    config: type | None = None
    # (c) -> each layer's window (None: every causal key), for a stack whose layers differ in window; None: every
    # layer c.window (the FLOP count, the KV cache and the kernels read it)
    windows: Callable = no_windows
    # (c, T, positions_BT or None) -> the RoPE tables a layer gets (LayerCall.rope); None: plain RoPE of c.rope_theta
    # and c.rope_scaling (models/layers.py rope_for)
    rope: Callable | None = None
    # (c) -> Ends: what the shared embedding, final norm and head do for the family
    ends: Callable = plain_ends
    # (c) -> [(ok, message)]: the family's own keys against the shapes, checked with the config's (trainer/config/__init__.py)
    checks: Callable = no_checks
    # the two halves of models/transformer.py's `layer`, None: Llama's. attention: (c, p, x_BTD, call) -> x_BTD
    # (x + attention(norm(x)), the norms the family's); mlp: (c, p, x_BTD, call) -> (x_BTD, aux) (x + MLP(norm(x)):
    # dense SwiGLU, Gemma's GeGLU with its norms, models/families/moe.py's experts)
    attention: Callable | None = None
    mlp: Callable | None = None
    # (c) -> {aux name: weight}: each aux output's weight in the objective (absent: 1). Weight 0: a statistic,
    # logged, never differentiated (an MoE's dropped fraction); an aux name with a "/" is logged under that name,
    # the others as aux/<name>
    aux_weights: Callable = no_weights
    # (c) -> experts a token runs (an MoE's top-k), None: no routing (every weight whole in the counts, `sparse` false)
    experts_active: Callable = no_routing
    # (c, ranks) -> why its experts cannot split over `ranks` expert-parallel ranks (one line's clause), or None
    experts_over: Callable = no_experts
    # (c, tokens, ranks, a) -> one layer's forward collectives over the expert-parallel axis for `tokens` tokens per
    # rank on `ranks` ranks, a bytes of the compute dtype: [(kind, what, bytes of the array, whether its transpose runs
    # in the backward, whether a recomputed forward runs it again)]
    expert_collectives: Callable = no_expert_collectives
    # (c, tokens, platform) -> rows the layer's dispatch holds for `tokens` tokens (a sparse model's)
    dispatch_rows: Callable = one_row_per_choice
    # (c, tokens, ranks) -> the choices a rank runs at once where its dispatch over `ranks` expert-parallel ranks
    # sends each rank's tokens in buffers and runs them one sender's at a time, or None (every choice at once)
    dispatch_run: Callable = no_dispatch_run
    # (c, data, split) -> the train banner's words for the experts over `data` ranks, split or replicated ('' none)
    experts_line: Callable = no_experts_line
    # {logical axis: (the config's own fields holding a width of it, most specific first)}
    split_keys: dict = dataclasses.field(default_factory=dict, hash=False)  # (the spec stays hashable)
    # (c, context) -> why it cannot run with each row split over `context` ranks, or None
    context_refusal: Callable = any_context
    # (c) -> how many of the first layers are of another kind (DeepSeek's dense layers before its MoE ones): their
    # weights a stack of their own under "first_layers" (the inventory's per-layer ones there), run before "layers"
    # by `first_layer` (same signature as `layer`, the same aux names); 0: one stack
    first_layers: Callable = no_first
    first_layer: Callable | None = None
    # (c) -> {aux name: shape}: the aux outputs that are arrays, not scalars (statistics of weight 0, such as the
    # experts' loads per MoE layer, (layers, experts)): summed like the others, never logged as they are
    aux_shapes: Callable = no_aux_shapes
    # (c, params, the step's aux sums) -> (params, {metric: value}): what the step sets itself after the optimizer's
    # update (DeepSeek's router bias from the step's expert loads); a step the guard skips keeps the old params
    after_step: Callable = nothing_after
    # (c, batch, length, dtype) -> {name: (n_layers, batch, length, ...)}: the decoding cache of a family that keeps
    # its own (latent attention's latent and RoPE key), which its layers write and read through LayerCall.cache;
    # None: the RoPE'd keys and values (models/decode.py)
    decode_cache: Callable | None = None
    # (c) -> a head's query/key width plus its value width (the attention's FLOPs, models/counts.py): 2 x head_dim
    qk_v_width: Callable = two_heads_wide
    # (c, stack, remat) -> the widths (per token) one layer of that stack all-reduces over `model` per microbatch
    # (trainer/plan/comm.py); None: Llama's layer (its outputs after wo and w_down, its projection groups' input
    # gradients, a recomputed one under full remat)
    tp_reductions: Callable | None = None
    # (c, this objective's aux sums, the collectives) -> {aux name: value} replacing those aux sums (the layers return 0
    # for them) before the objective weights them: terms that are not sums over rows (gpt-oss's pooled balancing
    # loss), exact where the objective sees the step's whole batch (`whole_batch` says when it must)
    aux_objective: Callable = no_aux_objective
    # (c) -> why the model's objective needs the step's whole batch in one piece (trainer/config then refuses
    # train.microbatches > 1 and pipelines), or None
    whole_batch: Callable = any_batch


FAMILIES: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Add a family (or replace one of the same name); returns it. Its split_keys must be fields of its config."""
    fields = {f.name for f in dataclasses.fields(spec.config)} if spec.config is not None else set()
    if unknown := [k for keys in spec.split_keys.values() for k in keys if k not in fields]:
        raise ValueError(f"family {spec.name}: split_keys {unknown} are not fields of its config; declare them there")
    FAMILIES[spec.name] = spec
    return spec


def stacks(c) -> dict:
    """{stack name: its layers} in the order they run: "first_layers" (where the family has them), then "layers"."""
    k = family(c.family).first_layers(c)
    return {**({"first_layers": k} if k else {}), "layers": c.n_layers - k}


def family(name: str) -> ModelSpec:
    if name not in FAMILIES:
        raise ValueError(f"model.family='{name}' is not registered; choose one of {', '.join(sorted(FAMILIES))} "
                         "or import the module that registers it")
    return FAMILIES[name]


def sparse(c) -> bool:
    """Whether the model routes tokens to experts (its family's experts_active is not None)."""
    return family(c.family).experts_active(c) is not None


# The shared fields holding the widths of the logical axes the rules split over `model` (a family's own first)
SHARED_WIDTHS = {"heads": ("n_heads",), "mlp": ("d_ff",), "vocab": ("vocab_size",)}


def width_keys(c) -> dict[str, tuple[tuple[str, Any], ...]]:
    """{logical axis: ((field, its value), ...)} of the fields holding a width of each axis, most specific first: the
    family's own (ModelSpec.split_keys), then the shared ones."""
    own = family(c.family).split_keys
    return {axis: tuple((k, getattr(c, k)) for k in tuple(own.get(axis, ())) + SHARED_WIDTHS.get(axis, ()))
            for axis in dict.fromkeys([*SHARED_WIDTHS, *own])}


def widths_over_model(c, tp: int) -> dict:
    """The family's own width fields (split_keys) as one of `tp` model ranks holds them (those set), for
    dataclasses.replace."""
    own = family(c.family).split_keys
    return {k: getattr(c, k) // tp for keys in own.values() for k in keys if getattr(c, k)}


def hf_family(architecture: str) -> ModelSpec:
    """The family whose HF adapter reads `architecture` (config.json's architectures[0])."""
    for spec in FAMILIES.values():
        if spec.hf is not None and spec.hf.architecture == architecture:
            return spec
    if hf_wrapper(architecture) is not None:
        return hf_wrapper(architecture)[0]
    known = sorted([s.hf.architecture for s in FAMILIES.values() if s.hf is not None]
                   + [w.architecture for s in FAMILIES.values() if s.hf is not None for w in s.hf.wrappers])
    raise ValueError(f"describes {architecture}; meshtrain imports {', '.join(known)}")


def hf_wrapper(architecture: str) -> tuple[ModelSpec, HFWrapper] | None:
    """The family and HFWrapper of a larger model's architecture whose text tower a family reads, or None."""
    for spec in FAMILIES.values():
        for w in spec.hf.wrappers if spec.hf is not None else ():
            if w.architecture == architecture:
                return spec, w
    return None
