"""Which weights the model reads in which dtype: what a ZeRO-3 gather may cast before it moves them."""
from __future__ import annotations

import jax

from models.config import ModelConfig
from models.spec import Param
from models.transformer import inventory

# The weights a ZeRO-3 gather must move as they are stored (declared `as_stored` in the inventory): the final
# norm's scale is read in float32, and the embedding's and head's gradients are summed over several uses (the
# lookup's rows, the tied head) or computed in float32 by the tiled loss, which a cast before them would round to
# the compute dtype. Each layer weight is cast to the compute dtype at its one use, so it may be cast before the
# gather: half the bytes in bfloat16, the same result (trainer/parallel/sync.py).


def compute_dtypes(c: ModelConfig, params: dict, dtype) -> dict:
    """`params`' tree of the dtype a gather may move each weight in: `dtype`, or None (as stored) for the
    inventory's `as_stored` weights."""
    def of(spec, p):
        if isinstance(spec, Param):
            return None if spec.as_stored else jax.tree.map(lambda _: dtype, p)
        return {k: of(spec[k], v) for k, v in p.items()}
    return of(inventory(c), params)
