"""Explicit gradient collectives over one mesh axis, for code inside a shard_map manual over it.

psum       XLA's own all-reduce, reduce-scatter and all-gather.
ring       one bucket per call, not one message per leaf. The all-reduce (ZeRO 0/1) flattens and
           concatenates every leaf into a (K, n/K) buffer. The reduce-scatter (ZeRO-2) and the
           all-gather (ZeRO-3) cut each leaf's ZeRO dimension (`dims`) into K blocks that move to a
           leading axis before concatenating, so that chunk i is device i's ZeRO shard of every
           leaf. K-1 ppermute steps to the next device reduce-scatter the buffer, leaving device i
           with chunk i summed; K-1 more all-gather it. Bytes each device sends: all-reduce
           2(K-1)/K x the gradient, reduce-scatter or all-gather (K-1)/K x.
ring_bf16  the ring with bfloat16 on the wire and float32 sums: half the bytes. Every summed element
           is rounded to bfloat16 at most K times, so |error| <= K * 2^-8 * sum_i |g_i| (2^-8: the
           unit roundoff of bfloat16's 8-bit significand). ZeRO-3 weights are still gathered exactly.
In the reduce-scatter and all-gather, leaves without a ZeRO dimension, or whose ZeRO dimension is
also split over another mesh axis, go through psum, and so does every leaf its rules split over one of the reducer's
axes (an MoE's experts over `expert`: summed over the others, `Psum.over`). The ring runs in a nested shard_map manual
over the remaining mesh axes, so with tensor parallelism each device rings only its own slice.
A reducer reduces every leaf it is given; which leaves need which reduction (none for a leaf the rules split
over the axis) is trainer/parallel/reduction.py's decision.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from meshes.rules import keep, mesh_axes

from trainer.errors import UserError
from trainer.config.sections import GRAD_SYNC


class Psum:
    """XLA's own collectives: psum (all-reduce), psum_scatter (reduce-scatter), all_gather."""

    def __init__(self, axis: str, size: int):
        self.axis, self.size = axis, size

    def over(self, spec):
        """The axes a leaf of compute spec `spec` is summed (gathered) over: the reducer's, but those the spec
        splits it over (an MoE's experts split over `expert`: each expert rank's slice is its own; summed over
        `data` alone)."""
        names = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        left = tuple(a for a in names if a not in mesh_axes(spec))
        return self.axis if len(left) == len(names) else left[0] if len(left) == 1 else left

    def all_reduce(self, x, spec=None):
        """x summed over the axes a leaf of compute spec `spec` is summed over (`over`; None: every one)."""
        return jax.lax.psum(x, self.axis if spec is None else self.over(spec))

    def all_reduce_tree(self, tree, dims, specs):
        return jax.tree.map(lambda x, sp: jax.lax.psum(x, self.over(sp)), tree, specs)

    def reduce_scatter_tree(self, tree, dims, specs):
        """Each leaf summed and split along its dim (all-reduced where the dim is None)."""
        def leaf(x, d, sp):
            if d is None:
                return jax.lax.psum(x, self.over(sp))
            return jax.lax.psum_scatter(x, self.over(sp), scatter_dimension=d, tiled=True)
        return jax.tree.map(leaf, tree, dims, specs)

    def all_gather_tree(self, tree, dims, specs, dtypes=None):
        """Each leaf gathered along its dim (kept where it is None); see `_gather_in`."""
        _, treedef = jax.tree.flatten(tree)
        over = [self.over(sp) for sp, d in zip(treedef.flatten_up_to(specs), treedef.flatten_up_to(dims))
                if d is not None]

        def gather(xs, ds):
            return [x if d is None else jax.lax.all_gather(x, a, axis=d, tiled=True) for x, d, a in zip(xs, ds, over)]

        def scatter(cts, ds):
            return [c if d is None else jax.lax.psum_scatter(c, a, scatter_dimension=d, tiled=True)
                    for c, d, a in zip(cts, ds, over)]
        return _gather_in(tree, dims, dtypes, gather, scatter)


def _narrow(x, dtype):
    """x cast to dtype; float32 to bfloat16 written as its rounding (reduce_precision, the same round-to-nearest-even)
    and the upper half of each word, which XLA:TPU's bfloat16 propagation does not see as a cast: it would move a
    cast of a layer's slice to the whole stack, ahead of the scan, and keep a bfloat16 copy of every layer's weights
    live through the forward and backward (0.70 GB per chip for Mixtral-8x7B's experts on v5p:4x4x8, docs/plan.md)."""
    dtype = jnp.dtype(dtype)
    if x.dtype == jnp.float32 and dtype == jnp.bfloat16:
        r = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
        bits = (jax.lax.bitcast_convert_type(r, jnp.uint32) >> 16).astype(jnp.uint16)
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    return x.astype(dtype)


