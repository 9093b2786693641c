"""Sharded prepare's speed: one worker, N local workers and a Ray cluster on localhost, alternating in rounds.

  python scripts/bench/prepare_workers.py [--source builtin] [--workers 2] [--shard-mb 2] [--rounds 3] [--no-ray]

Each run prepares the same source into a fresh folder with one trained tokenizer (trained once here, then given with
--tokenizer: the runs time the encoding alone), every worker's tokenizer single-threaded (TOKENIZERS_PARALLELISM=false,
as a worker sets it). Prints each kind's median tokens/s over the rounds, the ratios to one worker, the host's cpu
family and model and its load average before the first round. The Ray cluster (`ray start --head`, as many CPUs as
--workers) is started once, before the rounds, and stopped after.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    get = lambda key: next((x.split(":", 1)[1].strip() for x in info if x.startswith(key)), "?")  # noqa: E731
    flags = get("flags").split()
    return f"cpu family {get('cpu family')}, {get('model name')}, avx512f {'yes' if 'avx512f' in flags else 'no'}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default="builtin")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shard-mb", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-ray", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from trainer.data.shards import prepare_folder
    tmp = Path(tempfile.mkdtemp())
    quiet = lambda *_: None  # noqa: E731
    prepare_folder([a.source], str(tmp / "tok"), None, 4096, 0.05, log=quiet, show_progress=False, workers=1,
                   shard_mb=1e6)  # the tokenizer, trained once
    tok = str(tmp / "tok" / "tokenizer.json")
    kinds = {"1 worker": dict(workers=1), f"{a.workers} workers": dict(workers=a.workers)}
    port = None
    if not a.no_ray:
        port = 6400 + os.getpid() % 1000
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--num-cpus", str(a.workers),
                        "--port", str(port), "--include-dashboard", "false", "--disable-usage-stats"], check=True,
                       capture_output=True)
        kinds["Ray"] = dict(ray=f"127.0.0.1:{port}")
    load = os.getloadavg()
    rates = {k: [] for k in kinds}
    try:
        for r in range(a.rounds):
            for name, kw in kinds.items():
                out = tmp / f"{r}-{name.replace(' ', '')}"
                t0 = time.perf_counter()
                m = prepare_folder([a.source], str(out), tok, None, 0.05, log=quiet, show_progress=False,
                                   shard_mb=a.shard_mb, **kw)
                rates[name].append(m["tokens"]["total"] / (time.perf_counter() - t0))
                shutil.rmtree(out)
    finally:
        if port:
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{cpu()}; load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"prepare {a.source}, shards of {a.shard_mb:g} MB, median of {a.rounds} rounds (tokens/s, wall clock of "
          "the whole prepare_folder call):")
    one = statistics.median(rates["1 worker"])
    for name, rs in rates.items():
        print(f"  {name:<10} {statistics.median(rs):>12,.0f} tokens/s  {statistics.median(rs) / one:5.2f}x")


if __name__ == "__main__":
    main()
