"""Interleaved A/B of the pipeline executor of this checkout against a git revision's, in one process.

  python scripts/bench/pipeline_ab.py REV [--rounds 8] [--schedules gpipe 1f1b] [key=value ...]

Loads REV's pipeline executor (trainer/parallel/pipeline.py; before the re-layout trainer/pipeline_1f1b.py, with
trainer/pipeline.py) into side modules (their imports of modules that have moved since are served by this
checkout's); for each
schedule builds the train step twice on 4 of 8 simulated CPU devices (mesh (1,4,1), model.preset=tiny
with 4 layers, 8 microbatches, batch 16, plus the overrides): once with REV's pipeline (its GPipe was autodiff through pipeline.pipeline_loss
where REV has it) and once with this checkout's. Then times 3 steps of every variant in turn per round
(the same host load for all) and prints each one's median and best step time, compiled temp memory,
and its first step's loss and grad_norm (which must agree).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


# modules that moved in the re-layout -> where they are now (what an old revision's code imports)
MOVED = {"trainer.schedules": "trainer.parallel.schedules", "trainer.sync": "trainer.parallel.sync",
         "trainer.pipeline": "trainer.parallel.circular", "trainer.localsgd": "trainer.parallel.localsgd",
         "trainer.collectives": "trainer.parallel.collective_costs"}


def _module_at(rev: str, paths: list[str], name: str):
    """The first of `paths` that exists at rev, loaded as a side module (None if none exists)."""
    import importlib
    for old, new in MOVED.items():  # an old revision's `from trainer import schedules` and friends
        sys.modules.setdefault(old, importlib.import_module(new))
    for path in paths:
        out = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True)
        if out.returncode == 0:
            mod = types.ModuleType(name)
            exec(compile(out.stdout, f"{rev}:{path}", "exec"), mod.__dict__)
            return mod
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    a = ap.parse_intermixed_args()
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from trainer.parallel import pipeline
    from trainer import step as step_mod
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.state import init_state, make_setup

    old_pipe = _module_at(a.rev, ["trainer/pipeline.py"], "rev_pipeline")
    old_exec = _module_at(a.rev, ["trainer/parallel/pipeline.py", "trainer/pipeline_1f1b.py"], "rev_pipeline_1f1b")
    ours = pipeline.loss_and_grads

    def parts(loss_grads):
        """An older executor's (loss, grads) as today's (parts, grads)."""
        return {"loss": loss_grads[0], "aux": {}}, loss_grads[1]

    def theirs(schedule):
        if schedule == "gpipe" and old_pipe is not None and hasattr(old_pipe, "pipeline_loss"):
            return lambda s, p, b, scale: parts(jax.value_and_grad(functools.partial(old_pipe.pipeline_loss, s))(p, b))
        if hasattr(old_exec, "zero_parts"):  # takes the scales and returns the parts already
            return old_exec.loss_and_grads
        return lambda s, p, b, scale: parts(old_exec.loss_and_grads(s, p, b, scale["loss"]))

    runs = []
    for schedule in a.schedules:
        for label, impl in ((a.rev, theirs(schedule)), ("worktree", ours)):
            cfg = load_config(["model.preset=tiny", "model.n_layers=4", "train.microbatches=8", "train.batch_size=16",
                               "run.progress=false", "mesh.data=1", "mesh.stage=4",
                               f"train.pipeline_schedule={schedule}"] + a.overrides)
            s = make_setup(cfg, jax.devices()[:4])
            batch = jax.device_put(Batches(load_corpus("synthetic"), 0, cfg.train.batch_size, s.model.seq_len,
                                           s.model.vocab_size).global_train(0), s.batch_sharding())
            pipeline.loss_and_grads = impl  # step.loss_and_grads looks it up when the step is traced
            with jax.set_mesh(s.mesh):
                step, state = step_mod.jit_train_step(s), init_state(s)
                temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
                state, m = step(state, batch)
                jax.block_until_ready(m)
            pipeline.loss_and_grads = ours
            runs.append(dict(name=f"{schedule} {label}", mesh=s.mesh, step=step, state=state, batch=batch,
                             temp=temp, loss=float(m["loss"]), norm=float(m["grad_norm"]), times=[]))
    for _ in range(a.rounds):
        for r in runs:
            with jax.set_mesh(r["mesh"]):
                t = time.perf_counter()
                for _ in range(3):
                    r["state"], m = r["step"](r["state"], r["batch"])
                jax.block_until_ready(m)
            r["times"].append((time.perf_counter() - t) / 3)
    for r in runs:
        sys.stdout.write(f"{r['name']:22s} median {1e3 * statistics.median(r['times']):8.1f} ms  best "
                         f"{1e3 * min(r['times']):8.1f} ms  temp {r['temp'] / 2**20:7.2f} MiB  loss {r['loss']:.6f}  "
                         f"grad_norm {r['norm']:.6f}\n")


if __name__ == "__main__":
    main()
