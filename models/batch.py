"""A batch: named fields, each (B, T), that every path carries together as one pytree.

  tokens       int32   the input token ids
  targets      int32   the next token of each input (shifted once, where the batch is made)
  loss_weight  float32 how much each target counts in the loss (1: counted, 0: not)
  segment_ids  int32   the document of each token in its row (0: padding)
  positions    int32   each token's offset inside its document

The loss of a step is one mean over its counted tokens: the sum of loss_weight x token loss over
the whole step batch (every microbatch, data rank and pipeline microbatch) divided by the sum of
loss_weight over the same batch. A step with no counted token has loss 0 and zero gradients.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FIELDS = ("tokens", "targets", "loss_weight", "segment_ids", "positions")
DTYPES = {"tokens": np.int32, "targets": np.int32, "loss_weight": np.float32, "segment_ids": np.int32,
          "positions": np.int32}
# train.objective=dpo adds ref_logp: the frozen reference's log-probability of each target (models/objectives/dpo.py)
DPO_FIELDS = FIELDS + ("ref_logp",)
ALL_DTYPES = {**DTYPES, "ref_logp": np.float32,
              **dict.fromkeys(("metric_weight", "old_logp", "advantage", "completion"), np.float32)}  # GRPO's


def from_windows(windows_BT1, loss_weight_BT=None, segment_ids_BT=None, positions_BT=None) -> dict:
    """The fields of B windows of T+1 consecutive tokens (numpy); unless given: every target counted,
    one document per row, positions 0..T-1."""
    w = np.asarray(windows_BT1, dtype=np.int32)
    B, T = w.shape[0], w.shape[1] - 1
    weight = np.ones((B, T), np.float32) if loss_weight_BT is None else np.asarray(loss_weight_BT, np.float32)
    seg = np.ones((B, T), np.int32) if segment_ids_BT is None else np.asarray(segment_ids_BT, np.int32)
    pos = (np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy() if positions_BT is None
           else np.asarray(positions_BT, np.int32))
    return {"tokens": w[:, :-1], "targets": w[:, 1:], "loss_weight": weight, "segment_ids": seg, "positions": pos}


def abstract(batch_size: int, seq_len: int, sharding=None, fields: tuple = FIELDS) -> dict:
    """ShapeDtypeStructs of a (batch_size, seq_len) batch, each with `sharding`."""
    return {f: jax.ShapeDtypeStruct((batch_size, seq_len), ALL_DTYPES[f], sharding=sharding) for f in fields}


def counted(batch) -> jax.Array:
    """The sum of loss_weight: the tokens a loss over this batch counts (float32)."""
    return jnp.sum(batch["loss_weight"].astype(jnp.float32))


def inverse_count(batch) -> jax.Array:
    """1 / the batch's counted tokens (1 where there are none: every sum is 0 then): the one division
    of a loss over the batch, applied where its backward starts."""
    return mean_of(1.0, counted(batch))


def mean_of(total, count):
    """total / count, and 0 where nothing was counted (total is then 0 too)."""
    return total / jnp.where(count > 0, count, 1.0)
