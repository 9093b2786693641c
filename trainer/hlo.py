"""Collectives in a compiled, SPMD-partitioned HLO module: how often each runs per step, and its bytes."""
from __future__ import annotations

import re

_COMP = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_CALL = re.compile(r"\b(body|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")


def _bytes(dtype: str, dims: str) -> int:
    bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+?(\d+)", dtype).group(1))
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n * bits // 8


def _parse(text: str):
    comps, entry, cur = {}, None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = comps.setdefault(m.group(1), [])
            entry = m.group(1) if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None and " = " in line:
            cur.append(line)
    return comps, entry


def collective_stats(hlo_text: str, op: str = "collective-permute") -> tuple[int, int]:
    """(executions, bytes) of `op` per device per run of the module, while-loop trip counts included.

    Bytes are each op's result buffers (for a collective-permute: what every device sends; for a
    combined all-reduce: all its arrays). Loops without a known trip count raise ValueError.
    """
    comps, entry = _parse(hlo_text)
    pattern = re.compile(rf"\s{re.escape(op)}(?:-start)?\(")
    totals = [0, 0]

    def visit(name: str, mult: int):
        for line in comps.get(name, ()):
            rhs = line.split(" = ", 1)[1]
            hit = pattern.search(rhs)
            if hit:
                result = _SHAPE.findall(rhs[:hit.start()])
                if "-start(" in hit.group(0):  # async: (operand, result, context...); count the operand
                    result = result[:1]
                totals[0] += mult
                totals[1] += mult * sum(_bytes(*shape) for shape in result)
            for kind, callee in _CALL.findall(rhs):
                if kind == "body":
                    trip = _TRIP.search(rhs)
                    if trip is None:
                        raise ValueError(f"while loop calling %{callee} has no known trip count")
                    visit(callee, mult * int(trip.group(1)))
                else:
                    visit(callee, mult)
            for branches in _BRANCHES.findall(rhs):
                for callee in re.findall(r"%([\w.\-]+)", branches):
                    visit(callee, mult)

    visit(entry, 1)
    return totals[0], totals[1]
