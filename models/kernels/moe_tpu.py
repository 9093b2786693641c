"""The TPU's expert MLP: megablox's grouped matmul (jax.experimental.pallas.ops.tpu.megablox `gmm`, a Pallas/Mosaic
kernel with its own VJP, `tgmm` for the weights' gradients), the `megablox` formulation of models/kernels/experts.py.

XLA cannot partition a Mosaic kernel, so it runs in a region manual over every mesh axis (meshes/collectives.py,
over=None; models/kernels/experts.py's grouped_mlp runs every formulation so), in the plain step, the explicit one (manual
over the batch axes, `data` x `context`, already) and every pipeline schedule (manual over `stage` and the batch axes)
alike: each rank holds its tokens (split over the batch axes with the batch) and its slice of every expert's hidden
units (`mlp` over `model`); the down projection's partial sums over the slices are the region's own psum over `mlp`
(the identity where `model` is one rank), taken after the combine (N x D, not N x k x D).

Each rank sorts its N x k choices by expert, a dropped one after the last expert, pads the rows to whole tiles and
runs gate, up and down as grouped matmuls whose groups are the X experts plus one more, the dropped choices and the
padding: gmm computes no row of that last group and writes zeros there, forward and backward (its `rhs` holds X
groups of the X + 1), and tgmm sums the weights' gradients over the X experts' rows only. So a dropped choice
contributes nothing and gets no gradient. Off TPU the same code runs the kernel in Pallas's interpreter
(`interpret`: slow, for tests on CPU).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

# a tile's rows, contraction and output columns (fewer where the array is narrower): TPU's lane width; the rows are
# padded to whole tiles (gmm needs m divisible by its row tile)
TILE = 128


def grouped(lhs_PK, rhs_XKN, sizes, interpret: bool):
    """Rows of group g of lhs (P, K) through rhs[g] (X, K, N) for the first X groups of `sizes` ((X + 1,) int32
    summing to P); the last group's rows are zeros."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # Pallas's TPU module: loaded by the runs that use it
    k, n = rhs_XKN.shape[1:]
    tiling = (TILE, min(TILE, k), min(TILE, n))
    # positional: gmm is a custom_vjp whose non-differentiable arguments are the dtype, tiling, transpose, interpret
    return gmm(lhs_PK, rhs_XKN, sizes, lhs_PK.dtype, tiling, None, None, False, interpret)


def megablox(h_ND, idx_NK, keep_NK, w_NK, weights, glu, interpret: bool = False):
    """One rank's part: its tokens' choices through its slice of every expert, weighted and combined (models/kernels/experts.py's
    grouped_mlp runs it in its region and adds the partial sums over `mlp`). Where the experts have biases (gpt-oss)
    each sorted row's are gathered by its expert and added to the grouped matmuls' outputs, outside the kernel (gmm
    takes none), with `glu` (the clamp too) on them."""
    gate, up, down = weights[:3]
    (N, _), K, X = h_ND.shape, idx_NK.shape[1], gate.shape[0]
    M = N * K
    P = -(-M // TILE) * TILE
    e_M = jnp.where(keep_NK, idx_NK, X).reshape(-1)  # X: dropped (or padding), after every expert
    order_M = jnp.argsort(e_M, stable=True)
    sizes = jnp.zeros(X + 1, jnp.int32).at[e_M].add(1).at[X].add(P - M)
    token_M = order_M // K
    x_PD = jnp.pad(h_ND[token_M], ((0, P - M), (0, 0)))
    run = functools.partial(grouped, sizes=sizes, interpret=interpret)
    g_PF, u_PF = run(x_PD, gate), run(x_PD, up)
    if len(weights) > 3:  # the padding rows take the last expert's: their outputs are cut off below
        e_P = jnp.pad(jnp.minimum(e_M[order_M], X - 1), (0, P - M), constant_values=X - 1)
        g_PF, u_PF = (v + b[e_P].astype(v.dtype) for v, b in zip((g_PF, u_PF), weights[3:5]))
    a_PF = glu(g_PF, u_PF)
    y_MD = run(a_PF, down)[:M] * w_NK.reshape(-1)[order_M][:, None]
    return jnp.zeros_like(h_ND).at[token_M].add(y_MD)