def _gather_in(tree, dims, dtypes, gather, scatter):
    """gather(leaves, dims) of tree's leaves, each first cast to its entry of `dtypes` (a tree like
    `tree`; None: as it is). The gradient is scatter(cotangents, dims) in the leaves' own dtypes: a
    float32 weight the model reads in bfloat16 is gathered in bfloat16 (half the bytes), and its
    gradient reduce-scattered in float32, as without the cast (cast-then-gather = gather-then-cast)."""
    xs, treedef = jax.tree.flatten(tree)
    ds = treedef.flatten_up_to(dims)
    dts = [None] * len(xs) if dtypes is None else treedef.flatten_up_to(dtypes)
    idx = [j for j, d in enumerate(ds) if d is not None]  # leaves without a dim are whole already
    sub = lambda seq: [seq[j] for j in idx]  # noqa: E731
    own = [xs[j].dtype for j in idx]
    cast = [dts[j] if dts[j] is not None else xs[j].dtype for j in idx]

    @jax.custom_vjp
    def run(leaves):
        return gather([_narrow(x, dt) for x, dt in zip(leaves, cast)], sub(ds))

    def bwd(_, cts):
        # each shard behind a barrier: XLA:TPU writes the reduce-scatter as an all-reduce and a slice, and would
        # otherwise slice (and take the norm of) the whole all-reduced gradient where the step uses it, keeping a
        # whole float32 head gradient live through the layers' backward (docs/plan.md)
        return ([jax.lax.optimization_barrier(g) for g in scatter([c.astype(dt) for c, dt in zip(cts, own)],
                                                                    sub(ds))],)

    run.defvjp(lambda leaves: (run(leaves), None), bwd)
    out = list(xs)
    for j, y in zip(idx, run(sub(xs))):
        out[j] = y
    return jax.tree.unflatten(treedef, out)


def _inner_axes():
    """Mesh axes of size > 1 that the enclosing shard_map leaves to the compiler."""
    m = jax.sharding.get_abstract_mesh()
    return m, {a for a, t in zip(m.axis_names, m.axis_types) if t != AxisType.Manual and m.shape[a] > 1}


