"""The MoE MLP's dropless formulations (models/families/moe.py FORMULATIONS) against the dense SwiGLU MLP of the same active
width, one MLP block forward and backward, in one process:

  python scripts/bench/moe_formulations.py [--tokens 1024] [--d 256] [--width 1024] [--k 2] [--experts 4,8]
                                           [--rounds 5] [--steps 10]

Each expert is a SwiGLU of `width`; the dense MLP has k x width hidden units (the FLOPs of a token's k experts).
The router is a random one (uniform load on average). Every function is jitted and run in alternating rounds of
--steps calls (the machine the same for all at each moment); the median over rounds of each one's time per call is
printed with its ratio to the dense MLP's. models/families/moe.py's BY_PLATFORM names the one chosen on each platform.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--experts", default="4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import trainer.platforms  # noqa: F401  (before jax: with libtpu installed and no chip, no TPU runtime)
    import jax
    import jax.numpy as jnp
    from models.kernels.fast_cpu import silu
    from models.kernels.experts import FORMULATIONS
    N, D, F, K = a.tokens, a.d, a.width, a.k
    keys = jax.random.split(jax.random.key(0), 8)
    h = jax.random.normal(keys[0], (N, D))
    dense_w = (jax.random.normal(keys[1], (D, K * F)) * 0.05, jax.random.normal(keys[2], (D, K * F)) * 0.05,
               jax.random.normal(keys[3], (K * F, D)) * 0.05)

    def dense(h, ws):
        return (silu(h @ ws[0]) * (h @ ws[1])) @ ws[2]

    def timed(f, *args):
        g = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1)))
        jax.block_until_ready(g(*args))
        return lambda: jax.block_until_ready(g(*args))

    print(f"{jax.devices()[0].device_kind}; N={N} d={D} expert width={F} k={K}; forward + backward of one block")
    for X in [int(x) for x in a.experts.split(",")]:
        ws = (jax.random.normal(keys[4], (X, D, F)) * 0.05, jax.random.normal(keys[5], (X, D, F)) * 0.05,
              jax.random.normal(keys[6], (X, F, D)) * 0.05)
        logits = jax.random.normal(keys[7], (N, X))
        top, idx = jax.lax.top_k(logits, K)
        w, keep = jax.nn.softmax(top, axis=-1), jnp.ones((N, K), bool)
        runs = {f"dense MLP (d_ff {K * F})": timed(dense, h, dense_w)}
        for name, f in FORMULATIONS.items():
            runs[name] = timed(lambda h, ws, f=f: f(h, idx, keep, w, ws, silu), h, ws)
        times = {n: [] for n in runs}
        for _ in range(a.rounds):
            for n, run in runs.items():
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    run()
                times[n].append((time.perf_counter() - t0) / a.steps)
        base = statistics.median(next(iter(times.values())))
        print(f"E={X}:")
        for n, ts in times.items():
            m = statistics.median(ts)
            print(f"  {n:24s} {m * 1e3:8.2f} ms  {m / base:5.2f}x")


if __name__ == "__main__":
    main()
