"""Collective bytes in compiled HLO text: per mesh axis, per device, with loop trip counts.

Bytes follow the bus-bytes convention the planner predicts in (what one device sends with
ring algorithms, trainer/parallel/collective_costs.py; S = the full, unsharded array), collective-permute S
per sending device (averaged over all devices); XLA:TPU's all-reduce-scatter fusions (an all-reduce and a
dynamic-slice of it, one collective) as the reduce-scatter they are. A conditional runs one branch per call: without
`branch_weights` each branch counts as if it ran every call (an upper bound); the table executor's
tick switch runs branch i on a share of the (tick, stage) cells its table says (trainer/plan/verify.py).
A while loop's trip count is XLA's `known_trip_count` (XLA:CPU writes it), else read from its
condition when that compares the counter with a constant (XLA:TPU writes no trip counts). A loop
whose condition depends on data is one of the executor's 0-or-1-trip steps: `loop_trips` gives the
mean trips of the one traced from a given Python function (its ops are scoped by the function's
name; older programs: the module's stack frame table names it), the share of cells that run it.
"""
from __future__ import annotations

import collections
import re

import numpy as np

from models.kernels.experts import EXACT_SCOPE

from trainer.parallel.collective_costs import bus_factor

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# XLA:TPU's ragged all-to-all (an MoE's dispatch, models/kernels/experts.py): counted as an all-to-all of its output
# buffer, the bound of the rows it moves (which the routing decides)
RAGGED = "ragged-all-to-all"
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join((RAGGED,) + KINDS) + r")(-done)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        if name is None:
            m = _HEADER.match(line)
            if m and "(" in line:
                name = m.group(2)
                comps[name] = []
                entry = name if m.group(1) else entry
        elif line.startswith("}"):
            name = None
        else:
            comps[name].append(line)
    return comps, entry


def _frame_functions(text: str) -> dict[int, set[str]]:
    """Stack frame id -> the Python functions on its stack (each `a.<locals>.b` split into a, b)."""
    def table(title):
        body = text.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0] if f"\n{title}\n" in text else ""
        return {int(line.split(" ", 1)[0]): line.split(" ", 1)[1] for line in body.splitlines() if line.strip()}
    names = {i: set(v.strip('"').split(".<locals>.")) for i, v in table("FunctionNames").items()}
    locs = {i: int(re.search(r"function_name_id=(\d+)", v).group(1)) for i, v in table("FileLocations").items()}
    frames = {i: tuple(int(x) for x in re.findall(r"=(\d+)", v)[:2]) for i, v in table("StackFrames").items()}
    out = {}
    for i in frames:
        seen, f = set(), i
        while f in frames and f not in seen:  # the text prints a frame's parent as its id + 1 (0: none)
            seen.add(f)
            f = frames[f][1] - 1
        out[i] = set().union(*(names.get(locs.get(frames[f][0]), set()) for f in seen))
    return out


def _counted(comps, cond: str | None) -> int | None:
    """The trips of a loop whose condition is `counter < constant`, signed or unsigned (XLA:TPU's windowed einsum
    loops count in u32), the counter starting at 0 and counting up by one as XLA's loop canonicalisation leaves it;
    else None."""
    lines = comps.get(cond or "", [])
    consts = {d.group(1): int(d.group(2)) for line in lines
              if (d := re.match(r"\s*%([\w.\-]+)\s*=\s*[su](?:32|64)\[\]\S*\s+constant\((-?\d+)\)", line))}
    gtes = {d.group(1) for line in lines if (d := re.match(r"\s*%([\w.\-]+)\s*=.*get-tuple-element\(", line))}
    root = next((line for line in lines if line.lstrip().startswith("ROOT")), "")
    m = re.search(r"compare\(%([\w.\-]+),\s*%([\w.\-]+)\),\s*direction=LT", root)
    if m and m.group(1) in gtes and m.group(2) in consts:
        return max(consts[m.group(2)], 0)
    return None


def _scoped(comps, cond: str | None, loop_trips) -> float | None:
    """loop_trips of the one function whose name scopes the loop's condition, else None."""
    found = set()
    for line in comps.get(cond or "", []):
        if op := re.search(r'op_name="([^"]*)"', line):
            found |= set(op.group(1).split("/")) & set(loop_trips or ())
    return loop_trips[found.pop()] if len(found) == 1 else None


