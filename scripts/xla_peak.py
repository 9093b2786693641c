"""What XLA:CPU holds at the peak of a config's train step: the buffers live when its temp allocation is fullest.

    python scripts/xla_peak.py [--devices N] [--top K] key=value ...

Compiles the step as `meshtrain plan --verify` does (on the first N simulated CPU devices, the state donated), with
XLA's dump on, then reads the dump: the temp allocation's buffers (offset, size) from the buffer assignment, each
buffer's live range over the flattened schedule from the live-range file, and the instruction that made it. It prints
the time of the peak (the union of the live buffers' bytes, so that buffers sharing a slot count once), the
instruction there, and the live buffers of at least 1 MB, largest first, each with the operation that made it (the
tail of its op_name) or, for a copy of an argument, the argument it copies (e.g. `state['opt_state'][1][0].mu[...]`).
It ends with their bytes by where they were made: the forward (`jvp` in the op_name), the backward (`transpose`),
copies of arguments, other. `--phase backward` finds the peak among the backward's instructions instead.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=None, help="compile for the first N devices (default: the mesh's)")
    ap.add_argument("--top", type=int, default=60, help="list at most this many buffers")
    ap.add_argument("--keep", action="store_true", help="keep XLA's dump (its path is printed)")
    ap.add_argument("--phase", choices=("forward", "backward"), help="the peak inside that phase's instructions "
                    "(its op_name's jvp or transpose) rather than the whole step's")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = tempfile.mkdtemp(prefix="xla-peak-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                               f" --xla_dump_to={out} --xla_dump_hlo_module_re=.*guarded_step.*").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jax
    from trainer.config import load_config
    from trainer.plan.verify import measure
    m = measure(load_config(a.overrides), jax.devices()[:a.devices] if a.devices else None, grads=False)
    try:
        report(out, m.temp_bytes, a.top, a.phase)
    finally:
        if a.keep:
            print(f"XLA's dump: {out}")
        else:
            shutil.rmtree(out, ignore_errors=True)


def report(dump: str, temp_bytes: int, top: int, phase: str | None = None) -> None:
    base = sorted(glob.glob(f"{dump}/*guarded_step*-buffer-assignment.txt"))[-1][:-len("-buffer-assignment.txt")]
    ba = open(base + "-buffer-assignment.txt").read()
    temp = re.search(r"allocation \d+: size (\d+), preallocated-temp:\n((?: value:.*\n)+)", ba)
    values = [(m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)[:34]) for m in re.finditer(
        r" value: <\d+ (\S+)(?: \(phi\))? @0> \(size=(\d+),offset=(\d+)\): (.*)", temp.group(2))]
    text = open(base + "-live-range.txt").read()
    ranges = {m.group(1): (int(m.group(2)), int(m.group(3)))
              for m in re.finditer(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$", text, re.M)}
    order = dict((int(i), n) for i, n in re.findall(r"^\s+(\d+):(\S+)$", text, re.M))
    hlo = open(base + ".txt").read()
    made = {k: v.replace("\\'", "'") for k, v in re.findall(r"%(\S+) = .*?op_name=\"([^\"]*)\"", hlo)}
    copied = dict(re.findall(r"%(copy[.\d]*) = \S+ copy\(%(param[.\d]*)\)", hlo))
    span = max(e for _, e in ranges.values()) + 1
    live = [[] for _ in range(span)]
    for name, size, offset, _ in values:
        s, e = ranges.get(name if "{" in name else name + "{}", (None, None))
        for t in range(s, e + 1) if s is not None else ():
            live[t].append((offset, offset + size))
    times = [t for t in range(span) if phase is None or _phase(made.get(order.get(t), "")) == phase]
    at = max(times, key=lambda t: union(live[t]))
    print(f"temp allocation {temp_bytes / 1e6:.1f} MB; peak {union(live[at]) / 1e6:.1f} MB live at {at} "
          f"({order.get(at)})")
    rows = []
    for name, size, offset, shape in values:
        s, e = ranges.get(name if "{" in name else name + "{}", (None, None))
        if s is not None and s <= at <= e and size >= 1e6:
            what = made.get(name.split("{")[0], "")
            if name in copied:
                what = "copy of " + made.get(copied[name], copied[name])
            rows.append((size, name, shape, what))
    for size, name, shape, what in sorted(rows, reverse=True)[:top]:
        print(f"{size / 1e6:8.2f} MB  {shape:34s} {name:34s} {what[-90:]}")
    made_in = {}
    for size, _, _, what in rows:
        kind = "argument copies" if what.startswith("copy of") else _phase(what)
        made_in[kind] = made_in.get(kind, 0) + size
    print("made in: " + "; ".join(f"{k} {v / 1e6:.1f} MB" for k, v in made_in.items()))


def _phase(op_name: str) -> str:
    return "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "other"


def union(intervals: list) -> int:
    total, end = 0, -1
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


if __name__ == "__main__":
    main()
