"""Which weights the model reads in which dtype: what a ZeRO-3 gather may cast before it moves them."""
from __future__ import annotations

import jax

# The weights a ZeRO-3 gather must move as they are stored: the final norm's scale is read in
# float32, and the embedding's and head's gradients are summed over several uses (the lookup's rows,
# the tied head) or computed in float32 by the tiled loss, which a cast before them would round to
# the compute dtype. Each layer weight is cast to the compute dtype at its one use, so it may be cast
# before the gather: half the bytes in bfloat16, the same result (trainer/parallel/sync.py).
FLOAT32_WEIGHTS = frozenset({"final_norm", "embed", "lm_head"})


def compute_dtypes(params: dict, dtype) -> dict:
    """`params`' tree of the dtype a gather may move each weight in: `dtype`, or None (as stored) for
    FLOAT32_WEIGHTS."""
    return {k: (None if k in FLOAT32_WEIGHTS else jax.tree.map(lambda _: dtype, v)) for k, v in params.items()}