def _has_collectives(comps, name: str) -> bool:
    """Whether a computation, or one it calls, holds a collective."""
    level, seen = [name], set()
    while level:
        nxt = []
        for n in level:
            if n in seen or n not in comps:
                continue
            seen.add(n)
            if any(_OP.search(line) for line in comps[n]):
                return True
            for line in comps[n]:
                nxt += re.findall(r"(?:body|to_apply|calls|condition)=%([\w.\-]+)", line)
                for group in re.findall(r"computations=\{([^}]*)\}", line):
                    nxt += [c.strip().lstrip("%") for c in group.split(",")]
        level = nxt
    return False


def _trips(comps, body: str, loop_trips, functions, cond: str | None = None) -> float:
    """Mean trips of a while loop with no known trip count: counted from its condition, or loop_trips
    of the one function its ops are scoped by, or else of the one its body came from. Read level by
    level (the body's own instructions first, then what it calls): XLA may share one called
    computation between loops from different functions."""
    for n in (_counted(comps, cond), _scoped(comps, cond, loop_trips)):
        if n is not None:
            return n
    level, seen = [body], set()
    while level:
        found, nxt = set(), []
        for name in level:
            if name in seen or name not in comps:
                continue
            seen.add(name)
            for line in comps[name]:
                nxt += re.findall(r"(?:body|to_apply|calls|condition|computations)=\{?%([\w.\-]+)", line)
                if f := re.search(r"stack_frame_id=(\d+)", line):
                    found |= functions.get(int(f.group(1)), set()) & set(loop_trips or ())
        if len(found) == 1:
            return loop_trips[found.pop()]
        if found:
            break
        level = nxt
    if not _has_collectives(comps, body):  # its trips weigh no collective (a kernel's loop of traced bounds)
        return 1
    raise ValueError(f"while loop calling {body} has no known trip count"
                     + (f" (its body comes from {sorted(found)})" if found else ""))


def _multiplicity(comps: dict[str, list[str]], entry: str, branch_weights=None, loop_trips=None,
                  functions=None) -> dict[str, float]:
    """How many times each computation runs per call of the entry (while bodies x trip count), on
    average over the devices; a conditional with len(branch_weights) branches runs branch i a share
    branch_weights[i] of its calls; a while loop of unknown trip count runs loop_trips[f] times, f
    the function its body was traced from."""
    calls = collections.defaultdict(list)  # caller -> [(callee, times)]
    for name, lines in comps.items():
        for line in lines:
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            for key in ("body", "to_apply", "calls", "true_computation", "false_computation"):
                for callee in re.findall(rf"\b{key}=%([\w.\-]+)", line):
                    n = 1
                    if key == "body":
                        cond = re.search(r"\bcondition=%([\w.\-]+)", line)
                        n = int(trip.group(1)) if trip else _trips(comps, callee, loop_trips, functions or {},
                                                                   cond and cond.group(1))
                    calls[name].append((callee, n))
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                names = [c.strip().lstrip("%") for c in group.split(",")]
                share = branch_weights if branch_weights is not None and len(branch_weights) == len(names) \
                    else [1] * len(names)
                calls[name] += list(zip(names, share))
    mult = collections.Counter()

    def visit(name, times):
        mult[name] += times
        for callee, n in calls.get(name, ()):
            visit(callee, times * n)
    visit(entry, 1)
    return mult


