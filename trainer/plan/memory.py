"""Per-device bytes of one layout, from shapes alone: state (exact), activations and buffers (estimates).

Parameter shapes come from `jax.eval_shape`; their per-device shards from the trainer's own rules
table and ZeRO specs (meshes/rules.py) on an AbstractMesh, so no device is needed. Activations are
the residuals JAX itself saves for the backward pass of one layer at one device's shapes, times
the layers, under the remat policy.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import optax
from meshes import MODEL, Layout
from models import ModelConfig, abstract_model
from models.spec import LocalCollectives, family, sparse, widths_over_model
from trainer.optim import make_optimizer
from trainer.parallel.reduction import Decision, decide
from trainer.plan.schedule_cost import cost
from trainer.plan.types import Strategy, executed


@functools.lru_cache(maxsize=64)
def _abstract(mc: ModelConfig, train):
    """Parameter shapes, logical axes and optimizer-state shapes (cached per model and optimizer)."""
    params, logical, decay = _model_shapes(mc)
    tx, _ = make_optimizer(train, decay)
    return params, logical, tx, jax.eval_shape(tx.init, params)


@functools.lru_cache(maxsize=64)
def _model_shapes(mc: ModelConfig):
    """abstract_model's shapes, axes and decay flags, once per model whatever the optimizer."""
    return abstract_model(mc)


