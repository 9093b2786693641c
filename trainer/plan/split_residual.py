"""The tensor-parallel collectives under sequence parallelism (train.sequence_parallel): each all-reduce of the
residual stream a reduce-scatter into the (B, T/M, D) layout, each column matmul's input an all-gather out of it, and
the backward's gathers, as XLA compiles models/transformer.py's halves (tests/test_sequence_parallel.py holds the sum
to the HLO's).

Per layer and microbatch, where plain tensor parallelism all-reduces R times (trainer/plan/comm.py
`_model_transfers`: 2 forward, one per projection group backward, one more recomputed under full remat), sequence
parallelism reduce-scatters R times and all-gathers 6 times: the two column inputs forward, the two row outputs'
cotangents backward, the two column inputs once more for the weight gradients (LayerCall.column: the sublayer's
remat keeps the split input, not the gathered one); under full remat 8, the recomputed forward's two more; XLA:TPU
gathers once more at the other remats (7), where XLA:CPU reuses a gathered input. XLA:CPU writes a reduce-scatter as
an all-reduce and a slice: on CPU each one is counted as the all-reduce it sends."""
from __future__ import annotations

from meshes import MODEL
from trainer.parallel.collective_costs import bus_factor
from trainer.plan.types import Transfer


def _scatter(platform: str) -> str:
    """The collective a reduce-scatter is sent as: XLA:CPU's all-reduce (and slice), elsewhere itself."""
    return "all-reduce" if platform == "cpu" else "reduce-scatter"


def split_transfers(what: str, reductions: float, layers: float, act: float, remat: str,
                    platform: str, model: int) -> list[Transfer]:
    """`reductions` all-reduces of `act` bytes (over `layers` layers) written as sequence parallelism does."""
    scatter = _scatter(platform)
    gathers = layers * (8 if remat == "full" else 6 if platform == "cpu" else 7)
    return [Transfer(MODEL, scatter, f"{what}: reduce-scatters into the sequence-split residual",
                     bus_factor(scatter, model) * reductions * act, reductions),
            Transfer(MODEL, "all-gather", f"{what}: all-gathers of the column matmuls' inputs and cotangents",
                     bus_factor("all-gather", model) * gathers * act, gathers)]


def split_ends(m: float, n: int, d: int, a: int, model: int, platform: str, recomputed: float = 0) -> list[Transfer]:
    """The embedding, head and loss of m microbatches of n tokens under sequence parallelism: the vocab-split
    lookup all-reduced whole along the sequence (then cut to the split residual) and its cotangent gathered; the
    head's input gathered forward and backward, its float32 input gradient reduce-scattered; the loss's per-token
    sums all-reduced; `recomputed` more embedding all-reduces (a pipeline's first stage recomputes its lookup for the
    backward: m of them over the stages)."""
    scatter = _scatter(platform)
    ar, act, gathers = bus_factor("all-reduce", model), n * d * a, 2 if platform == "cpu" else 3
    return [Transfer(MODEL, "all-reduce", "vocab-parallel embedding and loss",
                     m * ar * (act + 3 * n * 4) + recomputed * ar * act, 4 * m + recomputed),
            Transfer(MODEL, "all-gather", "the embedding's cotangent and the head's input (forward; XLA:CPU reuses it "
                     "backward)", m * bus_factor("all-gather", model) * gathers * act, gathers * m),
            Transfer(MODEL, scatter, "the head's input gradient (float32)", m * bus_factor(scatter, model) * n * d * 4,
                     m)]
