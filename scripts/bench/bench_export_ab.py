"""The train step of another git revision against this tree's, timed step by step in one process.

  python scripts/bench/bench_export_ab.py REV [--steps 30] [--rounds 5] [-- key=value ...]

REV's step is compiled in its own worktree, exported with `jax.export` (StableHLO: the program as
that revision's code traced it) and brought into this process, where XLA compiles it next to this
tree's step for the same config (scripts/bench/bench.yaml plus any key=value). The two then run in
alternating blocks of --steps steps on the same inputs, so that both see the same machine at the
same moments: on a noisy host the per-round ratio of their step times is the figure that holds
(absolute times do not). Needs `flatbuffers` (jax.export's serialization). One device; the batch of the
revision's own format (a (B, T+1) token array
before the batch fields, the fields after).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from alternate import alternate

ROOT = Path(__file__).resolve().parents[2]
EXPORT = r"""
import sys, jax, numpy as np
from trainer.config import load_config
from trainer.state import make_setup
from trainer.step import jit_train_step
out, args = sys.argv[1], sys.argv[2:]
s = make_setup(load_config(args + ["run.progress=false"]), jax.devices()[:1])
state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), s.shapes, s.shardings)
if hasattr(s, "abstract_batch"):
    batch = s.abstract_batch()
else:
    batch = jax.ShapeDtypeStruct((s.cfg.train.batch_size, s.model.seq_len + 1), np.int32, sharding=s.batch_sharding())
leaves, tree = jax.tree.flatten(state)
step = jit_train_step(s)


def flat(leaves, batch):  # the state as a list of leaves: optax's state types have no serialization
    new, metrics = step(jax.tree.unflatten(tree, leaves), batch)
    return jax.tree.leaves(new), metrics


with jax.set_mesh(s.mesh):
    exp = jax.export.export(jax.jit(flat, donate_argnums=0))(leaves, batch)
open(out, "wb").write(exp.serialize())
print("fields" if isinstance(batch, dict) else "windows")
"""


def exported(rev: str, args: list[str], tmp: Path) -> tuple[bytes, str]:
    tree = tmp / "rev"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    try:
        out = subprocess.run([sys.executable, "-c", EXPORT, str(tmp / "step.bin"), *args], capture_output=True,
                             text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
        if out.returncode:
            raise SystemExit(f"bench_export_ab: exporting {rev} failed:\n{out.stderr[-3000:]}")
        return (tmp / "step.bin").read_bytes(), out.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args = [str(ROOT / "scripts/bench/bench.yaml"), *extra]
    with tempfile.TemporaryDirectory() as tmp:
        blob, kind = exported(a.rev, args, Path(tmp))

    sys.path.insert(0, str(ROOT))
    import jax
    import numpy as np
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step
    s = make_setup(load_config(args + ["run.progress=false"]), jax.devices()[:1])
    fields = Batches(load_corpus("synthetic"), 0, s.cfg.train.batch_size, s.model.seq_len,
                     s.model.vocab_size).global_train(0)
    windows = np.concatenate([fields["tokens"], fields["targets"][:, -1:]], axis=1)
    call, tree = jax.export.deserialize(blob).call, jax.tree.structure(s.shapes)

    def theirs(state, batch):
        leaves, metrics = call(jax.tree.leaves(state), batch)
        return jax.tree.unflatten(tree, leaves), metrics
    theirs = jax.jit(theirs, donate_argnums=0)
    steps = {"theirs": theirs, "ours": jit_train_step(s)}
    batches = {"theirs": jax.device_put(fields if kind == "fields" else windows), "ours": jax.device_put(fields)}
    states = {k: init_state(s) for k in steps}

    with jax.set_mesh(s.mesh):
        alternate(steps, states, batches, a.steps, a.rounds, ("theirs", "ours"),
                  label=lambda n: a.rev if n == "theirs" else "this tree")


if __name__ == "__main__":
    main()