def _local(shape, spec, sizes) -> int:
    """Elements of one device's shard of an array with this PartitionSpec."""
    n = 1
    for i, dim in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        n *= -(-dim // math.prod(sizes[a] for a in names))
    return n


def _layout(st: Strategy) -> Layout:
    return Layout(st.mesh.abstract(), st.zero, st.rules)


def leaf_bytes(mc: ModelConfig, train, st: Strategy, kind: str) -> dict:
    """Bytes per device of every parameter leaf under the `kind` spec (param | grad | opt | compute)."""
    return _leaf_bytes(_no_remat(mc), train, st.mesh, st.zero, st.rules, kind)


@functools.lru_cache(maxsize=4096)
def _leaf_bytes(mc: ModelConfig, train, mesh, zero: int, rules, kind: str) -> dict:
    """leaf_bytes by what places the weights (mesh, ZeRO, rules), which a search's layouts share (7b on 256
    devices: 8,525 layouts, 427 placements). Shared: read it, never change it."""
    params, logical, _, _ = _abstract(mc, train)
    fn, sizes = getattr(Layout(mesh.abstract(), zero, rules), f"{kind}_spec"), mesh.as_dict()
    return jax.tree.map(lambda s, lg: _local(s.shape, fn(s.shape, lg), sizes) * s.dtype.itemsize, params, logical)


def _no_remat(mc: ModelConfig) -> ModelConfig:
    return dataclasses.replace(mc, remat="none")


def state_bytes(mc: ModelConfig, train, st: Strategy) -> tuple[float, float, float]:
    """(params, grads, optimizer state) bytes per device."""
    _, _, tx, opt = _abstract(_no_remat(mc), train)
    p = sum(jax.tree.leaves(leaf_bytes(mc, train, st, "param")))
    # a pipeline's gradients come back as the data-parallel step's do (reduce-scattered under ZeRO-2/3)
    g = sum(jax.tree.leaves(leaf_bytes(mc, train, st, "grad")))
    o = optax.tree_map_params(tx, lambda _, b: b, opt, leaf_bytes(mc, train, st, "opt"),
                              transform_non_params=lambda x: x.size * x.dtype.itemsize)
    return float(p), float(g), float(sum(jax.tree.leaves(o)))


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter as the collectives see it."""
    name: str
    layers: bool  # part of the layer stack (gathered one layer at a time under ZeRO-3)
    bytes: float  # per device at the compute spec (split over model and stage; over data where its rules split it)
    model_split: int  # ways it is split over `model`
    zero: bool  # has a dimension ZeRO shards over the batch axes it is summed over
    split: bool = False  # its rules split it over a batch axis (experts over `expert`): never reduced over that
    left: str = ""  # where split: the batch axes it is summed (and ZeRO-sharded) over, named (Strategy.axes_left)


@functools.lru_cache(maxsize=64)
def decision(mc: ModelConfig, train, st: Strategy) -> Decision:
    """How the trainer reduces each gradient of this layout, and where (trainer/parallel/reduction.py)."""
    params, logical, _, _ = _abstract(_no_remat(mc), train)
    return decide(_layout(st), params, logical, st.grad_sync, st.microbatches)


def leaves(mc: ModelConfig, train, st: Strategy) -> list[Leaf]:
    """Every parameter with its compute-spec bytes, model split and its gradient's reduction (the trainer's)."""
    return _leaves(_no_remat(mc), train, Strategy(st.mesh, st.zero, st.microbatches, "none", grad_sync=st.grad_sync,
                                                  rules=st.rules))


@functools.lru_cache(maxsize=4096)
def _leaves(mc: ModelConfig, train, st: Strategy) -> list[Leaf]:
    """leaves of a layout reduced to what places the weights and decides their reduction (mesh, ZeRO, rules,
    microbatches, gradient sync). Shared: read it, never change it."""
    params, _, _, _ = _abstract(mc, train)
    full = leaf_bytes(mc, train, st, "compute")
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    out = []
    for (path, _), r, b in zip(flat, jax.tree.leaves(decision(mc, train, st).leaves), jax.tree.leaves(full)):
        ways = math.prod(st.model for e in r.spec if e == MODEL or (isinstance(e, tuple) and MODEL in e))
        name = jax.tree_util.keystr(path)
        out.append(Leaf(name, name.startswith("['layers']"), float(b), ways, r.dim is not None, bool(r.split),
                        st.axes_left(r.split) if r.split else ""))
    return out


def _shard(mc: ModelConfig, tp: int) -> tuple[ModelConfig, int]:
    """One device's widths under tensor parallelism (heads, kv heads, d_ff, vocab / model; head_dim kept) as a model
    of those widths, and the kv heads' repeat there. With fewer kv heads than ranks (repeat > 1) every device
    projects all of them (their weights are replicated), repeats them and attends with its own slice of the
    repeated heads: one."""
    replicated = mc.n_kv_heads < tp
    view = dataclasses.replace(mc, n_heads=mc.n_heads // tp, n_kv_heads=mc.n_kv_heads if replicated else
                               mc.n_kv_heads // tp, d_ff=mc.d_ff // tp, vocab_size=mc.vocab_size // tp, remat="none")
    # an MoE's experts and shared expert: each one's hidden units over `model`, as the dense MLP's
    return dataclasses.replace(view, **widths_over_model(mc, tp)), tp // mc.n_kv_heads if replicated else 1


def _device_kernels(c: ModelConfig, dtype, platform: str, kv_repeat: int, fused_qkv: bool):
    """The layer's kernels as one device of the model runs them, c its widths there: q, k and v projected as the
    whole model's program does (fused_qkv: written at its shapes, while one device's q and k may be alike); with
    repeated kv heads, the attention sees only this device's slice of them (what the sharding constraint after the
    repeat leaves it). cuDNN's fused attention (GPU, bfloat16), which cannot be traced without a GPU, is counted as
    the blockwise attention of models/kernels/fast_cpu.py: both save q, k, v, the output and one log-sum-exp per query."""
    from models.kernels.attention import block_for, select
    from models.kernels.fast_cpu import causal_attention
    from models.layers import kernels_for
    kn = kernels_for(c, platform)
    if dtype is not None and select(c.attention, dtype, platform, kn.name == "fast") == "cudnn":
        kn = kn._replace(attention=lambda q, k, v, segments=None, **kw: causal_attention(
            q, k, v, block_for(c.attention_block, platform)))
    if c.fused_qkv and not fused_qkv:  # a call of three weights is the fused q, k, v: made as the model makes it
        project = kn.project
        kn = kn._replace(project=lambda x, ws: project(x, ws[:1]) + project(x, ws[1:]) if len(ws) == 3 else
                         project(x, ws))
    if kv_repeat == 1:
        return kn
    # the repeat makes n_kv_heads x kv_repeat = mesh.model heads, one per rank
    return kn._replace(attention=lambda q, k, v, segments=None, **kw: kn.attention(q, k[:, :, :1], v[:, :, :1],
                                                                                    **kw))


def _residuals(fn, *args) -> float:
    """Bytes JAX saves from fn's forward for its backward, less the weights (already counted as state)."""
    # jax.ad_checkpoint.print_saved_residuals prints this list; the function behind it returns it
    from jax._src.ad_checkpoint import saved_residuals
    return float(sum(math.prod(aval.shape) * aval.dtype.itemsize for aval, where in saved_residuals(fn, *args)
                     if "argument w" not in where))


