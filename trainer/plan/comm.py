"""Bus bytes per device of every collective in one step, per mesh axis, as XLA emits them.

Bus bytes are what one device sends with ring algorithms (trainer/parallel/collective_costs.py: all-reduce
2(K-1)/K x S, the others (K-1)/K x S, S the unsharded array), a pipeline hop S. These rules
follow the HLO that step.py, parallel/sync.py and parallel/pipeline.py compile to (trainer/plan/hlo.py reads the
same quantity from it; tests/test_plan.py holds each to 5%), inefficiencies included: where XLA does
more than the textbook, the rule says so. A pipeline (any schedule) follows the table executor
(trainer/parallel/pipeline.py, `_table_transfers`).

Letters: K = data, S = stage, tp = model, M microbatches, n tokens per device and microbatch,
a bytes of the compute dtype, act = n*D*a one microbatch's residual stream.
"""
from __future__ import annotations

import math

from meshes import CONTEXT, MODEL, STAGE
from meshes.collectives import pairwise_ring
from models import ModelConfig, family
from models.spec import stacks
from trainer.parallel.collective_costs import bus_factor
from trainer.parallel.circular import circular_moves
from trainer.parallel.reduction import EXPLICIT, PIPELINE
from trainer.plan.memory import Leaf, decision, gather_casts, leaves
from trainer.plan.schedule_cost import cost
from trainer.plan.split_residual import split_ends, split_transfers
from trainer.plan.types import Strategy, Transfer


def transfers(mc: ModelConfig, train, st: Strategy, batch: int, a: int, platform: str) -> list[Transfer]:
    """Every collective of one step on devices of `platform`, per mesh axis, in bus bytes per device. Which
    gradients are reduced, how and where is the trainer's decision (trainer/parallel/reduction.py): a leaf its rules
    split over `data` (experts) moves nothing over `data`."""
    ls = leaves(mc, train, st)
    n = batch // (st.data * st.microbatches) * mc.seq_len // st.context  # tokens per device and microbatch
    where = decision(mc, train, st).where
    # leaves the rules split over a batch axis (an MoE's experts over `expert`) are summed over the axes left
    rest = {x.left for x in ls if x.split and x.left}
    if where == PIPELINE:
        out = _table_transfers(mc, st, ls, n, a, platform)
        for over in sorted(rest):
            out += _table_data_sync(st, [x for x in ls if x.split and x.left == over], _ranks(st, over), over)
    else:
        out = ((_data_transfers(mc, st, [x for x in ls if not x.split], n, a, platform, where == EXPLICIT)
                if st.data * st.context > 1 else [])
               + (_model_transfers(mc, st, n, a, platform) if st.model > 1 else []))
        for over in sorted(rest):
            out += _data_transfers(mc, st, [x for x in ls if x.split and x.left == over], n, a, platform,
                                   where == EXPLICIT, (_ranks(st, over), over))
    out += _expert_transfers(mc, st, n, a) + _context_transfers(mc, st, ls, n, a, platform, mc.documents)
    out += _aux_tables(mc, st)
    return [t for t in out if t.bytes > 0]


def _aux_tables(mc, st: Strategy) -> list[Transfer]:
    """The layers' aux tables (ModelSpec.aux_shapes: DeepSeek's expert loads, which its router bias moves by after
    the step) summed over the step's whole batch, once per step: an all-reduce over the batch axes (and `stage`,
    each stage holding its layers' rows)."""
    size = 4.0 * sum(math.prod(shape) for shape in family(mc.family).aux_shapes(mc).values())
    axes = [(ax, k) for ax, k in ((st.batch_axes, st.data * st.context), (STAGE, st.stage)) if k > 1]
    return [Transfer(ax, "all-reduce", "the layers' aux tables (expert loads) summed over the step's batch",
                     bus_factor("all-reduce", k) * size) for ax, k in axes if size]


def _ranks(st: Strategy, over: str) -> int:
    """The ranks of the mesh axes a Transfer names (comma-separated)."""
    return math.prod(st.mesh[a] for a in over.split(","))


