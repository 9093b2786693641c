"""Collectives over logical axes, for model code (models/spec.py `LayerCall.collectives`; the trainer builds one
from its layout and passes it in through `Placement`).

Each collective names a logical axis (`experts`, `mlp`, ...) and runs over the ranks of the mesh axes the rules map it
to that are manual where it is traced: inside the explicit step's shard_map (manual over the batch axes, `data` x
`context`), a pipeline's (`stage` and the batch axes) or a `region`. A mesh axis the compiler partitions (automatic)
or of size 1 counts as one rank: arrays are whole along it and the compiler does its sums, so there the axis's size is
1, its index 0 and every collective the identity (the local form models/spec.py gives decoding and the planner). Model
code thus writes each rank's part once, and it is right on every layout.

`region(fn, in_axes, out_axes, over)` runs fn on each rank's blocks in a shard_map manual over the mesh axes of the
logical axes `over`, nested in whatever is manual already (the compiler path: a nested shard_map; the explicit
step: none needed for the batch axes). over=None is fully manual: every mesh axis, for a kernel the compiler cannot
partition (a Pallas/Mosaic grouped matmul); the tensor-parallel sums over `model` are then fn's own
(`psum(x, "mlp")`), which elsewhere are the identity.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from meshes.axes import STAGE
from meshes.rules import keep


# The pipeline's axis: where it is manual, code runs in the table executor's per-stage branches
# (trainer/parallel/pipeline.py). XLA:CPU's collective-permute there is wrong: its rendezvous waits for every device
# of the program (jax 0.10.2: ring attention under (context 4, stage 2) 1F1B returns NaN losses; it used to deadlock
# a 2x4 mesh), where a collective with replica groups waits for its group's only. On CPU alone the ring's step is
# then `_pair_shift`; XLA:TPU and XLA:GPU run the collective-permute.
BRANCHED = STAGE


def _pair_shift(x, axes, n: int):
    """ppermute(x, i -> i + 1) over n ranks (n even) as all-gathers whose groups are pairs of neighbours: (2i, 2i+1),
    where an odd rank takes its partner's block, then (2i+1, 2i+2), where an even rank does (rank 0 from n - 1).
    Each rank receives two blocks for the one it keeps (one for n = 2)."""
    first = jax.lax.all_gather(x, axes, axis_index_groups=[[i, i + 1] for i in range(0, n, 2)])
    if n == 2:
        return first[1 - jax.lax.axis_index(axes)]
    second = jax.lax.all_gather(x, axes, axis_index_groups=[[i, (i + 1) % n] for i in range(1, n, 2)])
    return jnp.where(jax.lax.axis_index(axes) % 2 == 1, first[0], second[0])


def _local_ragged(x, out, start, size, at):
    """One rank's ragged exchange with itself: x's rows start : start + size to out's rows at : at + size."""
    i = jnp.arange(out.shape[0])
    src = jnp.clip(i - at + start, 0, x.shape[0] - 1)
    take = (i >= at) & (i < at + size)
    return jnp.where(take.reshape((-1,) + (1,) * (x.ndim - 1)), x[src], out)


def _padded_ragged(x, out, in_off, send, out_off, recv, axes, cap: int):
    """ragged_all_to_all's exchange as one all_to_all of chunks padded to `cap` rows (for XLA:CPU): chunk j holds
    x's rows in_off[j] : in_off[j] + send[j]; the receiver writes chunk i's first recv[i] rows at the offset sender
    i named for it (its out_off, sent along)."""
    R = in_off.shape[0]
    t = jnp.arange(cap)
    rows = jnp.clip(in_off[:, None] + t, 0, x.shape[0] - 1)  # (R, cap)
    live = t < send[:, None]
    chunks = jnp.where(live.reshape(live.shape + (1,) * (x.ndim - 1)), x[rows], jnp.zeros((), x.dtype))
    got = jax.lax.all_to_all(chunks, axes, 0, 0, tiled=True)  # chunk i: what rank i sent here
    at = jax.lax.all_to_all(out_off.reshape(R, 1), axes, 0, 0, tiled=True).reshape(R)  # where rank i put it
    dest = jnp.where(t < recv[:, None], at[:, None] + t, out.shape[0])  # past the end: padding, dropped
    return out.at[dest.reshape(-1)].set(got.reshape((R * cap,) + x.shape[1:]), mode="drop")


def pairwise_ring(platform: str | None) -> bool:
    """Whether a ring's step inside a pipeline is `_pair_shift` on devices of `platform` (BRANCHED): on CPU only."""
    return (platform or jax.default_backend()) == "cpu"


def _is_axes(x) -> bool:
    """A logical-axes tuple (one name or None per dimension), a leaf of in_axes / out_axes."""
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


