"""XLA:TPU's figures of a small train step at two git revisions, side by side (compiled here, nothing runs).

  python scripts/bench/tpu_compare.py REV_A [REV_B] [--topology v5p:2x2x2] [--rounds 1] [-- key=value ...]

Each revision (REV_B default: the working tree) is checked out into a temporary worktree and, in a fresh
process of its own (cold: jax's compilation cache off), compiles its train step ahead of time for a TPU
topology through libtpu, as `meshtrain plan --compile-for` does. Printed per side: XLA:TPU's temp, argument
and output bytes per chip, the collectives (bytes one chip sends per step, read from both programs by this
tree's HLO reader, trainer/plan/hlo.py), the attention the program holds (its `attention_*` scope), the HLO's
lines, and the seconds spent tracing and lowering and compiling. With --rounds N > 1 the sides compile in
alternating order (A B, B A, ...) and the medians are printed: the two sides of a round see about the same
host load.

The default program (1B shapes, 2 layers, ZeRO-3 over 8 chips, remat=full, batch 1 x 2048 per chip) is small
enough for a few minutes on a 2-core host and holds the 7B step's attention scratch: its temp went from
1.14 GB (6da7880) to 1.68 GB (5cbc3bb). Revisions before 7c26e8c chose the model's kernels by the host's
platform, so there a CPU host compiles the CPU fast paths' program (attention `unnamed`) for the TPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PROGRAM = ["model.preset=1b", "model.n_layers=2", "mesh.data=-1", "train.zero_stage=3", "train.batch_size=8",
           "model.remat=full"]
CHILD = r"""
import json, os, re, sys, time
topology, hlo_path, args = sys.argv[1], sys.argv[2], sys.argv[3:]
t0 = time.perf_counter()
import jax
try:
    from trainer.plan.aot import topology_devices
    devices = topology_devices(topology)
except ImportError:  # before plan --compile-for: the topology as jax describes it
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    devices = list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
from trainer.config import load_config
from trainer.plan import verify
from trainer.state import make_setup
from trainer.step import jit_train_step
s = make_setup(load_config(args), devices)
state, batch = (getattr(verify, "abstract_inputs", None) or verify._abstract_inputs)(s)
t1 = time.perf_counter()
with jax.set_mesh(s.mesh):
    lowered = jit_train_step(s).lower(state, batch)
    t2 = time.perf_counter()
    step = lowered.compile({})
t3 = time.perf_counter()
mem, text = step.memory_analysis(), step.as_text()
open(hlo_path, "w").write(text)
print(json.dumps({"temp": mem.temp_size_in_bytes, "arguments": mem.argument_size_in_bytes,
                  "outputs": mem.output_size_in_bytes, "aliased": mem.alias_size_in_bytes,
                  "setup_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2, "hlo_lines": len(text.splitlines()),
                  "attention": sorted(set(re.findall(r'op_name="[^"]*attention_(\w+)', text))) or ["unnamed"],
                  "mesh": dict(s.mesh.shape)}))
"""


def compile_once(tree: Path, topology: str, args: list[str], tmp: str) -> dict:
    """Compile `tree`'s step in a fresh process; XLA:TPU's figures and the collectives as this tree reads them."""
    from trainer.plan.hlo import collective_bytes
    hlo = Path(tempfile.mkstemp(suffix=".hlo", dir=tmp)[1])
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(tree), JAX_ENABLE_COMPILATION_CACHE="false", JAX_PLATFORMS="")
    p = subprocess.run([sys.executable, "-c", CHILD, topology, str(hlo), *args], capture_output=True, text=True,
                       cwd=tree, env=env)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1][:300]}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["collectives"] = {f"{kind} {','.join(axes) or '-'}": b
                          for (kind, axes), b in collective_bytes(hlo.read_text(), out.pop("mesh")).items()}
    hlo.unlink()
    return out


def _gb(b: float) -> str:
    return f"{b / 1e9:.3f} GB"


def report(names: list[str], runs: dict[str, list[dict]]):
    """Each side's figures: memory and collectives of its first compile, seconds as the median of its compiles."""
    med = lambda key: lambda rs: f"{statistics.median(r[key] for r in rs):.1f}"  # noqa: E731
    rows = [("temp per chip", lambda rs: _gb(rs[0]["temp"])),
            ("arguments per chip", lambda rs: _gb(rs[0]["arguments"])),
            ("outputs (aliased)", lambda rs: f"{_gb(rs[0]['outputs'])} ({rs[0]['aliased'] / 1e9:.3f})"),
            ("attention", lambda rs: ",".join(rs[0]["attention"])), ("HLO lines", lambda rs: str(rs[0]["hlo_lines"]))]
    for kind in sorted({k for rs in runs.values() for k in rs[0]["collectives"]}):
        rows.append((kind, lambda rs, k=kind: _gb(rs[0]["collectives"].get(k, 0))))
    rows += [("setup (s)", med("setup_s")), ("trace+lower (s)", med("lower_s")), ("XLA compile (s)", med("compile_s"))]
    w = max(26, *(len(n) + 2 for n in names))
    print(f"{'':24}" + "".join(f"{n:>{w}}" for n in names))
    for label, cell in rows:
        print(f"{label:24}" + "".join(f"{cell(runs[n]):>{w}}" for n in names))
    if len(names) == 2:
        a, b = (runs[n] for n in names)
        print(f"temp {names[1]} / {names[0]}: {b[0]['temp'] / a[0]['temp']:.4f}")
        ratios = [rb["compile_s"] / ra["compile_s"] for ra, rb in zip(a, b)]
        print(f"XLA compile {names[1]} / {names[0]}: median {statistics.median(ratios):.3f} over {len(ratios)} "
              f"round(s) ({min(ratios):.3f} .. {max(ratios):.3f})")


def main():
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("revs", nargs="+", metavar="REV", help="REV_A [REV_B] (REV_B default: the working tree)")
    ap.add_argument("--topology", default="v5p:2x2x2", help="a TPU topology as jax names it (default v5p:2x2x2)")
    ap.add_argument("--rounds", type=int, default=1, help="compiles per side, in alternating order")
    ns = ap.parse_args(argv[:cut])
    if len(ns.revs) > 2:
        ap.error("give one or two revisions")
    args = PROGRAM + argv[cut + 1:]
    revs = ns.revs + ([None] if len(ns.revs) == 1 else [])
    names = [r or "working tree" for r in revs]
    if len(set(names)) < 2:
        names = [f"{n} ({i + 1})" for i, n in enumerate(names)]
    print(f"{ns.topology}: {' '.join(args)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        trees = []
        for i, rev in enumerate(revs):
            tree = ROOT
            if rev is not None:
                tree = Path(tmp) / f"rev{i}"
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev],
                               check=True)
            trees.append(tree)
        try:
            runs = {n: [] for n in names}
            for r in range(ns.rounds):
                for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                    runs[names[i]].append(compile_once(trees[i], ns.topology, args, tmp))
                    res = runs[names[i]][-1]
                    print(f"round {r + 1} {names[i]}: " + (res["error"] if "error" in res else
                          f"temp {_gb(res['temp'])}, compile {res['compile_s']:.1f} s"), flush=True)
            if any("error" in res for rs in runs.values() for res in rs):
                sys.exit("a compile failed (above)")
            report(names, runs)
        finally:
            for rev, tree in zip(revs, trees):
                if rev is not None:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


if __name__ == "__main__":
    main()