def _context_transfers(mc, st: Strategy, ls: list[Leaf], n: int, a: int, platform: str,
                       documents: bool) -> list[Transfer]:
    """Context parallelism (models/context_parallel/gather.py): each layer's attention traffic per microbatch (again where the
    layer is recomputed: remat, a pipeline's stage bodies), by strategy; the batch's reorder; leaves the rules split
    over `data` (experts) summed over `context` alone."""
    C = st.context
    if C == 1:
        return []
    tp, m = st.model, st.microbatches
    kv_heads = mc.n_kv_heads // tp if mc.n_kv_heads >= tp else 1  # repeated kv heads: one per model rank
    block = n * kv_heads * mc.head_dim * a  # one rank's K (or V) of one layer
    uses = m * mc.n_layers // st.stage
    forwards = 2 if st.remat != "none" or st.stage > 1 else 1
    ag, rows = bus_factor("all-gather", C), n * C // mc.seq_len  # rows per device and microbatch
    if st.context_attention == "all_to_all":
        out = _ulysses_transfers(mc, st, n, a, kv_heads, uses, forwards, documents, rows)
    elif st.context_attention == "ring":
        out = _ring_transfers(mc, st, n, a, block, uses, forwards, documents, pairwise_ring(platform))
    else:
        # the all-gather's backward gathers K and V again (models/context_parallel/gather.py): a second gather per
        # layer wherever the backward runs in a loop of its own (scanned layers) or beside a recomputed forward
        # (XLA sends those two once); unrolled without remat XLA merges it with the forward's
        L = mc.n_layers // st.stage
        scanned = mc.scan_layers or (mc.scan_layers is None and (L > 8 or st.remat != "none"))
        out = _gather_transfers(mc, st, block, uses, 2 if scanned or forwards > 1 else 1, documents, rows)
    if st.balance:  # the step's reorder of each row (int32 / float32 fields it reads: tokens, targets, loss weights,
        # and with documents their ids and positions), all-gathered over `context` and sliced
        fields = 5 if documents else 3
        out.append(Transfer(CONTEXT, "all-gather", "the batch reordered for load balancing",
                            ag * fields * 4 * rows * m * mc.seq_len, fields))
    return out


