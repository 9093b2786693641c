"""How each gradient is reduced, decided once from the layout: the step (trainer/step.py), the pipeline executor,
local SGD and the planner's traffic (trainer/plan/comm.py) read it.

Gradients are summed over the mesh axes the batch is split over (`Layout.batch_axes`: `data`, and `context` where
the rules split sequences), since each rank differentiates its own rows (its own tokens of them under `context`).
Per leaf (`LeafReduction`), over those axes but any its rules split it over (experts="expert": each rank's slice of
the experts has a gradient of its own, already summed over its expert ranks' tokens, which reached it by all-to-all
and came back; summing over `expert` would add different experts' gradients together):
  none            the rules split the leaf over every batch axis: nothing to sum
  reduce-scatter  ZeRO 2/3, the leaf has a ZeRO dimension: summed, each rank keeping its block
  all-reduce      the rest: summed, each rank keeping the whole
The reducers read the axes a leaf is summed over from its compute spec (trainer/parallel/sync.py `Psum.over`).
and where (`Decision.where`):
  compiler   grad_sync=auto, ZeRO 0/1, one microbatch (or one data rank), whole rows: plain jit, XLA inserts the
             sums
  explicit   the step's shard_map manual over the batch axes: ZeRO 2/3 per microbatch (ZeRO-3's reduce-scatter is
             the transpose of its per-layer all-gather), ZeRO 0/1 once, after accumulation
  pipeline   the pipeline executor's shard_map (manual over `stage` too): once per step, after its tick loop
The reducers (trainer/parallel/sync.py) reduce what they are given; `per_microbatch`, `per_step` and `once` give
them each leaf that needs it, and the manual specs keep a leaf the rules split split at every ZeRO stage.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from meshes import Layout
from trainer.parallel import sync

NONE, ALL_REDUCE, REDUCE_SCATTER = "none", "all-reduce", "reduce-scatter"
COMPILER, EXPLICIT, PIPELINE = "compiler", "explicit", "pipeline"


@dataclasses.dataclass(frozen=True)
class LeafReduction:
    """One leaf's gradient: its reduction (NONE, ALL_REDUCE, REDUCE_SCATTER) over `axes`, its ZeRO dimension (None:
    none), its compute spec (the layout the ring's inner shard_map sees) and the batch axes its rules split it over."""
    kind: str
    axes: tuple
    dim: int | None
    spec: P
    split: tuple


def where_of(layout: Layout, grad_sync: str, microbatches: int) -> str:
    """COMPILER, EXPLICIT or PIPELINE (the module docstring) for a layout, train.grad_sync and train.microbatches."""
    if layout.split("layers") > 1:
        return PIPELINE
    ranks = math.prod(layout.mesh.shape[a] for a in layout.batch_axes)
    # context parallelism runs manual over data x context: the compiler's partitioner gathered whole activations
    # over `context` for the weight gradients (a (2,1,4,1) step: the residual stream and MLP hidden units of every
    # layer: 2.95 MB over context against the explicit step's 0.20 MB, the tiny model at T=64) where each rank's partial sums
    # need only the gradients' all-reduce
    if grad_sync != "auto" or (ranks > 1 and (layout.zero_stage >= 2 or microbatches > 1)) or layout.split("seq") > 1:
        return EXPLICIT
    return COMPILER


def leaf_reduction(layout: Layout, shape, logical) -> LeafReduction:
    axes = layout.batch_axes
    split = tuple(a for a in axes if a in layout.rule_axes(shape, logical))
    left = tuple(a for a in axes if a not in split)
    dim = layout.data_dim(shape, logical)
    kind = NONE if not left else REDUCE_SCATTER if layout.zero_stage >= 2 and dim is not None else ALL_REDUCE
    return LeafReduction(kind, left, dim, layout.compute_spec(shape, logical), split)


@dataclasses.dataclass(frozen=True, eq=False)
class Decision:
    """Every parameter's LeafReduction (a tree like the parameters) and where the reductions run."""
    layout: Layout
    where: str
    leaves: Any
    shapes: Any  # the parameters' ShapeDtypeStructs
    logical: Any  # their logical axes

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes gradients are summed over (and the explicit step's shard_map is manual over)."""
        return self.layout.batch_axes

    @property
    def axis(self):
        """`axes` as the reducers' one axis name: the name, or the tuple of names (`data` x `context`: jax's
        collectives take it as one axis, ranks in mesh order)."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    @property
    def size(self) -> int:
        return math.prod(self.layout.mesh.shape[a] for a in self.axes)

    @property
    def dims(self):
        return jax.tree.map(lambda r: r.dim, self.leaves)

    @property
    def specs(self):
        return jax.tree.map(lambda r: r.spec, self.leaves)

    def split(self):
        """Whether each leaf is split over the batch axes by its rules (its gradient never reduced over them)."""
        return jax.tree.map(lambda r: r.kind == NONE, self.leaves)

    def manual_specs(self, kind: str, manual) -> Any:
        """Each leaf's `kind` spec (param | grad | opt) over the mesh axes `manual` (a shard_map's in/out specs)."""
        return jax.tree.map(lambda sh, lg: self.layout.manual_spec(kind, sh.shape, lg, manual), self.shapes,
                            self.logical)

    def reducer(self, grad_sync: str):
        """train.grad_sync's reducer over the gradients' axis."""
        return sync.make(grad_sync, self.axis, self.size)

    def _apply(self, g, kinds, fn):
        """fn(leaves, dims, specs) on the gradient leaves whose kind is in `kinds`, as lists; the rest as they are."""
        xs, treedef = jax.tree.flatten(g)
        rs = treedef.flatten_up_to(self.leaves)
        idx = [i for i, r in enumerate(rs) if r.kind in kinds]
        if not idx:
            return g
        out = list(xs)
        for i, y in zip(idx, fn([xs[i] for i in idx], [rs[i].dim for i in idx], [rs[i].spec for i in idx])):
            out[i] = y
        return jax.tree.unflatten(treedef, out)

    def per_microbatch(self, reducer, g):
        """The explicit step's reduction of one microbatch's gradients: ZeRO-2 reduce-scatters (all-reduces the
        leaves without a ZeRO dimension); ZeRO-3 all-reduces those only (its gather's transpose scattered the
        rest); ZeRO 0/1 nothing (`per_step`)."""
        zero = self.layout.zero_stage
        if zero == 2:
            return self._apply(g, (ALL_REDUCE, REDUCE_SCATTER), reducer.reduce_scatter_tree)
        if zero >= 3:
            return self._apply(g, (ALL_REDUCE,), lambda xs, ds, ss: [reducer.all_reduce(x, sp) for x, sp in zip(xs, ss)])
        return g

    def per_step(self, reducer, g):
        """The explicit step's reduction after accumulation: ZeRO 0/1 one all-reduce; ZeRO 2/3 nothing."""
        if self.layout.zero_stage >= 2:
            return g
        return self._apply(g, (ALL_REDUCE,), reducer.all_reduce_tree)

    def once(self, reducer, g):
        """The pipeline's reduction of the step's gradients, once: reduce-scatter for ZeRO 2/3 (all-reduce where a
        leaf has no ZeRO dimension), else all-reduce."""
        if self.layout.zero_stage >= 2:
            return self._apply(g, (ALL_REDUCE, REDUCE_SCATTER), reducer.reduce_scatter_tree)
        return self._apply(g, (ALL_REDUCE,), reducer.all_reduce_tree)

    def scattered(self):
        """Each leaf's ZeRO ranks (its ZeRO dimension's block count): the ranks of the axes it is summed over."""
        return jax.tree.map(lambda r: math.prod(self.layout.mesh.shape[a] for a in r.axes), self.leaves)


def decide(layout: Layout, shapes, logical, grad_sync: str, microbatches: int) -> Decision:
    """The decision for parameters of these shapes and logical axes on a layout."""
    leaves = jax.tree.map(lambda sh, lg: leaf_reduction(layout, sh.shape, lg), shapes, logical)
    return Decision(layout, where_of(layout, grad_sync, microbatches), leaves, shapes, logical)
