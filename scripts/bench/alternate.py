"""Two compiled train steps timed in alternating blocks in one process: both see the same machine at the
same moments, so the per-round ratio of their step times holds on a noisy host."""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def alternating_args(doc: str, *more: tuple) -> tuple[argparse.Namespace, list[str]]:
    """(options, key=value overrides) of an alternating benchmark's command line `[--steps N] [--rounds R] [more
    options] [-- key=value ...]`; `more`: (flag, argparse keywords) pairs of its own options."""
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    for flag, kw in more:
        ap.add_argument(flag, **kw)
    return ap.parse_args(argv[:cut]), argv[cut + 1:]


def alternate(steps: dict, states: dict, batches: dict, n_steps: int, rounds: int, names=("a", "b"),
              label=lambda name: name) -> list[float]:
    """Time steps[name](state, batch) n_steps at a time, A B then B A ...; print each round and the median of
    b / a; returns the per-round ratios. The first block of each compiles and warms up (not counted)."""
    import jax

    def block(name):
        st, t0 = states[name], time.perf_counter()
        for _ in range(n_steps):
            st, m = steps[name](st, batches[name])
        jax.block_until_ready(m)
        states[name] = st
        return (time.perf_counter() - t0) / n_steps

    a, b = names
    for name in names:
        block(name)
    ratios = []
    for r in range(rounds):
        t = {n: block(n) for n in (names if r % 2 == 0 else names[::-1])}
        ratios.append(t[b] / t[a])
        print(f"round {r + 1}: {label(a)} {t[a] * 1e3:.1f} ms, {label(b)} {t[b] * 1e3:.1f} ms, ratio {ratios[-1]:.3f}",
              flush=True)
    print(f"{label(b)} / {label(a)} step time: median {statistics.median(ratios):.3f} over {rounds} rounds "
          f"({min(ratios):.3f} .. {max(ratios):.3f})")
    return ratios
