"""Static pipeline schedule tables: which stage runs the forward or backward of which microbatch
(and repeat) at each tick, built in plain Python.

A table is a list of ticks; tick t is a list of S entries, each an `Op` (kind 'F' or 'B',
microbatch m, repeat v) or None (idle). Every op takes one tick; an activation or cotangent sent
at tick t is usable at tick t+1. Each stage runs its ops in a fixed order (`stage_order`) and
waits, idle, while the next one's input has not arrived (`build` simulates that), so the table
satisfies the data dependencies by construction and the tests check them independently.

  gpipe             all forwards, then all backwards (stage inputs of all M microbatches live).
  1f1b              Megatron / PipeDream-flush: S-s-1 warm-up forwards on stage s, then one
                    forward and one backward in turn, then the cool-down backwards; at most S
                    stage inputs are live on a stage.
  interleaved_1f1b  Megatron's interleaved order over V repeats (stage s runs blocks s, s+S, ...):
                    forwards walk S microbatches through one repeat, then the next repeat.
  forward           GPipe's forwards alone: the evaluation, whatever the training's schedule.

`plan` turns a table into the per-(tick, stage) integer arrays the executor scans over
(trainer/parallel/pipeline.py), with a buffer slot for every stored stage input and cotangent.

`python -m trainer.parallel.schedules S M [SCHEDULE [V]]` prints a table.
"""
from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np


# GPipe's forwards alone (no backward): the evaluation's table (trainer/parallel/pipeline.py eval_sums)
FORWARD = "forward"


class Op(NamedTuple):
    kind: str  # 'F' or 'B'
    m: int  # microbatch
    v: int = 0  # repeat (virtual stage s + v*S)


