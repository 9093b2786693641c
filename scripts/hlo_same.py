"""Is the compiled train step the same program on two revisions? (a refactor must not change it)

  python scripts/hlo_same.py REV [REV_B]      # REV against the working tree, or REV against REV_B

Each revision runs in its own process (a revision's tree from `git archive`; the working tree as it is),
on 8 simulated CPU devices, and compiles its CASES ahead of time from abstract inputs: the default
`meshtrain train` step (the default config on one device), a (2,1,4) ZeRO-3 step (data x stage x model) and
(2,2,2) ZeRO-3 steps (two pipeline microbatches, gpipe and 1f1b); an MoE (experts over `data`, router losses on),
a DPO step (each plain and pipelined), context parallelism by the ring, and the tiled cross-entropy. The optimized HLO text of each is compared
after dropping what says where the code came from, not what it computes: `metadata={...}` (source file, line, op
name), the module's tables of source files and stack frames, the module's name and the size-1 axes of its mesh. Prints one line per case and
exits 1 if any differs; a differing case also says whether it differs in value names only, and shows XLA's FLOPs, bytes
accessed, temp and output bytes on both sides and the first differing lines.
"""
from __future__ import annotations

import argparse
import difflib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOE = ["model.preset=tiny", "model.family=mixtral", "model.n_experts=4", "model.router_aux_loss=0.01",
       "model.router_z_loss=0.001"]
DPO = ["model.preset=tiny", "train.objective=dpo", "dpo.reference=unread"]
CASES = {
    "default (1 device)": (1, []),
    "(2,1,4) ZeRO-3": (8, ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3"]),
    "(2,2,2) ZeRO-3": (8, ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.zero_stage=3",
                           "train.microbatches=2"]),
    "(2,2,2) ZeRO-3 1F1B": (8, ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.zero_stage=3",
                                "train.microbatches=2", "train.pipeline_schedule=1f1b"]),
    # an MoE's experts split over `data`, its two router losses in the objective and a statistic logged
    "MoE (2,1,4) ZeRO-3": (8, MOE + ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3"]),
    "MoE (2,2,2) ZeRO-3 1F1B": (8, MOE + ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.zero_stage=3",
                                          "train.microbatches=2", "train.pipeline_schedule=1f1b"]),
    "ring context 2 (2,1,2) ZeRO-3": (8, ["model.preset=tiny", "mesh.data=2", "mesh.context=2", "mesh.model=2",
                                          "train.zero_stage=3", "train.context_attention=ring"]),
    # the objective's other head: preference pairs (the batch gains ref_logp); the reference is not read to compile
    "DPO (2,1,4) ZeRO-3": (8, DPO + ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3"]),
    "DPO (2,2,2) ZeRO-3 1F1B": (8, DPO + ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.zero_stage=3",
                                          "train.microbatches=2", "train.pipeline_schedule=1f1b"]),
    # the vocabulary-tiled cross-entropy (model.loss_chunk), plain and pipelined
    "tiled loss (2,1,4) ZeRO-3": (8, ["model.preset=tiny", "model.loss_chunk=64", "mesh.data=2", "mesh.stage=1",
                                      "mesh.model=4", "train.zero_stage=3"]),
    "tiled loss (2,2,2) ZeRO-3": (8, ["model.preset=tiny", "model.loss_chunk=64", "mesh.data=2", "mesh.stage=2",
                                      "mesh.model=2", "train.zero_stage=3", "train.microbatches=2"]),
}

STACK_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")  # where each op came from

# Run inside the revision's tree: only names both layouts have (trainer.config, trainer.state, trainer.step).
CHILD = r"""
import json, sys
import jax, numpy as np
from trainer.config import load_config
from trainer.state import make_setup
from trainer.step import jit_train_step
out = {}
for name, (n, overrides) in json.loads(sys.argv[1]).items():
    s = make_setup(load_config(overrides + ["run.progress=false"]), jax.devices()[:n])
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), s.shapes, s.shardings)
    batch = s.abstract_batch()
    with jax.set_mesh(s.mesh):
        c = jit_train_step(s).lower(state, batch).compile()
    cost = c.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    m = c.memory_analysis()
    out[name] = {"hlo": c.as_text(), "cost": {"flops": cost.get("flops"), "bytes accessed": cost.get("bytes accessed"),
                                             "temp bytes": m.temp_size_in_bytes, "output bytes": m.output_size_in_bytes}}
json.dump(out, sys.stdout)
"""


def normalise(hlo: str) -> list[str]:
    """HLO lines without source metadata (the `metadata={...}` of each op and the module's tables of
    files, functions and stack frames), without the module's name, and without the size-1 axes of the mesh the
    module names (`#sdy.mesh<["data"=1, ...]>`: an axis added to the mesh list splits nothing at size 1)."""
    blocks = [b for b in hlo.split("\n\n") if b.split("\n", 1)[0].strip() not in STACK_TABLES]
    hlo = re.sub(r",?\s*metadata=\{[^{}]*\}", "", "\n\n".join(blocks))
    hlo = re.sub(r"^HloModule \S+", "HloModule m", hlo, flags=re.M)
    hlo = re.sub(r'#sdy\.mesh<\[[^\]]*\]>', lambda m: re.sub(r'"\w+"=1(, )?', "", m.group(0)).replace(", ]", "]"), hlo)
    return [ln.rstrip() for ln in hlo.splitlines() if ln.strip()]


def renamed(lines: list[str]) -> list[str]:
    """The lines with every value, computation and parameter name numbered by first appearance: two programs that differ only
    in the names XLA gave their values are then equal."""
    names: dict[str, str] = {}
    pat = re.compile(r"%[\w.\-]+|\bparam_[\d.]+\b")
    return [pat.sub(lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), ln) for ln in lines]


def compile_in(tree: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES)], capture_output=True, text=True,
                         env=env, cwd=tree)
    if out.returncode:
        raise SystemExit(f"hlo_same: compiling in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def checkout(rev: str, into: Path) -> Path:
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="a git revision (e.g. the commit before a refactor)")
    ap.add_argument("rev_b", nargs="?", help="a second revision (default: the working tree)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        left = compile_in(checkout(a.rev, Path(tmp) / "a"))
        right = compile_in(checkout(a.rev_b, Path(tmp) / "b") if a.rev_b else ROOT)
    same = True
    for name in CASES:
        x, y = normalise(left[name]["hlo"]), normalise(right[name]["hlo"])
        if x == y:
            print(f"{name}: same optimized HLO ({len(x)} lines)")
            continue
        same = False
        diff = list(difflib.unified_diff(x, y, a.rev, a.rev_b or "working tree", lineterm="", n=0))
        print(f"{name}: DIFFERENT ({sum(ln[:1] in '+-' for ln in diff[2:])} lines differ)")
        if renamed(x) == renamed(y):
            print("  ... in value names only: the same ops in the same order, on the same operands")
        for k, v in left[name]["cost"].items():
            print(f"  {k}: {v:,.0f} -> {right[name]['cost'][k]:,.0f}")
        print("\n".join(diff[:40]))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
