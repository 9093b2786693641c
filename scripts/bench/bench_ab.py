"""Interleaved A/B of train-step variants in one process: the variants see the same host load.

  python scripts/bench/bench_ab.py "VARIANT A overrides" "VARIANT B overrides" ... [--rounds 6] [--devices N]

Each quoted argument is one variant: key=value overrides on top of the bench config of
docs/performance.md (4 layers, d_model 256, 4 heads, d_ff 1024, vocab 256, seq 256, float32,
batch 4, 1 device). Every variant's jitted step is built and warmed up; then `--rounds` rounds
each time 4 steps of every variant in turn, with the float32 matmul rate (best of 1024^3 and
2048^3) measured between rounds. Prints each variant's median step time, its ratio of model
FLOP/s to the median matmul rate, and its time to the first finished step (trace + compile + run).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BENCH = [str(Path(__file__).with_name("bench.yaml"))]  # docs/performance.md


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+", help="one quoted string of key=value overrides per variant")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    a = ap.parse_args()
    if a.devices:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
    import jax
    import jax.numpy as jnp
    from models import flops_per_token
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.hardware import measure_matmul_rate
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step

    runs = []
    for v in a.variants:
        cfg = load_config(BENCH + v.split() + ["run.progress=false"])
        n = cfg.mesh.data * cfg.mesh.stage * cfg.mesh.model
        s = make_setup(cfg, jax.devices()[:n] if n > 0 else None)
        batch = jax.device_put(Batches(load_corpus("synthetic"), 0, cfg.train.batch_size, s.model.seq_len,
                                       s.model.vocab_size).global_train(0), s.batch_sharding())
        with jax.set_mesh(s.mesh):
            t = time.perf_counter()
            step, state = jit_train_step(s), init_state(s)
            state, m = step(state, batch)
            jax.block_until_ready(m)
            first = time.perf_counter() - t
            for _ in range(2):
                state, m = step(state, batch)
            jax.block_until_ready(m)
        runs.append(dict(name=v or "(bench config)", s=s, step=step, state=state, batch=batch, first=first,
                         times=[], flops=flops_per_token(s.model) * cfg.train.batch_size * s.model.seq_len))
    rates = []
    for _ in range(a.rounds):
        rates.append(max(measure_matmul_rate(jnp.float32, 1024, 5), measure_matmul_rate(jnp.float32, 2048, 2)))
        for r in runs:
            with jax.set_mesh(r["s"].mesh):
                for _ in range(4):
                    t = time.perf_counter()
                    r["state"], m = r["step"](r["state"], r["batch"])
                    jax.block_until_ready(m)
                    r["times"].append(time.perf_counter() - t)
    rate = statistics.median(rates)
    print(f"float32 matmul rate: median {rate / 1e9:.0f} GFLOP/s (min {min(rates) / 1e9:.0f}, max {max(rates) / 1e9:.0f})")
    for r in runs:
        dt = statistics.median(r["times"])
        print(f"{dt * 1e3:8.1f} ms  ratio {r['flops'] / dt / rate:.3f}  first step {r['first']:.1f}s  [{r['name']}]")


if __name__ == "__main__":
    main()
