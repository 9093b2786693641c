"""Step time of each train.grad_sync mode, interleaved in one process so that all see the same load,
with the collectives each compiled step runs and the time of the gradient sync alone.

  python scripts/bench/bench_sync.py [CONFIG.yaml ...] [key=value ...] [--devices N] [--rounds R] [--modes auto,ring]

Example (8 simulated CPU devices):
  python scripts/bench/bench_sync.py model.preset=tiny mesh.data=8 --devices 8
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("args", nargs="*", help="configs and key=value overrides")
    ap.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of 5 timed steps per mode")
    ap.add_argument("--modes", default="auto,psum,ring,ring_bf16")
    return ap.parse_args()


def timed(fn, *args):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t


def main():
    a = parse()
    if a.devices:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
    global jax
    import jax
    from jax.sharding import PartitionSpec as P
    from trainer.parallel import sync
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.plan.hlo import collective_bytes
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step

    runs = {}
    for mode in a.modes.split(","):
        s = make_setup(load_config(list(a.args) + [f"train.grad_sync={mode}", "run.progress=false"]))
        t = s.cfg.train
        rows = Batches(load_corpus("synthetic"), 0, t.batch_size, s.model.seq_len, s.model.vocab_size).global_train(0)
        batch, state = jax.device_put(rows, s.batch_sharding()), init_state(s)
        with jax.set_mesh(s.mesh):
            step = jit_train_step(s).lower(state, batch).compile()
        text = step.as_text()
        colls = ", ".join(f"{kind} over {'+'.join(axes)} {b / 1e3:,.1f} kB"
                          for (kind, axes), b in collective_bytes(text, dict(s.mesh.shape)).items() if b >= 1e3)
        # the all-reduce of a replicated gradient alone, outside the step
        dims = jax.tree.map(lambda sh, lg: s.layout.data_dim(sh.shape, lg), s.param_shapes, s.logical)
        specs = jax.tree.map(lambda sh, lg: s.layout.compute_spec(sh.shape, lg), s.param_shapes, s.logical)
        r = sync.make(mode, "data", s.mesh.shape["data"])
        alone = jax.jit(jax.shard_map(lambda g: r.all_reduce_tree(g, dims, specs), mesh=s.mesh, in_specs=P(),
                                      out_specs=P(), axis_names={"data"}, check_vma=False))
        grads = jax.tree.map(lambda x: x * 1.0, state["params"])
        with jax.set_mesh(s.mesh):  # warm-up: first calls allocate and compile
            state, m = step(state, batch)
            jax.block_until_ready((m, alone(grads)))
        runs[mode] = {"s": s, "step": step, "state": state, "batch": batch, "colls": colls, "alone": alone,
                      "grads": grads, "t": [], "t_sync": []}
    for _ in range(a.rounds):
        for mode, r in runs.items():
            with jax.set_mesh(r["s"].mesh):
                r["t_sync"].append(timed(r["alone"], r["grads"]))
                for _ in range(5):
                    t0 = time.perf_counter()
                    r["state"], m = r["step"](r["state"], r["batch"])
                    jax.block_until_ready(m)
                    r["t"].append(time.perf_counter() - t0)
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices | {' '.join(a.args)} | "
          f"medians (min) over {a.rounds} interleaved rounds; the sync alone of auto is psum's")
    for mode, r in runs.items():
        print(f"{mode:10s} step {statistics.median(r['t']) * 1e3:8.1f} ms ({min(r['t']) * 1e3:.1f}) | "
              f"gradient all-reduce alone {statistics.median(r['t_sync']) * 1e3:7.2f} ms "
              f"({min(r['t_sync']) * 1e3:.2f}) | sent per device per step: {r['colls'] or 'nothing'}")


if __name__ == "__main__":
    main()