def _ulysses_transfers(mc, st: Strategy, n: int, a: int, kv_heads: int, uses: int, forwards: int, documents: bool,
                       rows: int) -> list[Transfer]:
    """models/context_parallel/gather.py all_to_all, per layer and microbatch: q, k and v (kv heads repeated where their count
    does not split over the ranks) sent to their head group's rank and the output back; the transposes in the
    backward; the documents gathered, where there are any, once per microbatch."""
    C = st.context
    kv = kv_heads * (C // math.gcd(kv_heads, C))
    sent = n * (2 * mc.n_heads // st.model + 2 * kv) * mc.head_dim * a  # q, o and k, v of one layer, one rank
    a2a = bus_factor("all-to-all", C)
    out = [Transfer(CONTEXT, "all-to-all", "q, k, v to their head group's rank and the output back (forward"
                    + (", again where recomputed)" if forwards > 1 else ")"), forwards * uses * a2a * sent,
                    4 * forwards * uses),
           Transfer(CONTEXT, "all-to-all", "their transposes (backward)", uses * a2a * sent, 4 * uses)]
    if documents:  # the same for every layer: gathered once per microbatch
        m = st.microbatches
        out.append(Transfer(CONTEXT, "all-gather", "the documents of the whole row",
                            m * bus_factor("all-gather", C) * 4 * rows * mc.seq_len, m))
    return out


def _ring_transfers(mc, st: Strategy, n: int, a: int, block: float, uses: int, forwards: int,
                    documents: bool, pairwise: bool) -> list[Transfer]:
    """models/context_parallel/ring.py, per layer and microbatch: C - 1 steps around the ring, each passing the K and V block with
    its keys' positions (and documents); the backward passes them again with their float32 dK and dV accumulators,
    which take one more step home. pairwise: inside a pipeline on CPU (meshes/collectives.py pairwise_ring)."""
    steps = st.context - 1
    meta = 4 * mc.seq_len // st.context + (4 * n if documents else 0)  # the block's positions (and documents)
    kv = 2 * block + meta
    acc = 2 * block * 4 / a  # dK and dV, float32, around the ring
    home = 2 * block  # and home, in the compute dtype
    if st.stage > 1 and pairwise:  # meshes/collectives.py _pair_shift: each step two all-gathers within pairs
        # (one for C = 2), each receiving the partner's block; the stage body's forward runs again in its backward's
        # vjp
        x = 1 if st.context == 2 else 2
        return [Transfer(CONTEXT, "all-gather", "K and V blocks around the ring, pairwise (forward, again where "
                         "recomputed)", x * forwards * uses * steps * kv, x * forwards * uses * steps * (3 + documents)),
                Transfer(CONTEXT, "all-gather", "K, V and their float32 gradients around the ring, pairwise "
                         "(backward)", x * uses * (steps * (kv + acc) + home), x * uses * (steps * (5 + documents) + 2))]
    # a recomputed forward (remat; a pipeline's backward tick) passes the same blocks as the backward beside it: XLA
    # sends them once (one op), so `forwards` adds nothing
    return [Transfer(CONTEXT, "collective-permute", "K and V blocks around the ring (forward)", uses * steps * kv,
                     uses * steps * (3 + documents)),
            Transfer(CONTEXT, "collective-permute", "K, V and their float32 gradients around the ring (backward)",
                     uses * (steps * (kv + acc) + home), uses * (steps * (5 + documents) + 2))]


def _gather_transfers(mc, st: Strategy, block: float, uses: int, forwards: int, documents: bool,
                      rows: int) -> list[Transfer]:
    """models/context_parallel/gather.py all_gather: each layer's K and V gathered (`forwards` times: 2 where the
    backward gathers them again), dK and dV reduce-scattered back, the tokens' positions (and documents) gathered once
    per microbatch."""
    C, m = st.context, st.microbatches
    ag = bus_factor("all-gather", C)
    return [Transfer(CONTEXT, "all-gather", "K and V gathered over context (forward"
                    + (", again in the backward)" if forwards > 1 else ")"), forwards * uses * ag * 2 * C * block,
                    2 * forwards * uses),
           Transfer(CONTEXT, "reduce-scatter", "dK and dV reduce-scattered over context (backward)",
                    uses * ag * 2 * C * block, 2 * uses),
           Transfer(CONTEXT, "all-gather", "the tokens' positions" + (" and documents" if documents else ""),
                    m * ag * 4 * mc.seq_len * (1 + (rows if documents else 0)), m * (1 + documents))]


TRANSPOSE = {"all-gather": "reduce-scatter", "reduce-scatter": "all-gather", "all-to-all": "all-to-all",
             "collective-permute": "collective-permute"}


def _expert_transfers(mc, st: Strategy, n: int, a: int) -> list[Transfer]:
    """Expert parallelism (the rules split `experts` over `expert`, or `data`): each MoE layer's dispatch (its
    family's expert_collectives, models/spec.py), per layer and microbatch: forward; again where the layer is
    recomputed (any remat policy: a collective is no dot, so `dots` recomputes it too; every pipeline stage body),
    those whose results the backward reads; the differentiable ones' transposes in the backward. Those of the exact
    path a dispatch takes only where a buffer overflows are listed apart (Transfer.overflow)."""
    axis = st.rules["experts"]
    ranks = st.mesh[axis] if axis else 1
    if ranks == 1:
        return []
    uses = st.microbatches * stacks(mc)["layers"] // st.stage  # the MoE layers (a family's first ones are dense)
    recomputed = st.remat != "none" or st.stage > 1
    out = []
    for kind, what, size, grad, again, *exact in family(mc.family).expert_collectives(mc, n, ranks, a):
        hop = kind == "collective-permute"  # a hop sends its array whole (R of them: the ring's steps)
        bus, exact = (1.0 if hop else bus_factor(kind, ranks)) * size, bool(exact and exact[0])
        # a pipeline's stage body runs its forward whole again for its vjp (nothing left out); remat, what is read
        forwards = 2 if (recomputed and again) or st.stage > 1 else 1
        out.append(Transfer(axis, kind, f"experts: {what} (forward)", forwards * uses * bus, forwards * uses,
                            overflow=exact))
        if grad:
            back = TRANSPOSE[kind]
            out.append(Transfer(axis, back, f"experts: {what} (backward)",
                                uses * (1.0 if hop else bus_factor(back, ranks)) * size, uses, overflow=exact))
    return out


def _data_transfers(mc, st: Strategy, ls: list[Leaf], n: int, a: int, platform: str,
                    explicit: bool, split: tuple[int, str] | None = None) -> list[Transfer]:
    """The gradients' reduction and ZeRO's gathers of the leaves `ls`: over the batch axes, or (`split`: (ranks,
    axes)) over the axes left to leaves the rules split over one of them (no embedding, no loss there)."""
    (k, over), m, zero, tp = split or (st.data * st.context, st.batch_axes), st.microbatches, st.zero, st.model
    ar, ag = bus_factor("all-reduce", k), bus_factor("all-gather", k)
    grads = sum(x.bytes for x in ls if not x.frozen)  # a frozen weight (a LoRA base) has no gradient to reduce
    zeroed = sum(x.bytes for x in ls if x.zero)
    wire = 0.5 if st.grad_sync == "ring_bf16" else 1.0
    out = []
    if explicit:
        # psum_scatter / all_gather inside the data-manual shard_map see model-split leaves whole:
        # XLA gathers them over `model` first and moves the unsplit leaf over `data`. The ring runs
        # manual over `model` too, so there each device rings only its own slice.
        psum = st.grad_sync in ("auto", "psum")

        def whole(sel):
            return sum(x.bytes * (x.model_split if psum else 1) for x in ls if sel(x))

        def over_model(sel):
            return sum(x.bytes * x.model_split for x in ls if psum and sel(x) and x.model_split > 1)

        if zero >= 2:
            out += [Transfer(over, "reduce-scatter", "gradient reduce-scatter, every microbatch",
                             m * ag * whole(lambda x: x.zero and not x.frozen) * wire, m),
                    Transfer(MODEL, "all-gather", "model-split gradients gathered before their reduce-scatter",
                             m * bus_factor("all-gather", tp) * over_model(lambda x: x.zero and not x.frozen), m),
                    Transfer(over, "all-reduce", "all-reduce of leaves too small to shard",
                             m * ar * sum(x.bytes for x in ls if not x.zero and not x.frozen), m)]
        else:
            out.append(Transfer(over, "all-reduce", f"gradient all-reduce ({st.grad_sync}), once per step",
                                ar * grads * wire, 1))
        if zero >= 3:
            # the backward pass gathers again under full/dots remat (sublayer's halves get gathered weights)
            again = 1 if st.remat in ("none", "sublayer") else 2
            top, lay = (lambda x: x.zero and not x.layers), (lambda x: x.zero and x.layers)
            c_top, c_lay = gather_casts(platform, a)
            out += [Transfer(over, "all-gather", "ZeRO-3 weight all-gathers (per layer and microbatch"
                             + (", again in backward)" if again > 1 else ")"),
                             ag * (whole(top) * c_top + m * again * whole(lay) * c_lay), 1 + m * again),
                    Transfer(MODEL, "all-gather", "model-split ZeRO-3 shards gathered over model",
                             bus_factor("all-gather", tp) * (over_model(top) * c_top + m * again * over_model(lay)
                                                             * c_lay) / k, 1 + m * again)]
    else:
        embed = _embed_bytes(mc, st) if mc.tie_embeddings and not split else 0.0
        if zero >= 1 and embed:
            # the lookup's gradient rows go all-to-all; the head's part is reduced with the rest
            out.append(Transfer(over, "all-to-all", "embedding-lookup gradient rows", ag * n * mc.d_model * 4, 1))
            if tp > 1:
                grads -= embed
                out.append(Transfer(f"{over},{MODEL}", "all-reduce", "tied head gradient",
                                    bus_factor("all-reduce", k * tp) * embed, 1))
        else:
            grads += embed  # the lookup's and the head's embedding gradients are reduced apart
        # one microbatch here: accumulation takes the manual path, which reduces once after its loop
        out.append(Transfer(over, "all-reduce", "gradient all-reduce (compiler)", ar * grads, 1))
    if zero in (1, 2):
        out.append(Transfer(over, "all-gather", "updated parameters all-gathered", ag * zeroed, 1))
    return out


def _embed_bytes(mc: ModelConfig, st: Strategy) -> float:
    return mc.vocab_size // st.model * mc.d_model * 4


def _model_transfers(mc, st: Strategy, n: int, a: int, platform: str) -> list[Transfer]:
    """Megatron activation all-reduces. The backward's input gradient of the column-parallel
    projections is one all-reduce per `models.transformer.projections` group: q/k/v together
    (q apart from k/v with grouped-query attention) and gate/up together."""
    tp, m = st.model, st.microbatches
    ar = bus_factor("all-reduce", tp)
    act = n * mc.d_model * a
    layers = mc.n_layers // st.stage
    # forward: after wo and w_down; backward: the projection groups; full remat recomputes the
    # first (the layer's output is not needed again); `dots` saves the projection outputs instead
    per_layer = 2 + _groups(mc, tp) + (1 if st.remat == "full" else 0)
    own = family(mc.family).tp_reductions
    if own is not None:  # the family's own: the widths each layer of each stack all-reduces, in d_model's units
        units = sum(rows * sum(own(mc, stack, st.remat)) for stack, rows in stacks(mc).items()) / mc.d_model
        per_layer = units / mc.n_layers
    if st.sequence_parallel:
        return (split_transfers("tensor-parallel activations", m * layers * per_layer, m * layers, act, st.remat,
                                platform, tp)
                + [t.times(m * layers) for t in _shared_kv_transfers(mc, tp, n, a)]
                + split_ends(m, n, mc.d_model, a, tp, platform))
    out = [Transfer(MODEL, "all-reduce", f"tensor-parallel activations ({per_layer:g} per layer and microbatch)",
                    m * ar * layers * per_layer * act, m * layers * per_layer)]
    out += [t.times(m * layers) for t in _shared_kv_transfers(mc, tp, n, a)]
    # the vocab-split embedding lookup (forward) and head (backward), plus the loss's per-token sums
    out.append(Transfer(MODEL, "all-reduce", "vocab-parallel embedding, head and loss",
                        m * ar * (2 * act + 3 * n * 4), 4 * m))
    return out


def _groups(mc: ModelConfig, tp: int) -> int:
    """Backward all-reduces of a layer's input gradient, one per projection group with split weights:
    q/k/v together (q apart from k/v with grouped-query attention; k/v not at all when they are
    replicated over `model`), and gate/up."""
    if mc.n_kv_heads < tp:
        return 2
    return (1 if mc.fused_qkv else 2) + 1


def _shared_kv_transfers(mc: ModelConfig, tp: int, n: int, a: int) -> list[Transfer]:
    """One layer's backward with fewer kv heads than `model` (k/v replicated over it): each rank's
    dK and dV for its kv head are summed over the g = tp/K ranks sharing it, then gathered over the K
    heads, so that the replicated k/v projections get their whole gradient."""
    K = mc.n_kv_heads
    if K >= tp:
        return []
    g, head = tp // K, n * mc.head_dim * a  # one kv head's dK (or dV) on one device
    return [Transfer(MODEL, "all-reduce", "dK, dV summed over the ranks sharing a kv head",
                     2 * bus_factor("all-reduce", g) * head, 1),
            Transfer(MODEL, "all-gather", "dK, dV gathered over the kv heads",
                     2 * bus_factor("all-gather", K) * K * head, 2)]


def _table_transfers(mc, st: Strategy, ls: list[Leaf], n: int, a: int, platform: str) -> list[Transfer]:
    """The table executor (trainer/parallel/pipeline.py): two ppermutes every tick of the table, the
    stage's top gradients summed over `stage`, the data-axis sync of the stage's share once per step.

    The hops run on idle ticks too (zeros): one microbatch each way per tick, whatever the table
    says. Without a wrap (V = 1) the chain has S-1 senders, so a device sends (S-1)/S of that.
    """
    k, S, tp, m, V = st.data * st.context, st.stage, st.model, st.microbatches, st.repeats
    ticks, body = cost(st.schedule, S, m, V).ticks, stacks(mc)["layers"] // (S * V)
    act, senders = n * mc.d_model * a, (S if V > 1 else S - 1)
    hop = act / tp if st.sequence_parallel else act  # sequence parallelism: each model rank sends its T/M tokens
    top = sum(x.bytes for x in ls if not x.layers)
    reduced = [x for x in ls if not x.split]  # the leaves whose gradients are reduced over every batch axis
    out = [Transfer(STAGE, "collective-permute", "pipeline hops (activation forward, cotangent back, every tick)",
                    2 * ticks * hop * senders / S, 2 * ticks),
           Transfer(STAGE, "all-reduce", "embedding, head and final-norm gradients and the loss summed over stage",
                    bus_factor("all-reduce", S) * (top + 4), 1)]
    if V > 1:  # circular_blocks: the stage's layers (gathered already under ZeRO-3) to their blocks, and back
        groups = [g for g in circular_moves(S, V) if g[0]]
        moved = sum(b // V != b % S for b in range(S * V)) / (S * V)
        stored = sum(x.bytes for x in ls if x.layers)
        out.append(Transfer(STAGE, "collective-permute", "layer weights to their circular blocks (and gradients back)",
                            2 * moved * stored, 2 * len(groups)))
    if k > 1:
        out += _table_data_sync(st, reduced, k, st.batch_axes)
    if tp > 1:  # the branch a stage runs each tick: per microbatch and repeat one forward and one backward
        ar = bus_factor("all-reduce", tp)
        # forward: after wo and w_down; backward: the recomputed forward (its last all-reduce is dead)
        # and one per projection group
        per_mb = 2 * body + (2 * body - 1) + _groups(mc, tp) * body
        if st.sequence_parallel:
            return (out + split_transfers("tensor-parallel activations", m * V * per_mb, m * V * body, act, "full",
                                          platform, tp) + split_ends(m / S, n, mc.d_model, a, tp, platform, m / S)
                    + [t.times(m * V * body) for t in _shared_kv_transfers(mc, tp, n, a)])
        out += [Transfer(MODEL, "all-reduce", f"tensor-parallel activations ({per_mb} per microbatch and block)",
                         m * V * per_mb * ar * act, m * V * per_mb)]
        out += [t.times(m * V * body) for t in _shared_kv_transfers(mc, tp, n, a)]
        # stage 0 embeds (forward and recompute), the last stage's head: logits' max, sum and target, the
        # head's input gradient; averaged over the stages
        out.append(Transfer(MODEL, "all-reduce", "vocab-parallel embedding, head and loss (first and last stage)",
                            m * ar * (3 * act + 3 * n * 4) / S, 5 * m / S))
    return out


def _table_data_sync(st: Strategy, reduced: list[Leaf], k: int, axes: str) -> list[Transfer]:
    """The table executor's sync over the batch axes `axes` (k ranks), once per step after the tick loop: the
    stage's share of the gradients (`reduced`: the leaves reduced over them) and, under ZeRO, its parameters; the
    loss where they are every batch axis."""
    tp, zero, out = st.model, st.zero, []
    ar, ag = bus_factor("all-reduce", k), bus_factor("all-gather", k)
    wire = 0.5 if st.grad_sync == "ring_bf16" else 1.0
    share = sum(x.bytes for x in reduced)  # the stage's layers and the top, at the compute spec
    zeroed = sum(x.bytes for x in reduced if x.zero)
    # as in _data_transfers: psum_scatter and all_gather see model-split leaves whole (gathered
    # over `model` first); the ring and every all-reduce move the device's own slice
    psum, agm = st.grad_sync in ("auto", "psum"), bus_factor("all-gather", tp)
    whole = sum(x.bytes * (x.model_split if psum else 1) for x in reduced if x.zero)
    over_model = sum(x.bytes * x.model_split for x in reduced if psum and x.zero and x.model_split > 1)
    if zero >= 2:
        out += [Transfer(axes, "reduce-scatter", f"gradient reduce-scatter ({st.grad_sync}), once per step",
                         ag * whole * wire, 1),
                Transfer(MODEL, "all-gather", "model-split gradients gathered before their reduce-scatter",
                         agm * over_model, 1),
                Transfer(axes, "all-reduce", "all-reduce of leaves too small to shard", ar * (share - zeroed), 1)]
    else:
        out.append(Transfer(axes, "all-reduce", f"gradient all-reduce ({st.grad_sync}), once per step",
                            ar * share * wire, 1))
    if zero >= 3:
        out += [Transfer(axes, "all-gather", "ZeRO-3 weights gathered once per step, before the tick loop",
                         ag * whole, 1),
                Transfer(MODEL, "all-gather", "model-split ZeRO-3 shards gathered over model", agm * over_model / k, 1)]
    elif zero:
        out.append(Transfer(axes, "all-gather", "updated parameters all-gathered", ag * zeroed, 1))
    if axes == st.batch_axes:
        out.append(Transfer(axes, "all-reduce", "loss averaged over data", ar * 4, 1))
    return out