def _array_bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _factors(axes: list[tuple[str, int]], listed: str) -> tuple[list[int], list[int]]:
    """The mesh's axes cut into the factors a group names, and which factors the groups span. A group
    names whole axes ('model') or, in newer XLA, sub-axes: 'model':(4)2 is the size-2 factor of `model`
    after a major factor of 4 (model = [4, 2, rest], row-major)."""
    parts: dict[str, list] = {}
    for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", listed):
        parts.setdefault(name, []).append(None if not size else (int(pre), int(size)))
    factors, over = [], []
    for name, n in axes:
        subs = parts.get(name, [])
        if None in subs:  # the whole axis
            over.append(len(factors))
            factors.append(n)
            continue
        done = 1
        for pre, size in sorted(subs):
            if pre > done:
                factors.append(pre // done)
            over.append(len(factors))
            factors.append(size)
            done = pre * size
        factors.append(n // done)
    return factors, over


def _groups(line: str, n_devices: int) -> list[list[int]]:
    """Replica groups of one collective, as lists of logical device ids."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", line)
    if m:  # mesh form: mesh['axis_0'=8,...] [, device_ids=(iota)] {'axis_0'}: groups span the listed axes
        axes = [(a.split("=")[0].strip("' "), int(a.split("=")[1])) for a in m.group(1).split(",")]
        ids = np.arange(int(np.prod([n for _, n in axes])))
        if m.group(2):  # the mesh's devices in order, e.g. [2,4]T(1,0): an iota reshaped and transposed
            d = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2).strip())
            ids = ids.reshape([int(x) for x in d.group(1).split(",")])
            ids = (ids.transpose([int(x) for x in d.group(2).split(",")]) if d.group(2) else ids).reshape(-1)
        factors, over = _factors(axes, m.group(3))
        ids = ids.reshape(factors)
        keep = [i for i in range(len(factors)) if i not in over]
        return ids.transpose(keep + over).reshape(-1, int(np.prod([factors[i] for i in over] or [1]))).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](T\(([\d,]+)\))?", line)
    if m:  # iota form: [G,K]<=[dims]T(perm)
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)?\}", line)
    if m and m.group(1):
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    return [list(range(n_devices))]  # empty replica_groups: all devices


def pair_axes(pairs, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the two ends of some (source, target) device pair differ."""
    coords = [np.unravel_index(list(pair), tuple(mesh_shape.values())) for pair in pairs]
    return tuple(a for i, a in enumerate(mesh_shape) if any(c[i][0] != c[i][1] for c in coords))


def axes_of(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of a group differ."""
    coords = np.array(np.unravel_index(np.asarray(groups[0]), tuple(mesh_shape.values()))).T
    return tuple(a for i, a in enumerate(mesh_shape) if len(set(coords[:, i])) > 1)


def collective_bytes(text: str, mesh_shape: dict[str, int], branch_weights=None,
                     loop_trips=None, apart: bool = False) -> dict[tuple[str, tuple[str, ...]], float]:
    """{(kind, mesh axes): bytes one device sends per call} over every collective in the HLO but an MoE dispatch's
    exact path (its named scope, EXACT_SCOPE: it runs only where a buffer overflows, in a conditional this reader
    would count as if it ran); `apart`: over those alone."""
    out = collections.Counter()
    for kind, axes, sent, line in collective_ops(text, mesh_shape, branch_weights, loop_trips):
        if (EXACT_SCOPE in line) == apart:
            out[(kind, axes)] += sent
    return dict(out)


def collective_ops(text: str, mesh_shape: dict[str, int], branch_weights=None,
                   loop_trips=None) -> list[tuple[str, tuple[str, ...], float, str]]:
    """(kind, mesh axes, bytes one device sends per call, HLO line) of every collective op."""
    comps, entry = _computations(text)
    mult = _multiplicity(comps, entry, branch_weights, loop_trips, _frame_functions(text) if loop_trips else None)
    n = int(np.prod(list(mesh_shape.values())))
    out = []
    for name, lines in comps.items():
        if not mult[name]:
            continue
        defs = {d.group(1): line for line in lines if (d := re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=", line))}
        for line in lines:
            m = _OP.search(line)
            if not m:
                continue
            kind, size = m.group(2).replace(RAGGED, "all-to-all"), _array_bytes(m.group(1))
            if m.group(3):  # async pair: the -done op has the result, its -start the groups
                line = defs[re.search(r"-done\(%([\w.\-]+)", line).group(1)]
            if kind == "collective-permute":
                pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])
                axes = pair_axes([(int(a), int(b)) for a, b in pairs], mesh_shape)
                out.append((kind, axes, mult[name] * size * len(pairs) / n, line))
                continue
            groups = _groups(line, n)
            k = len(groups[0])
            if k == 1:
                continue
            if kind == "all-reduce" and name.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"  # XLA:TPU's all-reduce-scatter fusion: its all-reduce then its rank's slice
                size //= k  # (sequence parallelism's reduce-scatters), one reduce-scatter on the wire
            full = size * k if kind == "reduce-scatter" else size
            out.append((kind, axes_of(groups, mesh_shape), mult[name] * full * bus_factor(kind, k), line))
    return out
