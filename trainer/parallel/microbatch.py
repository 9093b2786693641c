"""Microbatches: the one split of a step's batch that gradient accumulation and every pipeline schedule use."""
from __future__ import annotations


def split_microbatches(batch, m: int):
    """(B, ...) -> (M, B/M, ...); microbatch j takes rows j, j+M, ... so each spans every data shard."""
    b = batch.shape[0]
    return batch.reshape(b // m, m, *batch.shape[1:]).swapaxes(0, 1)