def _only_half(n: int):
    """A LayerCall.half that runs only the n-th residual half of a layer (0 attention, 1 MLP), the other as
    the identity: a family's halves measured through its own layer function."""
    seen = []

    def half(f):
        seen.append(f)
        return f if len(seen) - 1 == n else (lambda p, x: x)
    return half


@functools.lru_cache(maxsize=512)
def _per_row(mc: ModelConfig, tp: int, dtype: str, platform: str, what: str, context: tuple = (1, "all_gather")
             ) -> tuple[float, float]:
    """(fixed, per sequence) residual bytes of one layer under a remat policy, of one of its halves
    without remat ("attention", "mlp"), or of the head and loss, on `platform`'s kernels."""
    one, two = (_traced(mc, tp, dtype, platform, what, rows, context) for rows in (1, 2))
    return 2 * one - two, two - one


@functools.lru_cache(maxsize=512)
def _traced(mc: ModelConfig, tp: int, dtype: str, platform: str, what: str, rows: int,
            context: tuple = (1, "all_gather")) -> float:
    """The residual bytes of _per_row's `what` at `rows` sequences, traced; with `context` = (C ranks splitting
    each row, their attention strategy), at one rank's seq_len / C tokens, the strategy's collectives shaped as
    one rank sees them (_OneContextRank: the gathered K/V as large as the row's)."""
    from models.objectives.cross_entropy import cross_entropy
    from models.layers import REMAT, rope_for, sublayer_remat
    from models.spec import family
    from models.transformer import head, inventory, layer_call
    (c, repeat), T, dt = _shard(mc, tp), mc.seq_len // context[0], jax.numpy.dtype(dtype)
    w = lambda s: jax.ShapeDtypeStruct(s, jax.numpy.float32)  # noqa: E731
    D = c.d_model
    # the RoPE tables and the targets are made inside the traced function, as abstract as the rest: a plan of
    # any seq_len or head_dim allocates nothing (as constants they count the same bytes)
    x = jax.ShapeDtypeStruct((rows, T, D), dt)
    if what == "head":  # an untied head: its weight, as the tied embedding's, is the same (V, D) numbers
        cfg = dataclasses.replace(c, tie_embeddings=False)
        weights = {k: w(p.shape) for k, p in inventory(cfg).items() if k not in ("embed", "layers")}
        return _residuals(lambda x, weights, r=rows: cross_entropy(
            head(cfg, weights, x), jax.numpy.zeros((r, T), jax.numpy.int32)), x, weights)
    weights = {k: w(p.shape) for k, p in inventory(c)["layers"].items()}  # one layer's, at one device's shapes
    kn, spec = _device_kernels(c, dt, platform, repeat, mc.fused_qkv), family(c.family)
    data = {k: jax.numpy.asarray(v)[0] for k, v in spec.layer_data(c).items()}  # layer 0's: same shapes
    half = {"attention": _only_half(0), "mlp": _only_half(1), "sublayer": sublayer_remat}.get(what)

    def fn(x, weights, half=half):
        call = layer_call(c, rope_for(c, T), kernels=kn, data=data, kv_repeat=repeat)
        if context[0] > 1:  # as models/transformer.py layer_stack runs it: per-token positions, the trainer's strategy
            from models.context_parallel.gather import ContextPlan
            coll, pos = _OneContextRank(context[0]), jax.numpy.arange(T, dtype=jax.numpy.float32)
            plan = ContextPlan(context[0], context[1], tuple(range(mc.seq_len)))
            call = layer_call(c, rope_for(c, T, jax.numpy.broadcast_to(jax.numpy.arange(T), (rows, T))), kernels=kn,
                              data=data, kv_repeat=repeat, collectives=coll,
                              attention=plan.attention(kn.attention, coll, pos))
        run = lambda x, weights: spec.layer(c, weights, x, call._replace(half=half) if half else call)[0]  # noqa
        if what not in ("none", "attention", "mlp", "sublayer"):
            run = jax.checkpoint(run, policy=REMAT[what], prevent_cse=False)
        return run(x, weights)
    return _residuals(fn, x, weights)


