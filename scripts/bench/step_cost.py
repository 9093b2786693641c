"""XLA's own cost figures for the compiled train step, on one or more git revisions (no timing: the
figures are the compiler's, the same on a busy host).

  python scripts/bench/step_cost.py [REV ...] [-- key=value ...]

Each revision (default: the working tree only) is checked out into a temporary worktree and compiles
the step of scripts/bench/bench.yaml (plus any key=value after `--`) ahead of time from abstract inputs;
prints its FLOPs and bytes accessed (cost_analysis), fusions and temp memory.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = r"""
import re, sys, jax, numpy as np
from trainer.config import load_config
from trainer.state import make_setup
from trainer.step import jit_train_step
s = make_setup(load_config(sys.argv[1:] + ["run.progress=false"]))
state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), s.shapes, s.shardings)
if hasattr(s, "abstract_batch"):  # the batch fields
    batch = s.abstract_batch()
else:  # before them: one (B, T+1) token array
    batch = jax.ShapeDtypeStruct((s.cfg.train.batch_size, s.model.seq_len + 1), np.int32, sharding=s.batch_sharding())
with jax.set_mesh(s.mesh):
    c = jit_train_step(s).lower(state, batch).compile()
cost = c.cost_analysis()
cost = cost[0] if isinstance(cost, (list, tuple)) else cost
fusions = len(re.findall(r"= \S+ fusion\(", c.as_text()))
print(f"MFLOP {cost['flops'] / 1e6:.2f} | MB accessed {cost['bytes accessed'] / 1e6:.2f} | "
      f"fusions {fusions} | temp MB {c.memory_analysis().temp_size_in_bytes / 1e6:.2f}")
"""


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    revs = argv[:argv.index("--")] if "--" in argv else argv
    args = [str(ROOT / "scripts/bench/bench.yaml"), *extra]
    with tempfile.TemporaryDirectory() as tmp:
        for i, rev in enumerate(revs or [None]):
            tree = ROOT
            if rev is not None:
                tree = Path(tmp) / f"rev{i}"
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
            try:
                out = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, cwd=tree,
                                     env={**__import__("os").environ, "PYTHONPATH": str(tree)})
                line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else f"failed: {out.stderr[-500:]}"
                print(f"{rev or 'working tree'}: {line}", flush=True)
            finally:
                if rev is not None:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


if __name__ == "__main__":
    main()
