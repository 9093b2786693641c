"""The experts' matmuls of the MoE MLP (models/families/moe.py) and their dispatch under expert parallelism.

Letters as in models/families/moe.py: N tokens, k choices per token, M = N*k choices, X experts, F each expert's width.
FORMULATIONS, one per platform (BY_PLATFORM, measured by scripts/bench/moe_formulations.py); `grouped_mlp` runs the
platform's in a region manual over every axis, each batch rank its own tokens; where the run's rules split the
experts over a mesh axis (`expert`, or `data`: expert parallelism) the tokens reach their experts' ranks by all-to-all
in buffers of a factor x the balanced share, or around a ring where a buffer would overflow (dropless), or by
all-to-all in fixed slots (with a capacity).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from models.kernels.moe_tpu import megablox
from models.spec import LOCAL


def swiglu(silu, gate, up):
    """SwiGLU's gated unit, silu(gate) x up: the formulations' `glu` unless grouped_mlp is given another."""
    return silu(gate) * up


def _split(weights):
    """(gate, up, down, (the gate's bias, the up's) (X, F) or None) of a formulation's weights (gate, up, down[, the
    two biases]; the down projection's bias is grouped_mlp's, added once after the sum over the mlp slices)."""
    return weights[0], weights[1], weights[2], (tuple(weights[3:5]) if len(weights) > 3 else None)


def _hidden(glu, g, u, biases, b_at):
    """glu of the gate and up projections plus their biases at `b_at` (the rows' experts) where there are biases."""
    return glu(g, u) if biases is None else glu(*(v + b[b_at].astype(v.dtype) for v, b in zip((g, u), biases)))


def all_experts(h_ND, idx_NK, w_NK, weights, glu):
    """Every expert on every token, each output weighted by the token's weight for it (0 unless chosen)."""
    gate, up, down, biases = _split(weights)
    comb_NX = jnp.einsum("nk,nkx->nx", w_NK, jax.nn.one_hot(idx_NK, gate.shape[0], dtype=w_NK.dtype))
    a_XNF = _hidden(glu, jnp.einsum("nd,xdf->xnf", h_ND, gate), jnp.einsum("nd,xdf->xnf", h_ND, up), biases,
                    (jnp.arange(gate.shape[0])[:, None],))
    return jnp.einsum("xnf,xfd->nd", a_XNF * comb_NX.T[:, :, None], down)


def _by_expert(idx_NK, keep_NK, X: int):
    """The choices sorted by expert, a dropped one after the last: (order (M,) of the choices, each sorted
    choice's expert (M,), X for a dropped one, the kept choices of each expert (X,) int32)."""
    e_M = jnp.where(keep_NK, idx_NK, X).reshape(-1)
    order_M = jnp.argsort(e_M, stable=True)
    return order_M, e_M[order_M], jnp.sum(jax.nn.one_hot(e_M, X, dtype=jnp.int32), axis=0)


def ragged(h_ND, idx_NK, keep_NK, w_NK, weights, glu):
    """The choices sorted by expert, each expert's rows through its weights by jax.lax.ragged_dot."""
    gate, up, down, biases = _split(weights)
    K = idx_NK.shape[1]
    order_M, e_M, sizes_X = _by_expert(idx_NK, keep_NK, gate.shape[0])
    token_M = order_M // K
    x_MD = h_ND[token_M]
    a_MF = _hidden(glu, jax.lax.ragged_dot(x_MD, gate, sizes_X), jax.lax.ragged_dot(x_MD, up, sizes_X), biases,
                   jnp.minimum(e_M, gate.shape[0] - 1))
    y_MD = jax.lax.ragged_dot(a_MF, down, sizes_X) * w_NK.reshape(-1)[order_M][:, None]
    return jnp.zeros_like(h_ND).at[token_M].add(y_MD)


TILE = 128  # rows of a tile of `tiles` and `tile_scan`
# the named scope of the dispatch's exact path (_experts_routed), which runs only where a buffer overflows
EXACT_SCOPE = "moe_exact_path"


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


def tiles(h_ND, idx_NK, keep_NK, w_NK, weights, glu, t: int = TILE):
    """Sorted and padded to tiles of t rows (_tiles); every tile through its expert's weights, gathered
    per tile, in one batched matmul."""
    gate, up, down, biases = _split(weights)
    (N, D), K = h_ND.shape, idx_NK.shape[1]
    order_M, row_M, tile_expert, nT = _tiles(idx_NK, keep_NK, gate.shape[0], t)
    x_PD = jnp.zeros((nT * t, D), h_ND.dtype).at[row_M].set(h_ND[order_M // K], mode="drop")
    x_JtD = x_PD.reshape(nT, t, D)
    a_JtF = _hidden(glu, jnp.einsum("jtd,jdf->jtf", x_JtD, gate[tile_expert]),
                    jnp.einsum("jtd,jdf->jtf", x_JtD, up[tile_expert]), biases, (tile_expert[:, None],))
    y_PD = jnp.einsum("jtf,jfd->jtd", a_JtF, down[tile_expert]).reshape(nT * t, D)
    y_MD = y_PD.at[row_M].get(mode="fill", fill_value=0) * w_NK.reshape(-1)[order_M][:, None]
    return jnp.zeros_like(h_ND).at[order_M // K].add(y_MD)


def tile_scan(h_ND, idx_NK, keep_NK, w_NK, weights, glu, t: int = TILE):
    """As `tiles`, the tiles run one at a time by lax.scan, each indexing its expert's weights (no per-tile copy of
    the weights, forward or backward: `_expert_tiles`)."""
    gate, up, down, biases = _split(weights)
    (N, D), K = h_ND.shape, idx_NK.shape[1]
    order_M, row_M, tile_expert, nT = _tiles(idx_NK, keep_NK, gate.shape[0], t)
    x_PD = jnp.zeros((nT * t, D), h_ND.dtype).at[row_M].set(h_ND[order_M // K], mode="drop")
    y_PD = _expert_tiles(glu, x_PD.reshape(nT, t, D), tile_expert, gate, up, down, biases).reshape(nT * t, D)
    y_MD = y_PD.at[row_M].get(mode="fill", fill_value=0) * w_NK.reshape(-1)[order_M][:, None]
    return jnp.zeros_like(h_ND).at[order_M // K].add(y_MD)


def _tile_mlp(glu, x_tD, g_DF, u_DF, b):
    h_tF, u_tF = (x_tD @ g_DF, x_tD @ u_DF) if b is None else (x_tD @ g_DF + b[0], x_tD @ u_DF + b[1])
    return glu(h_tF, u_tF), (h_tF, u_tF)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _expert_tiles(glu, x_JtD, e_J, gate, up, down, biases=None):
    """Tile j of rows (J, t, D) through expert e_J[j]'s gated MLP (`glu` of the gate and up projections, each with
    its bias where `biases` holds the two (X, F)), by lax.scan. Autodiff of the scan would save each tile's slice of
    the weights and stack each tile's weight gradient (J copies of an expert's weights); here the backward scan adds
    each tile's weight gradients into the experts' in place, and keeps only the tiles' two (t, F) hidden
    projections."""
    return _expert_tiles_fwd(glu, x_JtD, e_J, gate, up, down, biases)[0]


def _expert_tiles_fwd(glu, x_JtD, e_J, gate, up, down, biases=None):
    def one(_, xe):
        x_tD, e = xe
        a_tF, hu = _tile_mlp(glu, x_tD, gate[e], up[e], None if biases is None else (biases[0][e], biases[1][e]))
        return None, (a_tF @ down[e], hu)
    y_JtD, hu_J = jax.lax.scan(one, None, (x_JtD, e_J))[1]
    return y_JtD, (x_JtD, e_J, gate, up, down, biases, hu_J)


def _expert_tiles_bwd(glu, res, dy_JtD):
    x_JtD, e_J, gate, up, down, biases, hu_J = res
    ws = (gate, up, down) + (() if biases is None else tuple(biases))

    def one(grads, xs):
        x_tD, e, (h_tF, u_tF), dy_tD = xs
        a_tF, glu_vjp = jax.vjp(glu, h_tF, u_tF)
        dh_tF, du_tF = glu_vjp(dy_tD @ down[e].T)
        f32 = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)  # summed over tiles in float32
        new = [f32(x_tD.T, dh_tF), f32(x_tD.T, du_tF), f32(a_tF.T, dy_tD)]
        if biases is not None:  # a padding row's cotangent is zero: it adds nothing
            new += [jnp.sum(dh_tF.astype(jnp.float32), axis=0), jnp.sum(du_tF.astype(jnp.float32), axis=0)]
        return tuple(g.at[e].add(n) for g, n in zip(grads, new)), dh_tF @ gate[e].T + du_tF @ up[e].T
    grads, dx_JtD = jax.lax.scan(one, tuple(jnp.zeros(w.shape, jnp.float32) for w in ws), (x_JtD, e_J, hu_J, dy_JtD))
    grads = tuple(g.astype(w.dtype) for g, w in zip(grads, ws))
    return (dx_JtD, None, *grads[:3], None if biases is None else grads[3:])


_expert_tiles.defvjp(_expert_tiles_fwd, _expert_tiles_bwd)


FORMULATIONS = {"all_experts": lambda h, i, k, w, ws, f: all_experts(h, i, jnp.where(k, w, 0), ws, f),
                "ragged_dot": ragged, "tiles": tiles, "tile_scan": tile_scan, "megablox": megablox}
# the formulation each platform runs (scripts/bench/moe_formulations.py measured the CPU's; docs/performance.md);
# `megablox`: the TPU's Pallas kernel (models/kernels/moe_tpu.py), in Pallas's interpreter off TPU
BY_PLATFORM = {"cpu": "tile_scan", "gpu": "ragged_dot", "tpu": "megablox"}
TOKENS, CHOICES = ("batch", "embed"), ("batch", None)
# the experts' weights (gate, up, down) and, where they have biases, the gate's, the up's and the down's
WEIGHT_AXES = (("experts", "embed", "mlp"), ("experts", "embed", "mlp"), ("experts", "mlp", "embed"),
               ("experts", "mlp"), ("experts", "mlp"), ("experts", "embed"))
IN_AXES = (TOKENS, CHOICES, CHOICES, CHOICES, WEIGHT_AXES[:3])


def grouped_mlp(h_ND, idx_NK, keep_NK, w_NK, weights, silu, platform: str = "cpu", impl: str | None = None,
                collectives=LOCAL, slots: tuple | None = None, routed: float | None = None, overflow: bool = False,
                recompute: bool = False, glu=None):
    """sum over each token's kept choices of weight x expert(h), each expert a gated MLP: SwiGLU (`silu`) or `glu`
    (gate, up) -> hidden units (gpt-oss's clamped one), `weights` (gate, up, down) or with their biases after them
    ((X, F), (X, F), (X, D): the down projection's added once per choice, after the sum over the hidden units'
    slices, weighted as its output); the platform's formulation, or `impl`.
    Where the run's rules split the experts over a mesh axis (expert parallelism), each rank's tokens reach the ranks
    holding their experts: with a capacity (`slots`: (each choice's slot (N, k), slots per expert per row, tokens
    per row)) by all-to-all in fixed per-row slots; dropless, with `routed` (a buffer factor > 0) sent to their
    experts' ranks and back by all-to-all in buffers of `routed` x the balanced share (_experts_routed), else the
    ranks' tokens gathered and the results reduce-scattered (_experts_gathered). `overflow`: return (y, (N,) float32
    1 where the token's rank dispatched by the exact path because some buffer overflowed, else 0). `recompute` (a
    remat policy): the routed buffers' runs recomputed for their backward one at a time (_by_sender)."""
    name = impl or BY_PLATFORM.get(platform, "ragged_dot")
    glu = glu or functools.partial(swiglu, silu)
    fn = FORMULATIONS[name]
    if name == "megablox":
        fn = functools.partial(fn, interpret=platform != "tpu")

    # manual over every axis (XLA cannot partition megablox's Mosaic kernel; the others gain by it too): each data
    # rank sorts and runs its own tokens (a sort over the whole batch gathered it onto every rank: 4.9x the planner's
    # bytes at (8,1,1), tests/test_moe_plan.py), through its slice of the experts' hidden units, the down
    # projection's partial sums added over `mlp` once, after the combine (N x D, not N x k x D)
    def rank(h, i, k, w, ws, slot):
        over, b_down = jnp.zeros((), jnp.float32), ws[5] if len(ws) > 5 else None
        ws = ws[:5]
        if collectives.axis_size("experts") == 1:
            y = fn(h, i, k, w, ws, glu)
        elif slots is None and routed and routed > 0:  # TPU: by ragged all-to-all
            y, over = _experts_routed(fn, collectives, h, i, k, w, ws, glu, routed, platform == "tpu", recompute)
        elif slots is None:
            y = _experts_gathered(fn, collectives, h, i, k, w, ws, glu)
        else:
            y = _experts_all_to_all(collectives, h, i, k, w, ws, glu, slot, *slots[1:])
        y = collectives.psum(y, "mlp")
        if b_down is not None:  # every expert's (X, D) on each rank: a choice's expert may be another rank's
            if collectives.axis_size("experts") > 1:
                b_down = collectives.all_gather(b_down, logical="experts", axis=0)
            y = y + jnp.einsum("nk,nkd->nd", jnp.where(k, w, 0), b_down[i].astype(w.dtype)).astype(y.dtype)
        return y, jnp.broadcast_to(over, h.shape[:1])
    slot_NK = jnp.zeros_like(idx_NK) if slots is None else slots[0]
    axes = IN_AXES[:4] + (WEIGHT_AXES[:len(weights)], CHOICES)
    y, over_N = collectives.region(rank, axes, (TOKENS, ("batch",)))(
        h_ND, idx_NK, keep_NK, w_NK, tuple(weights), slot_NK)
    return (y, over_N) if overflow else y


def _local_choices(coll, idx_NK, keep_NK, El: int):
    """(each choice's expert among this rank's El (clipped), whether it is kept and this rank's)."""
    local_NK = idx_NK - coll.axis_index("experts") * El
    return jnp.clip(local_NK, 0, El - 1), keep_NK & (local_NK >= 0) & (local_NK < El)


def _experts_gathered(fn, coll, h_ND, idx_NK, keep_NK, w_NK, weights, glu):
    """Dropless expert parallelism: every rank's tokens and choices gathered over `experts` (in rank order: the
    batch's order, so each expert sees its tokens in the order one device does), this rank's experts run on the
    choices of them, the results summed over the ranks and scattered back to the tokens' ranks (no buffer sized by
    the worst case; model.dispatch_factor <= 0)."""
    gather = functools.partial(coll.all_gather, logical="experts", axis=0)
    X = weights[0].shape[0] * coll.axis_size("experts")
    # a choice that is not kept (padding) travels as expert X, held by no rank
    h, idx, w = gather(h_ND), gather(jnp.where(keep_NK, idx_NK, X)), gather(w_NK)
    local, mine = _local_choices(coll, idx, jnp.ones(idx.shape, bool), weights[0].shape[0])
    y = fn(h, local, mine, jnp.where(mine, w, 0), weights, glu)
    return coll.reduce_scatter(y, "experts", 0)


def _experts_ring(fn, coll, h_ND, idx_NK, keep_NK, w_NK, weights, glu, chunk: int):
    """Dropless expert parallelism in a ring (MaxText's "ring of experts"), the exact path of _experts_routed: R
    steps, each rank running its experts on the block of tokens it holds (its own first), adding their outputs to
    the block's accumulator, and passing block and accumulator on to the next rank (a collective-permute); after R
    steps every block is home with the sum of every rank's experts. Only a block's tokens and its accumulator are
    held, not R x N (the all-gather's), and each block runs in runs of about `chunk` choices, each recomputed for
    its backward: the working set is the buffers' path's, which XLA holds beside it."""
    El, R = weights[0].shape[0], coll.axis_size("experts")
    (N, D), K = h_ND.shape, idx_NK.shape[1]
    t = next(t for t in range(max(1, min(N, chunk // K)), 0, -1) if N % t == 0)  # tokens per run
    run = jax.checkpoint(lambda a: fn(*a, weights, glu))
    every = jnp.ones(idx_NK.shape, bool)

    def step(carry, _):
        h, idx, w, acc = carry
        local, mine = _local_choices(coll, idx, every, El)
        args = (h, local, mine, jnp.where(mine, w, 0))
        y = jax.lax.map(run, tuple(x.reshape((N // t, t) + x.shape[1:]) for x in args)).reshape(h.shape)
        return tuple(coll.shift(x, "experts") for x in (h, idx, w, acc + y.astype(acc.dtype))), None
    X = El * R  # a choice not kept travels as expert X, held by no rank
    carry = (h_ND, jnp.where(keep_NK, idx_NK, X), w_NK, jnp.zeros((N, D), h_ND.dtype))
    return jax.lax.scan(step, carry, None, length=R)[0][3]


def _by_sender(fn, R: int, x, e, w, weights, glu, recompute: bool = False):
    """fn on a received buffer of R senders' runs (x (R cap, D), each row's expert there e (El: no row), weight w),
    one sender's run at a time (lax.map): the experts' working set, their hidden units of every row (F wide) kept
    for the backward and the backward's own, that of cap rows, not of R x cap; `recompute`: nothing kept, each run's
    forward recomputed for its backward (jax.checkpoint)."""
    El = weights[0].shape[0]

    def one(a):
        x, e, w = a
        mine = e < El
        return fn(x, jnp.minimum(e, El - 1)[:, None], mine[:, None], jnp.where(mine, w, 0)[:, None], weights, glu)
    one = jax.checkpoint(one) if recompute else one
    return jax.lax.map(one, tuple(v.reshape((R, -1) + v.shape[1:]) for v in (x, e, w))).reshape(
        (x.shape[0],) + x.shape[1:])


def _experts_all_to_all(coll, h_ND, idx_NK, keep_NK, w_NK, weights, glu, slot_NK, C: int, T: int):
    """Expert parallelism with a capacity (GShard's dispatch): each rank's kept choices written into a buffer of C
    slots per expert per row, (X, rows, C, D), whose experts' blocks go to the ranks holding them by all-to-all over
    `experts`; each rank runs its experts on every slot it received (an empty slot is zeros and gives zeros), and
    the results come back by the reverse all-to-all and are combined with the routing weights. Bytes known before
    the step: X x rows x C x D each way."""
    gate, up, down, biases = _split(weights)
    (N, D), K, El, R = h_ND.shape, idx_NK.shape[1], gate.shape[0], coll.axis_size("experts")
    X, B = El * R, N // T
    row_NK = jnp.broadcast_to((jnp.arange(N) // T)[:, None], (N, K))
    at_NK = jnp.where(keep_NK, (idx_NK * B + row_NK) * C + slot_NK, X * B * C)  # past the end: dropped
    token_NK = jnp.broadcast_to(jnp.arange(N)[:, None], (N, K))
    buf = jnp.zeros((X * B * C, D), h_ND.dtype).at[at_NK.reshape(-1)].set(h_ND[token_NK.reshape(-1)], mode="drop")
    got = coll.all_to_all(buf.reshape(X, B, C, D), "experts", 0, 1)  # (El, R B, C, D): my experts' slots
    x = got.reshape(El, R * B * C, D)
    a = _hidden(glu, jnp.einsum("end,edf->enf", x, gate), jnp.einsum("end,edf->enf", x, up), biases,
                (jnp.arange(El)[:, None],))
    y = jnp.einsum("enf,efd->end", a, down).reshape(El, R * B, C, D)
    back = coll.all_to_all(y, "experts", 1, 0).reshape(X * B * C, D)  # (X, B, C, D): my tokens' outputs
    y_NKD = back.at[at_NK].get(mode="fill", fill_value=0)
    return jnp.einsum("nk,nkd->nd", w_NK, y_NKD)


def buffer_rows(M: int, R: int, factor: float) -> int:
    """Rows of each destination's buffer for M choices over R ranks: `factor` x the balanced share M / R, whole
    multiples of 8, at most M (a rank never sends more)."""
    share = -(-int(math.ceil(factor * M)) // R)
    return min(M, -(-share // 8) * 8)


def routes(dest_M, R: int, cap: int):
    """How a rank's choices travel to the ranks holding their experts: dest_M (M,) each choice's rank, R for one
    not sent. (order (M,): the choices sorted by rank, stably; sizes (R,) int32: choices to each rank; offsets (R,):
    where each rank's run starts in that order; slot (M,): each sorted choice's place in its rank's run; over: some
    run longer than cap). One function for the padded buffers of the all-to-all (CPU) and the ragged all-to-all's
    offsets and sizes (TPU)."""
    M = dest_M.shape[0]
    order = jnp.argsort(dest_M, stable=True)
    d = dest_M[order]
    sizes = jnp.sum(jax.nn.one_hot(dest_M, R, dtype=jnp.int32), axis=0)
    offsets = jnp.cumsum(sizes) - sizes
    slot = jnp.arange(M, dtype=jnp.int32) - offsets[jnp.minimum(d, R - 1)]
    return order, sizes, offsets, slot, jnp.any(sizes > cap)


def _experts_routed(fn, coll, h_ND, idx_NK, keep_NK, w_NK, weights, glu, factor: float, ragged: bool = False,
                    recompute: bool = False):
    """Dropless expert parallelism by all-to-all: each kept choice's token sent to the rank holding its expert in a
    buffer of buffer_rows(M, R, factor) rows per destination (with its expert there and its routing weight), that
    rank's experts run on the rows it received, the weighted results sent back by the reverse all-to-all and added
    to their tokens. Bytes per rank: R x rows x D each way, fixed by the factor, not growing with R as the
    gathered path's R x N x D. Where some rank's choices for some destination overflow its buffer, every rank
    (one psum of the flag) takes the exact path, the ring (_experts_ring), instead: no choice is ever dropped.
    (y, whether it was taken: float32 0 or 1). `ragged` (TPU): the same buffers filled by ragged all-to-alls of the
    sorted choices, whose offsets and sizes are `routes`' (_ragged_routed)."""
    El, R = weights[0].shape[0], coll.axis_size("experts")
    (N, D), K = h_ND.shape, idx_NK.shape[1]
    M = N * K
    cap = buffer_rows(M, R, factor)
    dest_M = jnp.where(keep_NK, idx_NK // El, R).reshape(-1)
    order, sizes, offsets, slot, over = routes(dest_M, R, cap)
    d = dest_M[order]
    token = order // K
    at = jnp.where((d < R) & (slot < cap), d * cap + slot, R * cap)  # past the end: not sent

    def routed():
        if ragged:
            return _ragged_routed(fn, coll, h_ND[token], idx_NK.reshape(-1)[order] - d * El, w_NK.reshape(-1)[order],
                                  token, jnp.minimum(sizes, cap), offsets, cap, N, weights, glu, recompute)

        def put(x, fill):
            return jnp.full((R * cap,) + x.shape[1:], fill, x.dtype).at[at].set(x, mode="drop")
        there = lambda x: coll.all_to_all(x.reshape((R, cap) + x.shape[1:]), "experts", 0, 0).reshape(  # noqa
            (R * cap,) + x.shape[1:])
        x = there(put(h_ND[token], 0))
        e = there(put(idx_NK.reshape(-1)[order] - d * El, El))  # the expert among the receiver's El; El: no row
        w = there(put(w_NK.reshape(-1)[order], 0))
        y = _by_sender(fn, R, x, e, w, weights, glu, recompute)
        back = there(y)  # each row home, where it was sent from
        return jnp.zeros((N, D), y.dtype).at[token].add(back.at[at].get(mode="fill", fill_value=0))

    # the exact path recomputed whole for its backward: linearized, a conditional's every branch returns the
    # residuals of both (the untaken one's zeros), and the ring's (its R steps' blocks) would be held every layer
    ring = jax.checkpoint(lambda: _experts_ring(fn, coll, h_ND, idx_NK, keep_NK, w_NK, weights, glu, cap))

    def exact():
        with jax.named_scope(EXACT_SCOPE):  # its collectives named so (trainer/plan/hlo.py lists them apart)
            return ring()
    taken = coll.psum(over.astype(jnp.int32), "experts") > 0
    return jax.lax.cond(taken, exact, routed), taken.astype(jnp.float32)


def _ragged_routed(fn, coll, x_MD, e_M, w_M, token_M, sizes, offsets, cap: int, N: int, weights, glu,
                   recompute: bool = False):
    """_experts_routed's exchange by ragged all-to-alls (TPU): the choices sorted by destination (x, their expert
    there e, weight w; rows past the last run are not sent) go as runs `sizes` from `offsets` (routes') to each
    rank's buffer of R x cap rows, sender i's run at i x cap (the layout of the padded form); the results come back
    into the sorted order (the receivers' runs from i x cap, to where each sender's run started: its offsets,
    exchanged) and are added to their tokens. Only the rows of the runs travel; the buffers bound them."""
    El, R = weights[0].shape[0], sizes.shape[0]
    me = coll.axis_index("experts")
    swap = lambda v: coll.all_to_all(v.reshape(R, 1), "experts", 0, 0).reshape(R)  # noqa: E731 (rank i's entry for me)
    recv, home = swap(sizes), swap(offsets)  # rows each rank sends me, where its run to me starts in its order
    there = jnp.full((R,), me * cap, jnp.int32)

    def send(v, fill):
        out = jnp.full((R * cap,) + v.shape[1:], fill, v.dtype)
        return coll.ragged_all_to_all(v, out, offsets, sizes, there, recv, "experts", cap)
    x, e, w = send(x_MD, 0), send(e_M, El), send(w_M, 0)
    y = _by_sender(fn, R, x, e, w, weights, glu, recompute)
    starts = jnp.arange(R, dtype=jnp.int32) * cap
    back = coll.ragged_all_to_all(y, jnp.zeros((x_MD.shape[0],) + y.shape[1:], y.dtype), starts, recv, home, sizes,
                                  "experts", cap)
    return jnp.zeros((N,) + y.shape[1:], y.dtype).at[token_M].add(back)
