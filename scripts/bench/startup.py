"""Start-up time: from launching `meshtrain train` to its first finished step, compile included.

  python scripts/bench/startup.py [--runs 3] [--devices N] [--as-installed] [key=value ...]

Default config: the bench config (4 layers, d_model 256, 4 heads, d_ff 1024, vocab 256, seq 256,
batch 4, float32, 1 device). Each run is a fresh process with a cold compilation cache and a new
run.dir; the clock starts just before the process is spawned and stops when metrics.jsonl gets
its step-1 line (run.log_every=1: step 1's loss is fetched from the device, so the step has
finished). The trainer's own "init+compile" figure is printed next to it, and the rest is
Python and library imports, config, mesh and corpus loading.

--as-installed leaves JAX_PLATFORMS unset, as a user runs it: with libtpu installed (the tpu and test
extras) and no TPU chip, this measures that meshtrain starts no TPU runtime (trainer/platforms.py);
run it once with libtpu installed and once without to compare. Lines of the run's output that
mention TPU or libtpu are counted and printed.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = [str(Path(__file__).with_name("bench.yaml"))]  # docs/performance.md


def one_run(args, devices, as_installed=False) -> tuple[float, float | None, list[str]]:
    with tempfile.TemporaryDirectory() as d:
        metrics = Path(d) / "run" / "metrics.jsonl"
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        if as_installed:
            env.pop("JAX_PLATFORMS")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        if devices:
            env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        cmd = [sys.executable, "-m", "trainer.cli", "train", *BENCH, *args, f"run.dir={d}/run", "train.steps=2",
               "run.log_every=1", "run.progress=false"]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = None
        while first is None and p.poll() is None:
            if metrics.exists() and '"step": 1' in metrics.read_text():
                first = time.perf_counter() - t0
            else:
                time.sleep(0.005)
        out = p.communicate()[0]
        if p.returncode != 0 or first is None:
            sys.exit(f"the training run failed:\n{out}")
        m = re.search(r"init\+compile ([\d.]+)s", out)
        tpu = [line for line in out.splitlines() if re.search(r"\bTPU|libtpu", line)]
        return first, float(m.group(1)) if m else None, tpu


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("args", nargs="*", help="key=value overrides on top of the bench config")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    ap.add_argument("--as-installed", action="store_true", help="leave JAX_PLATFORMS unset")
    a = ap.parse_args()
    import importlib.util
    print(f"libtpu installed: {importlib.util.find_spec('libtpu') is not None}; "
          f"JAX_PLATFORMS {'unset' if a.as_installed else '=cpu'}")
    firsts = []
    for i in range(a.runs):
        first, compile_s, tpu = one_run(a.args, a.devices, a.as_installed)
        firsts.append(first)
        print(f"run {i + 1}: first step finished {first:.2f}s after launch (trainer's init+compile {compile_s}s); "
              f"{len(tpu)} output lines mention TPU" + "".join(f"\n    {line}" for line in tpu[:3]))
    print(f"start-up to first finished step: median {statistics.median(firsts):.2f}s of {a.runs} runs "
          f"(min {min(firsts):.2f}s, max {max(firsts):.2f}s)")


if __name__ == "__main__":
    main()
