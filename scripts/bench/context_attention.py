"""What each context rank's attention costs on CPU, against the whole row's, forward and backward, one process, the
runs alternating:

  python scripts/bench/context_attention.py [--seq 2048] [--ranks 4] [--heads 12] [--head-dim 64] [--tile 128]
                                            [--rounds 5] [--steps 3] [--unbalanced] [--by-position]

  whole row     the whole-row kernel (models/kernels/fast_cpu.py causal_attention: index causality, each query
                block skipping the key blocks after it; loops over tiles from fast_cpu.LOOPS_FROM tokens on)
  all_gather r  context rank r's attention under train.context_attention=all_gather
                (models/context_parallel/gather.py): its T/C queries (balanced: chunks r and 2C-1-r of 2C) against
                the row's T keys in position order, through the strategy's own forward and backward (custom VJP,
                models/kernels/flash_blocks.py tiles of --tile)
  ring r        rank r's attention under train.context_attention=ring (models/context_parallel/ring.py): its own
                block, then each other rank's block as the ring brings it, forward and backward, through the ring's
                own functions
  by position   (--by-position) the whole row through fast_cpu's kernel by position, every query block against
                every key: what the all-gather ran before flash_blocks.py

Each rank runs alone, on one device: the collectives are stood in for by what the rank would receive (the gathered
row's positions are the real ones, its K/V values repeated; the ring's next block carries the previous rank's
positions, so each step takes the branch it takes in training). What is timed is a rank's compute, not the
collectives. The median over rounds of each one's time per call is printed, and the median over rounds of its time against
that round's whole row (this host's speed drifts within a run); for each strategy the slowest rank against the
fastest, by those ratios.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class _Rank:
    """The collectives (models/spec.py LocalCollectives' methods) as context rank `r` of `C` sees them, on one
    device: an all-gather over `seq` returns the row's positions (`order`, float32) for a positions array and the
    rank's block repeated C times for anything else; a reduce-scatter keeps the first block; a shift returns, for
    a positions block, the previous rank's positions (else the same values)."""

    def __init__(self, r: int, C: int, order):
        import jax.numpy as jnp
        self.r, self.C, self.jnp = r, C, jnp
        self.order = jnp.asarray(order, jnp.float32)
        self.blocks = self.order.reshape(C, -1)

    def axis_size(self, logical):
        return self.C if logical == "seq" else 1

    def axis_index(self, logical):
        return self.r if logical == "seq" else 0

    def all_gather(self, x, logical, axis=0):
        if logical != "seq":
            return x
        if x.ndim == 1:
            return self.order
        return self.jnp.concatenate([x] * self.C, axis)

    def reduce_scatter(self, x, logical, axis=0):
        import jax
        return x if logical != "seq" else jax.lax.slice_in_dim(x, 0, x.shape[axis] // self.C, axis=axis)

    def shift(self, x, logical):
        jnp = self.jnp
        if logical != "seq" or x is None or x.ndim != 1:
            return x
        i = jnp.argmax(self.blocks[:, 0] == x[0])  # whose positions these are: the next holds the previous rank's
        return self.blocks[(i - 1) % self.C]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tile", default="128", help="the strategies' tile, or several (128,256: each timed); the "
                    "trainer's is model.attention_block (on CPU 128 unless set)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--unbalanced", action="store_true", help="contiguous chunks (train.context_load_balance=false)")
    ap.add_argument("--by-position", action="store_true", help="also the whole row by position (the old all-gather)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import trainer.platforms  # noqa: F401  (before jax: with libtpu installed and no chip, no TPU runtime)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from models.context_parallel import gather as G
    from models.context_parallel import ring as R
    from models.kernels import fast_cpu as F
    T, H, E, C = a.seq, a.heads, a.head_dim, a.ranks
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, T, H, E), jnp.float32) for kk in keys)

    def timed(fn, *args):
        grad = jax.jit(jax.grad(lambda *x: jnp.sum(fn(*x) ** 2), argnums=(0, 1, 2)))
        jax.block_until_ready(grad(*args))  # compile
        return lambda: jax.block_until_ready([grad(*args) for _ in range(a.steps)])

    runs = {"whole row": timed(lambda q, k, v: F.causal_attention(q, k, v, 128), q, k, v)}
    if a.by_position:
        pos = jnp.arange(T, dtype=jnp.float32)
        runs["by position"] = timed(lambda q, k, v: F.causal_attention(q, k, v, 128, positions=(pos, pos)), q, k, v)
    perm = G.order(T, C, not a.unbalanced)
    runs_of = (G._runs(np.argsort(perm)), G._runs(perm))
    tiles = [int(x) for x in a.tile.split(",")]
    named = lambda s, r, tile: f"{s} {r}" + (f" @{tile}" if len(tiles) > 1 else "")  # noqa: E731
    for r in range(C):
        mine = perm[r * T // C:(r + 1) * T // C]
        coll, pos_r = _Rank(r, C, perm), jnp.asarray(mine.astype(np.float32))
        qr, kr, vr = F._group(q[:, mine], H), F._kv(k[:, mine]), F._kv(v[:, mine])
        for tile in tiles:
            opts = (E ** -0.5, None, tile)
            runs[named("all_gather", r, tile)] = timed(lambda q, k, v, coll=coll, pos=pos_r, opts=opts: G._gathered(
                coll, opts, runs_of, q, k, v, pos, None, None), qr, kr, vr)
            runs[named("ring", r, tile)] = timed(lambda q, k, v, coll=coll, pos=pos_r, opts=opts: R._ring(
                coll, opts + (not a.unbalanced,), q, k, v, pos, None, None), qr, kr, vr)
    took = {name: [] for name in runs}
    for _ in range(a.rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            took[name].append((time.perf_counter() - t0) / a.steps)
    # each round's ratios to that round's whole row (this host's speed drifts within a run), then their medians
    med = {name: statistics.median(ts) for name, ts in took.items()}
    ratio = {name: statistics.median(t / w for t, w in zip(ts, took["whole row"])) for name, ts in took.items()}
    print(f"causal attention forward + backward, T={T}, C={C} {'unbalanced' if a.unbalanced else 'balanced'}, "
          f"{H} heads of {E}, tiles of {a.tile}, float32, median of {a.rounds} rounds (ratio: the median of each "
          f"round's ratio to its whole row):")
    for name, t in med.items():
        print(f"  {name:<18} {1e3 * t:8.1f} ms  {ratio[name]:6.3f}x")
    for s in ("all_gather", "ring"):
        for tile in tiles:
            rs = [ratio[named(s, r, tile)] for r in range(C)]
            print(f"  {s}, tiles of {tile}: slowest rank {max(rs):.3f}x the whole row, slowest / fastest "
                  f"{max(rs) / min(rs):.2f}")


if __name__ == "__main__":
    main()