def _to_blocks(x, d: int, k: int):
    """(..., S, ...) -> (K, n/K): row j holds block j of dim d, flattened."""
    x = x.reshape(x.shape[:d] + (k, x.shape[d] // k) + x.shape[d + 1:])
    return jnp.moveaxis(x, d, 0).reshape(k, -1)


def _from_blocks(b, shape, d: int, k: int):
    moved = (k,) + shape[:d] + (shape[d] // k,) + shape[d + 1:]
    return jnp.moveaxis(b.reshape(moved), 0, d).reshape(shape)


def _offsets(sizes):
    return np.cumsum(sizes)[:-1].tolist()


def _flatten(leaves, dtype):
    return jnp.concatenate([x.reshape(-1).astype(dtype) for x in leaves])


def _unflatten(flat, shapes, like):
    parts = jnp.split(flat, _offsets([math.prod(s) for s in shapes]))
    return [p.reshape(s).astype(x.dtype) for p, s, x in zip(parts, shapes, like)]


class Ring(Psum):
    """Bucketed ring reduce-scatter / all-gather built from ppermute; `wire` is the dtype sent."""

    def __init__(self, axis: str, size: int, wire=None):
        super().__init__(axis, size)
        self.wire = wire

    # ---- the ring on one bucket (inside a context manual over every axis with local data)

    def _send(self, x, wire):
        """x to the next device on the ring, as `wire` (the receiver gets `wire` values back)."""
        perm = [(j, (j + 1) % self.size) for j in range(self.size)]
        if wire is None:
            return jax.lax.ppermute(x, self.axis, perm)
        # XLA:CPU widens a bfloat16 collective-permute to float32; as unsigned ints the bits stay narrow
        bits = jnp.dtype(f"uint{jnp.dtype(wire).itemsize * 8}")
        sent = jax.lax.ppermute(jax.lax.bitcast_convert_type(x.astype(wire), bits), self.axis, perm)
        return jax.lax.bitcast_convert_type(sent, wire)

    def ring_reduce_scatter(self, x_KN, wire=None):
        """(K, N) -> (N,): chunk i summed over the axis, on device i. K-1 sends of N elements."""
        k, i = self.size, jax.lax.axis_index(self.axis)
        chunk = lambda j: jax.lax.dynamic_index_in_dim(x_KN, j % k, 0, keepdims=False)
        acc = chunk(i - 1)
        for t in range(k - 1):  # device i sends chunk i-t-1 on, receives chunk i-t-2 and adds its own
            acc = self._send(acc, wire).astype(x_KN.dtype) + chunk(i - t - 2)
        return acc

    def ring_all_gather(self, x_N, wire=None):
        """(N,) -> (K, N): row j is device j's input. K-1 sends of N elements."""
        k, i = self.size, jax.lax.axis_index(self.axis)
        rows = [x_N if wire is None else x_N.astype(wire)]  # the owner keeps what it sends: replicas agree
        for _ in range(k - 1):
            rows.append(self._send(rows[-1], wire))
        # rows[t] came from device i-t: one gather puts them in device order
        return jnp.stack(rows)[(i - jnp.arange(k)) % k].astype(x_N.dtype)

    # ---- bucketing

    def _bucket(self, tree, dims, specs, mode: str, wire):
        """mode 'reduce': full -> full leaves; 'scatter': full -> shards; 'gather': shards -> full."""
        mesh, axes = _inner_axes()
        xs, treedef = jax.tree.flatten(tree)
        ds, raw = treedef.flatten_up_to(dims), treedef.flatten_up_to(specs)
        ss = [keep(sp, axes) for sp in raw]
        own = [self.over(sp) == self.axis for sp in raw]  # False: split over some of the axes: psum over the rest
        ring = [j for j, (d, sp) in enumerate(zip(ds, ss))
                if own[j] and (mode == "reduce" or (d is not None and (d >= len(sp) or sp[d] is None)))]
        out = [x if j in ring else self._psum_leaf(x, ds[j], mode, self.over(raw[j])) for j, x in enumerate(xs)]
        if ring:
            fn = functools.partial(self._ring_leaves, ds=[ds[j] for j in ring], mode=mode, wire=wire)
            leaves, sp = [xs[j] for j in ring], [ss[j] for j in ring]
            if axes:  # each device rings only its own slice of every leaf
                fn = jax.shard_map(fn, mesh=mesh, in_specs=(sp,), out_specs=sp, axis_names=axes, check_vma=False)
            for j, y in zip(ring, fn(leaves)):
                out[j] = y
        return jax.tree.unflatten(treedef, out)

    def _ring_leaves(self, leaves, ds, mode, wire):
        """The ring on one bucket of local leaves."""
        k, dt = self.size, jnp.result_type(*leaves)
        if mode == "reduce":  # any layout will do: flat, no transposes
            flat = _flatten(leaves, dt)
            b = jnp.pad(flat, (0, -flat.size % k)).reshape(k, -1)
            b = self.ring_all_gather(self.ring_reduce_scatter(b, wire), wire)
            return _unflatten(b.reshape(-1)[:flat.size], [x.shape for x in leaves], leaves)
        if mode == "scatter":
            b = jnp.concatenate([_to_blocks(x.astype(dt), d, k) for x, d in zip(leaves, ds)], axis=1)
            shards = [x.shape[:d] + (x.shape[d] // k,) + x.shape[d + 1:] for x, d in zip(leaves, ds)]
            return _unflatten(self.ring_reduce_scatter(b, wire), shards, leaves)
        b = self.ring_all_gather(_flatten(leaves, dt), wire)  # gather: the leaves are this device's shards
        parts = jnp.split(b, _offsets([x.size for x in leaves]), axis=1)
        return [_from_blocks(p, x.shape[:d] + (x.shape[d] * k,) + x.shape[d + 1:], d, k).astype(x.dtype)
                for p, x, d in zip(parts, leaves, ds)]

    def _psum_leaf(self, x, d, mode, axis):
        if mode == "gather":
            return x if d is None else jax.lax.all_gather(x, axis, axis=d, tiled=True)
        if mode == "scatter" and d is not None:
            return jax.lax.psum_scatter(x, axis, scatter_dimension=d, tiled=True)
        return jax.lax.psum(x, axis)

    # ---- the reducer interface

    def all_reduce_tree(self, tree, dims, specs):
        return self._bucket(tree, dims, specs, "reduce", self.wire)

    def reduce_scatter_tree(self, tree, dims, specs):
        return self._bucket(tree, dims, specs, "scatter", self.wire)

    def all_gather_tree(self, tree, dims, specs, dtypes=None):
        """Exact ring all-gather of weights; its gradient is the ring reduce-scatter (ZeRO-3). See `_gather_in`."""
        _, treedef = jax.tree.flatten(tree)
        ds, ss = treedef.flatten_up_to(dims), treedef.flatten_up_to(specs)
        ss = [sp for sp, d in zip(ss, ds) if d is not None]
        return _gather_in(tree, dims, dtypes, lambda xs, sd: self._bucket(xs, sd, ss, "gather", None),
                          lambda cts, sd: self._bucket(cts, sd, ss, "scatter", self.wire))


def make(kind: str, axis: str, size: int):
    """The reducer for train.grad_sync=kind over mesh axis `axis` of `size` devices."""
    if kind in ("auto", "psum"):
        return Psum(axis, size)
    if kind == "ring":
        return Ring(axis, size)
    if kind == "ring_bf16":
        return Ring(axis, size, wire=jnp.bfloat16)
    raise UserError(f"train.grad_sync='{kind}' is unknown; choose one of {', '.join(GRAD_SYNC)}")

