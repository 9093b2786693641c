"""What a pipeline schedule costs, read off its table (trainer/parallel/schedules.py): the stage inputs and
cotangents a stage holds at once, and the idle share.

The planner's pipeline memory is about the schedule, not one executor: a stage keeps each
microbatch's stage input from its arrival until its backward (GPipe: all M*V; 1F1B: at most S;
interleaved: what its table says), each cotangent from its arrival until the backward reads it (on
the last stage the loss's gradient from the forward on: GPipe holds M*V of them), and the working
set of one tick (trainer/plan/memory.py). Every schedule runs on the table executor
(trainer/parallel/pipeline.py), so its table is the whole story.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from trainer.parallel import schedules

class Cost(NamedTuple):
    """One schedule's peak live stage inputs and cotangents on any stage, ticks and idle share."""
    inputs: int
    cotangents: int
    ticks: int
    bubble: float


def _peak(intervals: list) -> int:
    """Most (written at the end of tick w, read during tick r) intervals live at once."""
    ends = sorted([(w + 1, 1) for w, r in intervals] + [(r + 1, -1) for w, r in intervals])
    live = peak = 0
    for _, d in ends:  # at a shared tick a read frees its slot before a write fills it
        live += d
        peak = max(peak, live)
    return peak


@functools.lru_cache(maxsize=1024)
def cost(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> Cost:
    """Peak live inputs and cotangents of a stage, counted tick by tick on the table."""
    S, V = stages, repeats
    table = schedules.build(schedule, S, microbatches, V)
    at = {(s, op): t for t, row in enumerate(table) for s, op in enumerate(row) if op is not None}
    inputs, cots = [[] for _ in range(S)], [[] for _ in range(S)]
    for (s, op), t in at.items():
        if op.kind != "B":
            continue
        fwd = schedules.Op("F", op.m, op.v)
        if s > 0 or op.v > 0:  # stage 0's first repeat embeds its tokens instead of storing an input
            src = (s - 1, fwd) if s > 0 else (S - 1, schedules.Op("F", op.m, op.v - 1))
            inputs[s].append((at[src], t))
        if s == S - 1 and op.v == V - 1:  # the loss's gradient, from the forward that computed it
            cots[s].append((at[s, fwd], t))
        else:
            src = (s + 1, op) if s < S - 1 else (0, schedules.Op("B", op.m, op.v + 1))
            cots[s].append((at[src], t))
    return Cost(max(map(_peak, inputs)), max(map(_peak, cots)), len(table), schedules.idle_fraction(table))