def _ctx(st: Strategy) -> tuple:
    """(context ranks, their attention strategy) of a layout, as the traced layer takes them."""
    return (st.context, st.context_attention)


class _OneContextRank(LocalCollectives):
    """The collectives (meshes/collectives.py) as one of `ranks` context ranks sees them, for tracing one layer at
    one device's shapes: a gather over `seq` repeats the rank's block (the gathered K/V are the row's size), every
    other axis one rank (models/spec.py's local form)."""

    def __init__(self, ranks: int):
        self.ranks = ranks

    def axis_size(self, logical: str) -> int:
        return self.ranks if logical == "seq" else 1

    def all_gather(self, x, logical: str, axis: int = 0):
        return jax.numpy.concatenate([x] * self.ranks, axis) if logical == "seq" else x

    def all_to_all(self, x, logical: str, split_axis: int, concat_axis: int):
        if logical != "seq":
            return x
        return jax.numpy.concatenate(jax.numpy.split(x, self.ranks, split_axis), concat_axis)


def _saved(mc: ModelConfig, tp: int, dtype: str, platform: str, what: str, rows: int,
           context: tuple = (1, "all_gather")) -> float:
    """A dense layer's residuals are linear in its rows; an MoE layer's are not (its experts' rows are padded to
    whole tiles, at most ceil(choices / tile) + experts of them): traced at `rows`."""
    if sparse(mc) and what != "head":
        return _traced(_no_remat(mc), tp, dtype, platform, what, rows, context)
    if what == "head":  # traced at a rank's tokens whatever its attention: one trace for every strategy
        context = (context[0], "all_gather")
    fixed, per = _per_row(_no_remat(mc), tp, dtype, platform, what, context)
    return fixed + per * rows