def stage_order(schedule: str, S: int, M: int, V: int, s: int) -> list:
    """The ops stage s runs, in order."""
    if schedule in ("gpipe", FORWARD):
        fwd = [Op("F", m, v) for v in range(V) for m in range(M)]
        return fwd + ([Op("B", m, v) for v in reversed(range(V)) for m in range(M)] if schedule == "gpipe" else [])
    if schedule == "1f1b":
        assert V == 1, "1f1b runs one repeat; use interleaved_1f1b for V > 1"
        fwd = [Op("F", m) for m in range(M)]
        bwd = [Op("B", m) for m in range(M)]
        warm = min(S - s - 1, M)
    elif schedule == "interleaved_1f1b":
        assert M % S == 0, "interleaved_1f1b needs microbatches divisible by stages"
        # Megatron: the k-th forward runs repeat (k // S) % V of microbatch (k // (S*V))*S + k % S;
        # backwards the same with the repeats reversed
        fwd = [Op("F", (k // (S * V)) * S + k % S, (k // S) % V) for k in range(M * V)]
        bwd = [Op("B", (k // (S * V)) * S + k % S, V - 1 - (k // S) % V) for k in range(M * V)]
        warm = min((S - s - 1) * 2 + (V - 1) * S, M * V)
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    out = fwd[:warm]
    for i in range(len(fwd) - warm):
        out += [fwd[warm + i], bwd[i]]
    return out + bwd[len(fwd) - warm:]


def _prev(op: Op, s: int, S: int, V: int):
    """(stage, op) whose result this op needs, or None."""
    if op.kind == "F":
        if s > 0:
            return s - 1, op
        return (S - 1, Op("F", op.m, op.v - 1)) if op.v > 0 else None
    if s < S - 1:
        return s + 1, op
    return (S - 1, Op("F", op.m, op.v)) if op.v == V - 1 else (0, Op("B", op.m, op.v + 1))


def build(schedule: str, S: int, M: int, V: int = 1) -> list:
    """The table: each stage runs its next op as soon as its input arrived (a tick after it was sent)."""
    orders = [stage_order(schedule, S, M, V, s) for s in range(S)]
    done, pos, table = {}, [0] * S, []
    while any(pos[s] < len(orders[s]) for s in range(S)):
        t, row = len(table), [None] * S
        for s in range(S):
            if pos[s] < len(orders[s]):
                op = orders[s][pos[s]]
                dep = _prev(op, s, S, V)
                if dep is None or done.get(dep, t) < t:
                    row[s] = op
        for s, op in enumerate(row):
            if op is not None:
                done[s, op] = t
                pos[s] += 1
        if all(op is None for op in row):
            raise RuntimeError(f"{schedule} deadlocks at tick {t}")
        table.append(row)
    return table


def idle_fraction(table: list) -> float:
    """Share of stage-ticks with nothing to run."""
    cells = [op for row in table for op in row]
    return sum(op is None for op in cells) / len(cells)


def _cell(op, two: bool) -> str:
    if op is None:
        return "."
    if two:  # two repeats: the second in lower case
        return f"{op.kind.lower() if op.v else op.kind}{op.m}"
    return f"{op.kind}{op.m}" + (f".{op.v}" if op.v else "")


def render(table: list) -> str:
    """One row per stage: F<m> / B<m> or '.' per tick; repeats v > 0 as f<m> / b<m> where there are
    two, else F<m>.<v> / B<m>.<v>."""
    S = len(table[0])
    two = max(op.v for row in table for op in row if op is not None) == 1
    cell = [[_cell(op, two) for op in row] for row in table]
    w = max(len(c) for row in cell for c in row)
    return "\n".join(f"stage {s}: " + " ".join(row[s].ljust(w) for row in cell).rstrip() for s in range(S))


def _slots(intervals: list) -> tuple:
    """Greedy colouring of (write tick, read tick, key) intervals: {key: slot}, slot count.
    A slot written at the end of tick w and read during tick r is free for writes from tick r."""
    free_at, slot = [], {}
    for w, r, key in sorted(intervals):
        k = next((i for i, f in enumerate(free_at) if f <= w), len(free_at))
        if k == len(free_at):
            free_at.append(0)
        free_at[k], slot[key] = r, k
    return slot, len(free_at)


# executor branches
IDLE, FWD, FWD_EMBED, FWD_LOSS, BWD, BWD_EMBED = range(6)


class Plan(NamedTuple):
    branch: np.ndarray  # (T, S) one of the branches above
    m: np.ndarray  # (T, S) microbatch
    v: np.ndarray  # (T, S) repeat
    slot: np.ndarray  # (T, S) input slot read (F, B) and cotangent slot read (B)
    cot_slot: np.ndarray  # (T, S) cotangent slot read by B
    loss_slot: np.ndarray  # (T, S) cotangent slot the loss's gradient goes to (FWD_LOSS), else dummy
    recv_act: np.ndarray  # (T, S) slot the activation received at the end of the tick goes to, else dummy
    recv_cot: np.ndarray  # (T, S) slot the cotangent received at the end of the tick goes to, else dummy
    n_act: int  # activation slots (the dummy is slot n_act: the executor drops what is written there)
    n_cot: int


def plan(table: list, V: int = 1) -> Plan:
    """Per-(tick, stage) arrays for the executor; buffer slots by interval colouring per stage."""
    T, S = len(table), len(table[0])
    at = {(s, op): t for t, row in enumerate(table) for s, op in enumerate(row) if op is not None}
    acts, cots = [[] for _ in range(S)], [[] for _ in range(S)]
    for (s, op), t in at.items():
        if op.kind == "B":
            cots[s].append((at[_prev(op, s, S, V)], t, (op.m, op.v)))
        elif (dep := _prev(op, s, S, V)) is not None:  # stage input received from the previous stage; read by F
            # and by B (where the table has one)
            acts[s].append((at[dep], at.get((s, Op("B", op.m, op.v)), t), (op.m, op.v)))
    act_slot, cot_slot, n_act, n_cot = [], [], 0, 0
    for s in range(S):
        a, na = _slots(acts[s])
        c, nc = _slots(cots[s])
        act_slot.append(a), cot_slot.append(c)
        n_act, n_cot = max(n_act, na), max(n_cot, nc)
    arr = {k: np.zeros((T, S), np.int32) for k in ("branch", "m", "v", "slot", "cot_slot")}
    arr.update({k: np.full((T, S), d, np.int32) for k, d in
                (("loss_slot", n_cot), ("recv_act", n_act), ("recv_cot", n_cot))})
    for (s, op), t in at.items():
        key = (op.m, op.v)
        first, last = s == 0 and op.v == 0, s == S - 1 and op.v == V - 1
        arr["m"][t, s], arr["v"][t, s] = op.m, op.v
        arr["slot"][t, s] = act_slot[s].get(key, 0)
        if op.kind == "F":
            arr["branch"][t, s] = FWD_EMBED if first else FWD_LOSS if last else FWD
            if last:
                arr["loss_slot"][t, s] = cot_slot[s].get(key, n_cot)  # forward alone: no cotangent
            elif s < S - 1 or V > 1:  # the next stage receives it at the end of this tick
                nxt = (s + 1) % S
                arr["recv_act"][t, nxt] = act_slot[nxt][(op.m, op.v + (s == S - 1))]
        else:
            arr["branch"][t, s] = BWD_EMBED if first else BWD
            arr["cot_slot"][t, s] = cot_slot[s][key]
            if not first:
                prv = (s - 1) % S
                arr["recv_cot"][t, prv] = cot_slot[prv][(op.m, op.v - (s == 0))]
    return Plan(**arr, n_act=n_act, n_cot=n_cot)


def describe(stages: int, microbatches: int, repeats: int, schedule: str = "gpipe") -> str:
    """The start-up line: ticks and idle share read off the schedule's table."""
    table = build(schedule, stages, microbatches, repeats)
    return (f"pipeline {schedule} x{repeats}: {stages} stages, {microbatches} microbatches, "
            f"{len(table)} ticks, bubble {100 * idle_fraction(table):.1f}%")


def main(argv: list) -> None:
    S, M = int(argv[0]), int(argv[1])
    schedule = argv[2] if len(argv) > 2 else "1f1b"
    V = int(argv[3]) if len(argv) > 3 else (2 if schedule == "interleaved_1f1b" else 1)
    table = build(schedule, S, M, V)
    sys.stdout.write(f"{schedule}: {S} stages, {M} microbatches, {V} repeat{'s' * (V > 1)}, {len(table)} ticks, "
                     f"idle {100 * idle_fraction(table):.1f}%\n{render(table)}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
