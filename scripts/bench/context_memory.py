"""The longest sequence that fits a per-device memory under context parallelism, C = 1, 2, 4, 8:

  python scripts/bench/context_memory.py [--model 125m] [--memory-gb 8] [--contexts 1,2,4,8] [--no-verify]

For each C the planner (trainer/plan) finds the longest seq_len, a multiple of 256 x C (whole load-balanced chunks of
whole 128-query blocks), whose step fits --memory-gb per device: one row per data rank, mesh (data 1, context C) on C
simulated CPU devices, float32, the model's remat. Then `plan --verify`'s measurement compiles that step ahead of time
(XLA:CPU, nothing runs) and prints XLA's own total (arguments + temp + outputs not aliased) and temp against the
planner's; last, stepping down from the planner's length, the longest whose compiled step XLA says fits (`XLA fits`).
Every compile is cold, in this process; figures are per device.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="125m")
    ap.add_argument("--memory-gb", type=float, default=8.0)
    ap.add_argument("--contexts", default="1,2,4,8")
    ap.add_argument("--max-len", type=int, default=1 << 17)
    ap.add_argument("--no-verify", action="store_true")
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    sys.path.insert(0, str(ROOT))
    import os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={max(contexts)}").strip()
    import trainer.platforms  # noqa: F401  (before jax: with libtpu installed and no chip, no TPU runtime)
    from trainer import load_config
    from trainer.config import model_config
    from trainer.hardware import get_device
    from trainer.plan.core import estimate, strategy_of
    from trainer.plan.verify import measure
    budget = a.memory_gb * 1e9
    device = get_device("h100-80g")  # the link model only: fit is judged against --memory-gb

    def config(C: int, T: int):
        return load_config([f"model.preset={a.model}", f"model.seq_len={T}", "train.batch_size=1", "mesh.data=1",
                            f"mesh.context={C}", "train.dtype=float32", "run.progress=false"])

    def planned(C: int, T: int):
        cfg = config(C, T)
        return cfg, estimate(model_config(cfg), cfg.train, strategy_of(cfg, C), device, 1, "float32", "cpu")

    print(f"{a.model}, one row per data rank, float32, fit within {a.memory_gb:g} GB per device (planner); "
          "XLA's figures from an ahead-of-time compile of that step")
    print(f"{'C':>2} {'seq_len':>8} {'plan GB':>8} {'XLA GB':>8} {'plan/XLA':>8} {'plan temp':>9} {'XLA temp':>9}"
          f" {'compile s':>9} {'XLA fits':>9}")
    for C in contexts:
        step, lo, hi = 256 * C, 0, a.max_len // (256 * C)  # in units of `step`: lo fits, hi + 1 does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if planned(C, mid * step)[1].total_bytes <= budget:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            print(f"{C:>2} nothing fits")
            continue
        T = lo * step
        cfg, plan = planned(C, T)
        temp = plan.activations_bytes + plan.grads_bytes + plan.buffers_bytes
        if a.no_verify:
            print(f"{C:>2} {T:>8} {plan.total_bytes / 1e9:>8.2f}")
            continue
        t0 = time.perf_counter()
        m = measure(cfg, grads=False)
        took = time.perf_counter() - t0
        fits = lo  # then XLA's own: the longest length whose compiled step fits, from the planner's down
        while fits > 0 and measure(config(C, fits * step), grads=False).total_bytes > budget:
            fits -= 1
        print(f"{C:>2} {T:>8} {plan.total_bytes / 1e9:>8.2f} {m.total_bytes / 1e9:>8.2f} "
              f"{plan.total_bytes / m.total_bytes:>8.3f} {temp / 1e9:>9.2f} {m.temp_bytes / 1e9:>9.2f} {took:>9.1f}"
              f" {fits * step:>9}", flush=True)


if __name__ == "__main__":
    main()