def layer_residuals(mc: ModelConfig, st: Strategy, dtype: str, platform: str) -> tuple[float, float]:
    """(bytes whatever the batch, bytes per token) one layer saves for its backward on one device of `platform`, as
    it runs."""
    fixed, per_row = _per_row(_no_remat(mc), st.model, dtype, platform, executed(st).remat, _ctx(st))
    return fixed, per_row / (mc.seq_len // st.context)


def head_bytes(mc: ModelConfig, st: Strategy, dtype: str, platform: str, rows: int, local: bool = False) -> float:
    """The head and loss at `rows` sequences per device: JAX's residuals and the backward's working set.
    The tiling rule sees the step's tokens, or with `local` (the pipeline's loss, inside a shard_map
    manual over `data`) this device's.

    Whole logits: the residuals hold the (N, V) float32 logits and the backward adds their gradient.
    Tiled (model.loss_chunk, models/objectives/cross_entropy.py): each token's logsumexp instead of its logits; the
    backward holds one vocabulary block's logits, softmax and gradient (N, V/blocks), the float32
    input gradient and the head weight's gradient as the blocks fill it in.
    """
    from models.objectives.cross_entropy import chunk_tokens, vocab_blocks
    N, D = rows * mc.seq_len // st.context, mc.d_model  # this device's tokens
    V = mc.vocab_size // st.model  # the vocabulary is split over `model`
    logits = 4.0 * N * V
    res = _saved(mc, st.model, dtype, platform, "head", rows, _ctx(st))
    seen = N if local else N * st.data
    n = chunk_tokens(mc.loss_chunk, seen, mc.vocab_size)
    if not n:
        return res + logits
    blocks = vocab_blocks(mc.vocab_size, -(-seen // n))
    return res - logits + 4.0 * N + 3 * logits / blocks + 4.0 * N * D + 4.0 * V * D


def activation_bytes(mc: ModelConfig, st: Strategy, batch: int, dtype: str, platform: str) -> float:
    """Residuals saved for the backward pass (JAX's own list, at one device's shapes), per device."""
    b = batch // (st.data * st.microbatches)  # sequences per device and microbatch
    if st.stage == 1:
        saved = mc.n_layers * _saved(mc, st.model, dtype, platform, st.remat, b, _ctx(st))
        recompute = _recompute(mc, st, dtype, platform, b) if st.remat != "none" else 0.0
        return saved + recompute + head_bytes(mc, st, dtype, platform, b) + expert_working_bytes(mc, st, b, dtype, platform)
    return pipeline_activation_bytes(mc, st, b, dtype, platform)


def expert_working_bytes(mc: ModelConfig, st: Strategy, b: int, dtype: str, platform: str) -> float:
    """What the backward through an MoE layer holds beyond its residuals, on one device at b sequences.
    Three copies of its experts' float32 weights (XLA:CPU's buffer assignment of a (8,1,1) step): the layer's slice
    of the stacked weights (under ZeRO-3, the gathered layer counted in buffer_bytes), the tile scan's gradient
    accumulators and the layer's gradient before it is written into the stack's. A dense layer's weights are a few
    percent of its activations; an MoE's experts are n_experts times a dense MLP's (a rank's n_experts / ranks under
    expert parallelism). And the dispatch's two
    cotangents, one row per choice (on CPU padded to whole tiles per expert, models/kernels/experts.py): the experts' output's
    and their input's."""
    if not sparse(mc):
        return 0.0
    from models.transformer import inventory
    c = _shard(mc, st.model)[0]
    over = st.rules["experts"]  # expert parallelism: a rank's experts alone
    experts = 4.0 * sum(math.prod(p.shape) for k, p in inventory(c)["layers"].items() if "experts" in p.axes) / (
        st.mesh[over] if over else 1)
    rows = family(mc.family).dispatch_rows(mc, b * mc.seq_len // st.context, platform)
    dispatch = 2.0 * rows * mc.d_model * jax.numpy.dtype(dtype).itemsize
    # less the slice where ZeRO-3 gathered the layer (buffer_bytes), less the gradient where a pipeline's stage body
    # counts it (pipeline_activation_bytes)
    copies = 3 - (st.zero >= 3 and st.data > 1) - (st.stage > 1)
    return copies * experts + dispatch


def _recompute(mc: ModelConfig, st: Strategy, dtype: str, platform: str, b: int) -> float:
    """What one layer's backward rebuilds under remat: its residuals, or sublayer's larger half's."""
    if st.remat == "sublayer":
        return max(_saved(mc, st.model, dtype, platform, half, b, _ctx(st)) for half in ("attention", "mlp"))
    return _saved(mc, st.model, dtype, platform, "none", b, _ctx(st))


def _layer_weight_bytes(mc: ModelConfig, tp: int) -> float:
    """One layer's float32 weights on one device (what its vjp returns as gradient)."""
    from models.transformer import inventory
    return 4.0 * sum(math.prod(p.shape) for p in inventory(_shard(mc, tp)[0])["layers"].values())


def pipeline_activation_bytes(mc: ModelConfig, st: Strategy, b: int, dtype: str, platform: str) -> float:
    """A pipeline stage's activations for b sequences per microbatch: the stage inputs and cotangents
    its schedule keeps live (trainer/plan/schedule_cost.py) plus one tick's working set."""
    n = b * mc.seq_len // st.context * mc.d_model * jax.numpy.dtype(dtype).itemsize  # one stage input
    body = mc.n_layers // (st.stage * st.repeats)
    # a stage body's residuals, rebuilt for its vjp; under sublayer remat its half inputs and one half's
    recompute = body * _saved(mc, st.model, dtype, platform, "none", b, _ctx(st))
    if st.remat == "sublayer":
        recompute = body * _saved(mc, st.model, dtype, platform, "sublayer", b, _ctx(st)) + _recompute(mc, st, dtype, platform,
                                                                                                 b)
    # live inputs and cotangents; the tick's stage input, cotangent and output (the
    # input cotangent reuses the output's buffer); then a backward (the vjp's residuals and block
    # gradient) or, on the last stage, the head and loss of one microbatch: never both in one tick
    c = cost(st.schedule, st.stage, st.microbatches, st.repeats)
    return ((c.inputs + c.cotangents + 3) * n + max(recompute + body * _layer_weight_bytes(mc, st.model) +
                                                    expert_working_bytes(mc, st, b, dtype, platform),
                                                    head_bytes(mc, st, dtype, platform, b, local=True)))


def gather_casts(platform: str, a: int) -> tuple[float, float]:
    """The share of their float32 bytes ZeRO-3's gathers move, for the top weights and the layers'.
    trainer/step.py casts each layer weight to the compute dtype (a bytes) before its gather; XLA:TPU
    also moves the embedding's casts ahead of its gather (seen in its HLO); XLA:CPU gathers bfloat16
    as float32 (it widens the gather's operand), so on CPU both stay whole."""
    if platform == "cpu":
        return 1.0, 1.0
    return (a / 4 if platform == "tpu" else 1.0), a / 4


def buffer_bytes(mc: ModelConfig, train, st: Strategy, a: int, platform: str) -> float:
    """Transient gradient and weight buffers that are not persistent state (a: bytes of the compute dtype,
    which ZeRO-3's data-parallel step gathers its layer weights in, on `platform`)."""
    ls = leaves(mc, train, st)
    top = sum(x.bytes for x in ls if x.zero and not x.layers)
    lay = sum(x.bytes for x in ls if x.zero and x.layers)
    zero3 = st.zero >= 3 and st.data > 1
    if st.stage > 1:  # ZeRO-3 gathers one repeat of the stage's layers
        # under ZeRO-2/3 the step's whole gradient accumulates before its reduce-scatter; its shard is
        # already state (XLA's scratch grows by about nothing from ZeRO-1 to ZeRO-2)
        whole = sum(x.bytes for x in ls) - sum(jax.tree.leaves(leaf_bytes(mc, train, st, "grad")))
        # circular schedule: the stage's layers re-laid out in circular order, and their gradient (the
        # table executor accumulates it in circular order; moved back, it is the gradient counted above)
        stored = sum(x.bytes / (st.data if zero3 and x.zero else 1) for x in ls if x.layers)
        circ = 2 * stored if st.repeats > 1 else 0.0
        return circ + ((top + lay / st.repeats) if zero3 else 0.0) + whole
    out = 0.0
    if st.zero < 3 and (st.microbatches > 1 or (st.zero == 2 and st.data > 1)):
        # one microbatch's whole gradient before it is added or reduce-scattered (ZeRO-3 reduce-scatters
        # each layer's inside the scan, so its whole gradient never exists)
        out += sum(x.bytes for x in ls)
    if zero3:  # gathered layer weights: kept for the backward without remat (or sublayer's), else one layer's
        c_top, c_lay = gather_casts(platform, a)
        top, lay = top * c_top, lay * c_lay
        out += top + (lay if st.remat in ("none", "sublayer") else lay / mc.n_layers)
    return out
