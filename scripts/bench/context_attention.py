"""What attending by position costs on CPU: models/kernels/fast_cpu.py's causal attention, forward and backward, one process,
the runs alternating:

  python scripts/bench/context_attention.py [--seq 2048] [--heads 12] [--head-dim 64] [--rounds 5] [--steps 3]

  whole row     the whole-row kernel (index causality: each query block skips the key blocks after it): from
                fast_cpu.LOOPS_FROM tokens on as loops over tiles (models/kernels/flash_cpu.py), shorter rows unrolled
  unrolled      the unrolled form at any length (query blocks of 128, each against the keys it sees), for the
                choice of LOOPS_FROM; with --loops the same for the loops form ("loops")
  by position   the same row through the context kernel (positions traced: every block takes every key, the
                blocks one at a time in a scan): what a row costs when the kernel cannot know its order
  chunk of C    one context rank's share under the all-gather strategy: T/C balanced queries against all T keys
                (C = 2, 4), the work each of C ranks does for the row

The median over rounds of each one's time per call and its ratio to the whole row's are printed.
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
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--loops", action="store_true", help="also time the loops form at any length")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import trainer.platforms  # noqa: F401  (before jax: with libtpu installed and no chip, no TPU runtime)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from models.context_parallel.gather import order
    from models.kernels.fast_cpu import causal_attention
    T, H, E = a.seq, a.heads, a.head_dim
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, T, H, E), jnp.float32) for kk in keys)

    def timed(fn, *args):
        grad = jax.jit(jax.grad(lambda *x: jnp.sum(fn(*x) ** 2), argnums=(0, 1, 2)))
        jax.block_until_ready(grad(*args))  # compile
        return lambda: jax.block_until_ready([grad(*args) for _ in range(a.steps)])

    runs = {"whole row": timed(lambda q, k, v: causal_attention(q, k, v, 128), q, k, v)}
    from models.kernels import fast_cpu as F
    from models.kernels.flash_cpu import TILE, flash
    whole = lambda kernel, block: lambda q, k, v: F._ungroup(kernel(  # noqa: E731
        F._group(q, k.shape[2]), F._kv(k), F._kv(v), E ** -0.5, block, None, None))
    runs["unrolled"] = timed(whole(F._attention, 128), q, k, v)
    if a.loops:
        runs["loops"] = timed(whole(flash, TILE), q, k, v)
    pos = jnp.arange(T, dtype=jnp.float32)
    runs["by position"] = timed(lambda q, k, v: causal_attention(q, k, v, 128, positions=(pos, pos)), q, k, v)
    for C in (2, 4):
        perm = order(T, C, True)
        mine = jnp.asarray(perm[: T // C].astype(np.float32))  # rank 0's balanced chunk
        qc = q[:, perm[: T // C]]
        runs[f"chunk of {C}"] = timed(lambda q, k, v, mine=mine: causal_attention(
            q, k, v, 128, positions=(mine, pos)), qc, k, v)
    took = {name: [] for name in runs}
    for _ in range(a.rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            took[name].append((time.perf_counter() - t0) / a.steps)
    base = statistics.median(took["whole row"])
    print(f"causal attention forward + backward, T={T}, {H} heads of {E}, float32, median of {a.rounds} rounds:")
    for name, ts in took.items():
        t = statistics.median(ts)
        print(f"  {name:<12} {1e3 * t:8.1f} ms  {t / base:5.2f}x")


if __name__ == "__main__":
    main()
