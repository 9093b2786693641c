"""The same benchmark on two git revisions, alternating A B A B ... so that both see the same machine.

  python scripts/bench/bench_revs.py REV_A REV_B [--rounds 3] [-- bench.py arguments]

Each revision is checked out into a temporary worktree and runs its own bench.py (scripts/bench/bench.py,
or scripts/bench.py before the re-layout) on scripts/bench/bench.yaml of this checkout unless arguments
follow `--`. Prints every round's step time and ratio (model FLOP/s over the matmul rate measured in the
same process) and the medians: the ratio is the figure that survives a busy host.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(tree: Path, args: list[str]) -> tuple[float, float]:
    bench = next(p for p in (tree / "scripts/bench/bench.py", tree / "scripts/bench.py") if p.exists())
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True, env=env, cwd=tree)
    step = re.search(r"step time \(median of \d+\): ([\d.]+) ms", out.stdout)
    ratio = re.search(r"ratio model FLOP/s / \w+ matmul rate: ([\d.]+)", out.stdout)
    if not (step and ratio):
        raise SystemExit(f"bench_revs: {bench} printed no step time:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(step.group(1)), float(ratio.group(1))


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else None
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("revs", nargs=2)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    args = extra if extra is not None else [str(ROOT / "scripts/bench/bench.yaml"), "--steps", "20",
                                            "--no-reference"]
    with tempfile.TemporaryDirectory() as tmp:
        trees = []
        for i, rev in enumerate(a.revs):
            t = Path(tmp) / f"rev{i}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(t), rev], check=True)
            trees.append(t)
        try:
            got = {rev: [] for rev in a.revs}
            for r in range(a.rounds):
                for rev, tree in zip(a.revs, trees):
                    step, ratio = run(tree, args)
                    got[rev].append((step, ratio))
                    print(f"round {r + 1} {rev}: {step:.1f} ms, ratio {ratio:.3f}", flush=True)
            for rev in a.revs:
                print(f"{rev}: median {statistics.median(s for s, _ in got[rev]):.1f} ms, "
                      f"ratio {statistics.median(q for _, q in got[rev]):.3f}")
        finally:
            for t in trees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(t)], check=False)


if __name__ == "__main__":
    main()