class Collectives:
    """A run's collectives over logical axes: its rules and mesh, and which mesh axes are manual where traced."""

    def __init__(self, rules, mesh, platform: str | None = None):
        # platform: the devices' the program is built for (None: the runtime's default), see BRANCHED
        self.rules, self.mesh, self.platform = rules, mesh, platform

    # ---- where it runs

    def _context(self):
        """(the mesh in context, or the run's where none is set; the mesh axes manual there)."""
        m = jax.sharding.get_abstract_mesh()
        if m is None or not m.axis_names:
            return self.mesh, set()
        return m, {a for a, t in zip(m.axis_names, m.axis_types) if t == AxisType.Manual}

    def _mesh_axes(self, logical: str) -> tuple[str, ...]:
        entry = self.rules[logical]
        return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))

    def _over(self, logical: str):
        """The mesh axes of `logical` that are manual here and larger than 1: the ranks a collective spans; None
        where there are none (one rank)."""
        mesh, manual = self._context()
        axes = tuple(a for a in self._mesh_axes(logical) if a in manual and mesh.shape[a] > 1)
        return (axes[0] if len(axes) == 1 else axes) if axes else None

    # ---- the collectives (each rank's view)

    def axis_size(self, logical: str) -> int:
        mesh, _ = self._context()
        axes = self._over(logical)
        return 1 if axes is None else math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))

    def axis_index(self, logical: str):
        axes = self._over(logical)
        return 0 if axes is None else jax.lax.axis_index(axes)

    def psum(self, x, logical: str):
        axes = self._over(logical)
        return x if axes is None else jax.lax.psum(x, axes)

    def all_gather(self, x, logical: str, axis: int = 0):
        """The ranks' blocks concatenated along `axis`."""
        axes = self._over(logical)
        return x if axes is None else jax.lax.all_gather(x, axes, axis=axis, tiled=True)

    def reduce_scatter(self, x, logical: str, axis: int = 0):
        """Summed over the ranks; each keeps its block of `axis`."""
        axes = self._over(logical)
        return x if axes is None else jax.lax.psum_scatter(x, axes, scatter_dimension=axis, tiled=True)

    def all_to_all(self, x, logical: str, split_axis: int, concat_axis: int):
        """Block j of `split_axis` goes to rank j; what rank i sent arrives as block i of `concat_axis`."""
        axes = self._over(logical)
        return x if axes is None else jax.lax.all_to_all(x, axes, split_axis, concat_axis, tiled=True)

    def ragged_all_to_all(self, x, out, in_off, send, out_off, recv, logical: str, cap: int):
        """jax.lax.ragged_all_to_all: rows in_off[j] : in_off[j] + send[j] of x to rank j, written there at
        out_off[j] of its `out` (which it returns, its other rows as they were); recv[i]: the rows rank i sends here.
        XLA:CPU has no ragged-all-to-all: there (this run's platform) the same exchange as chunks of at most `cap`
        rows padded into one all_to_all (`_padded_ragged`)."""
        axes = self._over(logical)
        if axes is None:
            return _local_ragged(x, out, in_off[0], send[0], out_off[0])
        if (self.platform or jax.default_backend()) == "cpu":
            return _padded_ragged(x, out, in_off, send, out_off, recv, axes, cap)
        return jax.lax.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis_name=axes)

    def shift(self, x, logical: str):
        """Each rank's block to the next rank (the last's to the first): one step around a ring. A collective-permute;
        on CPU inside a pipeline (a manual `stage` of more than one), whose tick runs each stage's branch on that
        stage's devices only, two all-gathers within pairs of neighbours instead (`_pair_shift`, BRANCHED)."""
        axes = self._over(logical)
        if axes is None:
            return x
        n = self.axis_size(logical)
        mesh, manual = self._context()
        if BRANCHED in manual and mesh.shape[BRANCHED] > 1 and pairwise_ring(self.platform):
            return _pair_shift(x, axes, n)
        return jax.lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)])

    # ---- regions

    def region(self, fn, in_axes, out_axes, over: tuple[str, ...] | None = None):
        """fn(*args) on each rank's blocks, manual over the mesh axes of the logical axes `over` (None: every
        mesh axis). in_axes: each argument's logical axes; out_axes: the result's (a tuple of them for several)."""
        def run(*args):
            mesh, manual = self._context()
            want = mesh.axis_names if over is None else [a for lg in over for a in self._mesh_axes(lg)]
            # fully manual takes the axes of one rank too: XLA refuses a Mosaic kernel where any axis is automatic
            new = {a for a in want if a not in manual and (over is None or mesh.shape[a] > 1)}
            if not new:  # manual already, or one rank: fn runs on what it has
                return fn(*args)
            spec = lambda lg, x=None: keep(self.rules.spec(lg, None if x is None else x.shape, mesh), new)  # noqa
            ins = tuple(jax.tree.map(spec, a, x, is_leaf=_is_axes) for a, x in zip(in_axes, args))
            outs = jax.tree.map(spec, out_axes, is_leaf=_is_axes)
            return jax.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs, axis_names=new, check_vma=False)(*args)
        return run
