"""Microbatches: the one split of a step's batch that gradient accumulation, local SGD and every
pipeline schedule use."""
from __future__ import annotations

import jax


def split_microbatches(batch, m: int):
    """Every field (B, ...) -> (M, B/M, ...) the same way: microbatch j takes rows j, j+M, ..., so
    that each spans every data shard."""
    def split(x):
        b = x.shape[0]
        return x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)
    return jax.tree.map(split, batch)
