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
from models.spec import family, sparse, stacks
from trainer.optim import make_optimizer, map_params
from trainer.parallel.reduction import Decision, decide
from trainer.plan.schedule_cost import cost
from trainer.plan.trace import device_view, no_remat, per_row, traced
from trainer.plan.types import Strategy, executed


@functools.lru_cache(maxsize=64)
def _abstract(mc: ModelConfig, train):
    """Parameter shapes, logical axes and optimizer-state shapes (cached per model and optimizer)."""
    params, logical, decay, frozen = _model_shapes(mc)
    tx, _ = make_optimizer(train, decay, frozen)
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
    return _leaf_bytes(no_remat(mc), train, st.mesh, st.zero, st.rules, kind)


@functools.lru_cache(maxsize=4096)
def _leaf_bytes(mc: ModelConfig, train, mesh, zero: int, rules, kind: str) -> dict:
    """leaf_bytes by what places the weights (mesh, ZeRO, rules), which a search's layouts share (7b on 256
    devices: 8,525 layouts, 427 placements). Shared: read it, never change it."""
    params, logical, _, _ = _abstract(mc, train)
    fn, sizes = getattr(Layout(mesh.abstract(), zero, rules), f"{kind}_spec"), mesh.as_dict()
    return jax.tree.map(lambda s, lg: _local(s.shape, fn(s.shape, lg), sizes) * s.dtype.itemsize, params, logical)


