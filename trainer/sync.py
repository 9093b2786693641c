"""Explicit gradient collectives over one mesh axis, for code inside shard_map."""
from __future__ import annotations

import jax


class Psum:
    """XLA's own collectives: psum (all-reduce), psum_scatter (reduce-scatter), all_gather."""

    def __init__(self, axis: str, size: int):
        self.axis, self.size = axis, size

    def all_reduce(self, x):
        return jax.lax.psum(x, self.axis)

    def all_reduce_tree(self, tree):
        return jax.lax.psum(tree, self.axis)

    def reduce_scatter(self, x, dim: int):
        return jax.lax.psum_scatter(x, self.axis, scatter_dimension=dim, tiled=True)

    def all_gather(self, x, dim: int):
        return jax.lax.all_gather(x, self.axis, axis=dim, tiled=True)


def make(kind: str, axis: str, size: int):
    if kind in ("auto", "psum"):
        return Psum(axis, size)
    raise NotImplementedError(f"train.grad_sync={kind}")
