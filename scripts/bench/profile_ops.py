"""Per-op time of the compiled train step on CPU: where a step's milliseconds go.

  python scripts/bench/profile_ops.py [key=value ...] [--devices N] [--steps 3] [--top 30]

Runs the step under jax.profiler with XLA:CPU's per-thunk trace events on
(--xla_cpu_enable_xprof_traceme), reads the Perfetto trace, joins every event with its HLO
instruction (shape, operands, the JAX op it came from) and prints the slowest ops per step and
the split between matmuls (dot fusions) and everything else. Tracing slows small ops, so the
total is above the untraced step time (scripts/bench/bench.py); use it for where time goes, and
bench.py for how long a step takes. With several simulated devices, times add up over devices.
Default config: the bench config of docs/performance.md.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BENCH = [str(Path(__file__).with_name("bench.yaml"))]  # docs/performance.md


def hlo_index(text: str) -> dict:
    """instruction name -> (result shape, operand shapes, JAX op name)."""
    shapes, out = {}, {}
    pat = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+?)(?:\{[^}]*\})? [\w\-]+\((.*?)\)(.*)$", re.M)
    for m in pat.finditer(text):
        shapes[m.group(1)] = m.group(2)
    for m in pat.finditer(text):
        name, shape, args, rest = m.groups()
        on = re.search(r'op_name="([^"]+)"', rest)
        operands = [shapes.get(a.strip().lstrip("%"), "?") for a in args.split(",")[:3] if a.strip()]
        out[name] = (shape, operands, re.sub(r"^jit\([^)]*\)/", "", on.group(1)) if on else "")
    return out


def kind(name: str, origin: str) -> str:
    """A rough class of an op, from its HLO name and the JAX op it came from."""
    if "dot_general" in origin or name.startswith("dot"):
        attention = any(t in origin for t in ("BNTS", "BTNH", "bkgts", "bkgte", "bkse"))
        return "attention matmuls" if attention else "other matmuls"
    if name.startswith("wrapped_broadcast"):
        return "zero-fills"
    if "dynamic" in name:
        return "dynamic slices/updates"
    if name.startswith("copy") or "transpose" in name or "concatenate" in name or name.startswith("slice"):
        return "copies/transposes/slices"
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("args", nargs="*", help="key=value overrides on top of the bench config")
    ap.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    ap.add_argument("--steps", type=int, default=3, help="traced steps (after 3 untraced)")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
    if a.devices:
        flags += f" --xla_force_host_platform_device_count={a.devices}"
    os.environ["XLA_FLAGS"] = flags
    import jax
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step

    cfg = load_config(BENCH + list(a.args) + ["run.progress=false"])
    s = make_setup(cfg)
    batch = jax.device_put(Batches(load_corpus("synthetic"), 0, cfg.train.batch_size, s.model.seq_len,
                                   s.model.vocab_size).global_train(0), s.batch_sharding())
    with jax.set_mesh(s.mesh), tempfile.TemporaryDirectory() as tmp:
        step, state = jit_train_step(s), init_state(s)
        for _ in range(3):
            state, m = step(state, batch)
        jax.block_until_ready(m)
        index = hlo_index(step.lower(state, batch).compile().as_text())
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(a.steps):
                state, m = step(state, batch)
            jax.block_until_ready(m)
        trace = json.load(gzip.open(glob.glob(f"{tmp}/**/*perfetto_trace.json.gz", recursive=True)[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in index and not e["name"].startswith("while"):
            total[e["name"]] += e["dur"] / 1e3 / a.steps
            count[e["name"]] += 1
    kinds = collections.Counter()
    for n, t in total.items():
        kinds[kind(n, index[n][2])] += t
    dots = kinds["attention matmuls"] + kinds["other matmuls"]
    print(f"per step: matmuls {dots:.1f} ms, everything else {sum(kinds.values()) - dots:.1f} ms "
          f"({len(total)} distinct ops)")
    print("  " + " | ".join(f"{k} {t:.1f}" for k, t in kinds.most_common()))
    print(f"{'ms/step':>8s} {'calls':>5s}  {'op':28s} {'result':22s} {'operands':44s} from")
    for n, t in total.most_common(a.top):
        shape, operands, origin = index[n]
        print(f"{t:8.2f} {count[n] // a.steps:5d}  {n[:28]:28s} {shape[:22]:22s} {' '.join(operands)[:44]:44s} "
              f"{origin[-60:]}")


if __name__ == "__main__":
    main()