def state_bytes(mc: ModelConfig, train, st: Strategy) -> tuple[float, float, float]:
    """(params, grads, optimizer state) bytes per device."""
    _, _, tx, opt = _abstract(no_remat(mc), train)
    p = sum(jax.tree.leaves(leaf_bytes(mc, train, st, "param")))
    # a pipeline's gradients come back as the data-parallel step's do (reduce-scattered under ZeRO-2/3); a frozen
    # weight (a LoRA base) has none: the step never computes it
    frozen = _model_shapes(no_remat(mc))[3]
    g = sum(0 if f else b for b, f in zip(jax.tree.leaves(leaf_bytes(mc, train, st, "grad")), jax.tree.leaves(frozen)))
    o = map_params(tx, lambda _, b: b, opt, leaf_bytes(mc, train, st, "opt"),
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
    frozen: bool = False  # no gradient (a LoRA base, models/frozen.py): never reduced, still gathered under ZeRO-3


@functools.lru_cache(maxsize=64)
def decision(mc: ModelConfig, train, st: Strategy) -> Decision:
    """How the trainer reduces each gradient of this layout, and where (trainer/parallel/reduction.py)."""
    params, logical, _, _ = _abstract(no_remat(mc), train)
    return decide(_layout(st), params, logical, st.grad_sync, st.microbatches)


def leaves(mc: ModelConfig, train, st: Strategy) -> list[Leaf]:
    """Every parameter with its compute-spec bytes, model split and its gradient's reduction (the trainer's)."""
    return _leaves(no_remat(mc), train, Strategy(st.mesh, st.zero, st.microbatches, "none", grad_sync=st.grad_sync,
                                                  rules=st.rules))


@functools.lru_cache(maxsize=4096)
def _leaves(mc: ModelConfig, train, st: Strategy) -> list[Leaf]:
    """leaves of a layout reduced to what places the weights and decides their reduction (mesh, ZeRO, rules,
    microbatches, gradient sync). Shared: read it, never change it."""
    params, frozen = _abstract(mc, train)[0], _model_shapes(mc)[3]
    full = leaf_bytes(mc, train, st, "compute")
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    out = []
    for (path, _), r, b, f in zip(flat, jax.tree.leaves(decision(mc, train, st).leaves), jax.tree.leaves(full),
                                  jax.tree.leaves(frozen)):
        ways = math.prod(st.model for e in r.spec if e == MODEL or (isinstance(e, tuple) and MODEL in e))
        name = jax.tree_util.keystr(path)
        out.append(Leaf(name, name.startswith("['layers']"), float(b), ways, r.dim is not None, bool(r.split),
                        st.axes_left(r.split) if r.split else "", bool(f)))
    return out


def _ctx(st: Strategy, mc: ModelConfig) -> tuple:
    """(context ranks, their attention strategy) of a layout, as the traced layer takes them; and the model ranks
    under sequence parallelism, for a model whose layers are Llama's halves (trainer/plan/trace.py
    `one_model_rank` shapes them; another family's own halves are traced whole: counted high)."""
    sp = st.sequence_parallel and \
        family(mc.family).attention is None and family(mc.family).mlp is None and not sparse(mc)
    return (st.context, st.context_attention) + ((st.model,) if sp else ())


def _saved(mc: ModelConfig, tp: int, dtype: str, platform: str, what: str, rows: int,
           context: tuple = (1, "all_gather"), stack: str = "layers") -> float:
    """A dense layer's residuals are linear in its rows; an MoE layer's are not (its experts' rows are padded to
    whole tiles, at most ceil(choices / tile) + experts of them): traced at `rows`. `stack`: whose layer
    (models/spec.py `stacks`; a family's first layers are dense)."""
    if sparse(mc) and what != "head" and stack == "layers":
        return traced(no_remat(mc), tp, dtype, platform, what, rows, context)
    if what == "head":  # traced at a rank's tokens whatever its attention: one trace for every strategy
        context = (context[0], "all_gather")
    fixed, per = per_row(no_remat(mc), tp, dtype, platform, what, context, stack)
    return fixed + per * rows


def _stacks_saved(mc: ModelConfig, tp: int, dtype: str, platform: str, what: str, rows: int, context: tuple,
                  only_first: bool = False) -> float:
    """_saved of every layer of every stack (of the first layers alone with `only_first`)."""
    return sum(n * _saved(mc, tp, dtype, platform, what, rows, context, stack) for stack, n in stacks(mc).items()
               if stack == "first_layers" or not only_first)


def layer_residuals(mc: ModelConfig, st: Strategy, dtype: str, platform: str) -> tuple[float, float]:
    """(bytes whatever the batch, bytes per token) one layer saves for its backward on one device of `platform`, as
    it runs."""
    fixed, per_seq = per_row(no_remat(mc), st.model, dtype, platform, executed(st).remat, _ctx(st, mc))
    return fixed, per_seq / (mc.seq_len // st.context)


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
    res = _saved(mc, st.model, dtype, platform, "head", rows, _ctx(st, mc))
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
        saved = _stacks_saved(mc, st.model, dtype, platform, st.remat, b, _ctx(st, mc))
        recompute = _recompute(mc, st, dtype, platform, b) if st.remat != "none" else 0.0
        return saved + recompute + head_bytes(mc, st, dtype, platform, b) + expert_working_bytes(mc, st, b, dtype, platform) \
            + module_bytes(mc, st, dtype, platform, b)
    return pipeline_activation_bytes(mc, st, b, dtype, platform) + module_bytes(mc, st, dtype, platform, b)


def module_bytes(mc: ModelConfig, st: Strategy, dtype: str, platform: str, b: int) -> float:
    """The multi-token-prediction modules' residuals at b sequences per device (on the last stage): per depth, its
    decoder layer's (never rematerialized), its head's and loss's, and its concatenated, projected input."""
    if not mc.mtp_depth:
        return 0.0
    N = b * mc.seq_len // st.context
    own = 3.0 * N * mc.d_model * jax.numpy.dtype(dtype).itemsize  # [enorm(e), hnorm(h)] (2D) and eh_proj's output
    layer = _saved(mc, st.model, dtype, platform, "none", b, _ctx(st, mc), "mtp")
    return mc.mtp_depth * (layer + head_bytes(mc, st, dtype, platform, b) + own)


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
    c = device_view(mc, st.model)[0]
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
    """What one layer's backward rebuilds under remat: its residuals, or sublayer's larger half's. Under routed
    expert parallelism the MLP half's are one sender's run's (`_routed_run`), not every choice's."""
    routed = _routed_run(mc, st, dtype, platform, b)
    if st.remat != "sublayer" and routed is None:
        return _saved(mc, st.model, dtype, platform, "none", b, _ctx(st, mc))
    halves = [_saved(mc, st.model, dtype, platform, half, b, _ctx(st, mc)) for half in ("attention", "mlp")]
    halves[1] = halves[1] if routed is None else routed
    return max(halves) if st.remat == "sublayer" else sum(halves)


def _routed_run(mc: ModelConfig, st: Strategy, dtype: str, platform: str, b: int) -> float | None:
    """The MLP half's working set where the family's dispatch is buffered (ModelSpec.dispatch_run; an MoE's routed
    dropless dispatch, models/kernels/experts.py): the receiver runs one sender's run of `cap` choices at a time,
    recomputed for its backward (traced as the half at cap / k tokens, with a rank's experts), beside the buffer
    of R x cap rows, its outputs and their way back. None where it is not."""
    spec, over = family(mc.family), st.rules["experts"]
    R = st.mesh[over] if over else 1
    cap = spec.dispatch_run(mc, b * mc.seq_len // st.context, R)
    if cap is None:
        return None
    # the part that does not grow with the runs is the experts' weights in the compute dtype, all of them in the
    # trace, a rank's share of them here
    fixed, per_run = per_row(dataclasses.replace(no_remat(mc), seq_len=max(1, cap // spec.experts_active(mc))),
                             st.model, dtype, platform, "mlp")
    return fixed / R + per_run + 3.0 * R * cap * mc.d_model * jax.numpy.dtype(dtype).itemsize


def _layer_weight_bytes(mc: ModelConfig, tp: int) -> float:
    """One layer's float32 weights on one device (what its vjp returns as gradient)."""
    from models.transformer import inventory
    return 4.0 * sum(math.prod(p.shape) for p in inventory(device_view(mc, tp)[0])["layers"].values())


def pipeline_activation_bytes(mc: ModelConfig, st: Strategy, b: int, dtype: str, platform: str) -> float:
    """A pipeline stage's activations for b sequences per microbatch: the stage inputs and cotangents
    its schedule keeps live (trainer/plan/schedule_cost.py) plus one tick's working set."""
    n = b * mc.seq_len // st.context * mc.d_model * jax.numpy.dtype(dtype).itemsize  # one stage input
    body = stacks(mc)["layers"] // (st.stage * st.repeats)
    # a stage body's residuals, rebuilt for its vjp (the first stage's with the first layers, which its embedding
    # step runs); under sublayer remat its half inputs and one half's
    recompute = body * _saved(mc, st.model, dtype, platform, "none", b, _ctx(st, mc)) + _stacks_saved(
        mc, st.model, dtype, platform, "none", b, _ctx(st, mc), only_first=True)
    if st.remat == "sublayer":
        recompute = body * _saved(mc, st.model, dtype, platform, "sublayer", b, _ctx(st, mc)) + _recompute(mc, st, dtype, platform,
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


def merged_bytes(mc: ModelConfig, st: Strategy, ls: list, a: int) -> float:
    """LoRA's merged weights (models/lora.py `merged`, in the compute dtype, a bytes) the backward keeps: every
    layer's without remat (or sublayer's), one layer's with it. Under ZeRO-3 they stand where the gathered layer
    weights do (buffer_bytes counts those instead)."""
    if mc.lora is None:
        return 0.0
    from models.lora import adapter_of
    names = {x.name for x in ls}
    stored = 2 if mc.lora.base_dtype == "bfloat16" else 4
    total = sum(x.bytes / stored * a for x in ls
                if x.layers and x.frozen and f"['layers']['{adapter_of(x.name[12:-2])}']" in names)
    return total if st.remat in ("none", "sublayer") else total / stacks(mc)["layers"]


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
        whole = sum(x.bytes for x in ls if not x.frozen) - state_bytes(mc, train, st)[1]
        # circular schedule: the stage's layers re-laid out in circular order, and their gradient (the
        # table executor accumulates it in circular order; moved back, it is the gradient counted above)
        stored = sum(x.bytes / (st.data if zero3 and x.zero else 1) for x in ls if x.layers)
        circ = 2 * stored if st.repeats > 1 else 0.0
        return circ + ((top + lay / st.repeats) if zero3 else merged_bytes(mc, st, ls, a)) + whole
    out = 0.0 if zero3 else merged_bytes(mc, st, ls, a)
    if st.zero < 3 and (st.microbatches > 1 or (st.zero == 2 and st.data > 1)):
        # one microbatch's whole gradient before it is added or reduce-scattered (ZeRO-3 reduce-scatters
        # each layer's inside the scan, so its whole gradient never exists)
        out += sum(x.bytes for x in ls if not x.frozen)
    if zero3:  # gathered layer weights: kept for the backward without remat (or sublayer's), else one layer's
        c_top, c_lay = gather_casts(platform, a)
        top, lay = top * c_top, lay * c_lay
        out += top + (lay if st.remat in ("none", "sublayer") else lay / stacks(mc)["layers"])
    return out
