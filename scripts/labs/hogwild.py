"""Hogwild! lab: lock-free asynchronous SGD vs a locked version vs synchronous minibatch SGD.

  python scripts/labs/hogwild.py [--workers 2] [--epochs 6] [--n 120000] [--d 200000] [--nnz 10]
                            [--out runs/hogwild.png]

The problem: L2-regularised logistic regression on generated sparse data (n samples, d
features, `nnz` nonzeros per sample), objective
  f(w) = 1/n sum_i [ log(1 + exp(-y_i x_i.w)) + lam/2 sum_{j in supp(x_i)} w_j^2 ],
where the regulariser is split over the samples that touch each coordinate, so every
per-sample gradient touches only the `nnz` weights of its sample (Niu et al. 2011, eq. 2.1).

Every method runs its workers as processes (not threads: one Python thread at a time
holds the GIL, so threads would measure the lock, not the method) over one weight vector
in shared memory, with the same step size schedule and data order:
  hogwild   each worker reads w[idx], computes its gradient and writes w[idx] back with no lock;
            concurrent writes to the same coordinate may overwrite each other.
  locked    the same loop with one lock held around each read-compute-write.
  sync      synchronous minibatch SGD: each worker computes the gradient of its half of a
            minibatch at the same w, a barrier, one worker applies the summed gradient, a
            barrier (the all-reduce of data-parallel training, in miniature). Its per-sample
            work is vectorised over the minibatch, so its wall time also shows numpy's
            per-call overhead amortised; compare it on objective per epoch too.
  serial    one worker, no lock (the reference objective and the speed-up's baseline).
  private   the hogwild loop on a private copy per worker: the speed-up the machine allows right
            now (other jobs share the cores), which bounds every parallel method.
The script prints wall time and objective per method and plots objective vs wall time.

Where the result holds. Hogwild's guarantee (Niu et al. 2011, Thm 3.1) needs a sparse and
(strongly) convex problem: when each update touches a few coordinates, two workers rarely
write the same weight, a lost or stale update is a small, bounded perturbation, and
convexity turns "a bit stale" into "a bit slower", so it converges at nearly the serial rate
per update with nearly linear speed-up. Make the data dense (--nnz close to --d) and every
update collides with every other; the bound degrades with the conflict rate.

Why transformers use synchronous all-reduce instead. Their gradients are dense: every
step touches every weight (embeddings aside), so lock-free writes would collide on all
of them, and the loss is non-convex, where stale, overwritten updates have no such bound
(Adam's moments make it worse: they must see a consistent gradient). Accelerators also do
not do fine-grained racy writes to shared memory across devices; they compute a large
batch's gradient in one fused program and a ring/tree all-reduce moves it at full link
bandwidth, which costs 2(K-1)/K x the gradient size per device regardless of K. What large
runs relax instead is how often they synchronise (local SGD / DiLoCo: train.sync).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np


def make_problem(n: int, d: int, nnz: int, seed: int = 0):
    """Sparse rows (idx, val) with `nnz` entries each, labels from a sparse true model plus noise."""
    rng = np.random.default_rng(seed)
    # Zipf-like feature popularity, as in text data: a few coordinates are hot, most are rare.
    p = 1.0 / np.arange(1, d + 1) ** 0.6
    idx = rng.choice(d, size=(n, nnz), p=p / p.sum())
    val = rng.standard_normal((n, nnz)) / np.sqrt(nnz)
    w_true = rng.standard_normal(d)
    margin = (val * w_true[idx]).sum(1) + 0.3 * rng.standard_normal(n)
    y = np.where(margin > 0, 1.0, -1.0)
    return idx, val, y


def objective(w, idx, val, y, lam):
    m = y * (val * w[idx]).sum(1)
    return float(np.mean(np.logaddexp(0.0, -m) + 0.5 * lam * (w[idx] ** 2).sum(1)))


def _worker(rank, nw, method, buf, lock, barrier, log, prob, sync_bufs, args):
    idx, val, y = prob
    w = np.frombuffer(buf, dtype=np.float64)
    if method == "private":  # the parallel ceiling: same work, nothing shared
        w = np.zeros_like(w)
    order = np.random.default_rng(args.seed).permutation(len(y))
    spent = 0.0
    for epoch in range(args.epochs):
        lr = args.lr * args.decay ** epoch
        t0 = time.perf_counter()
        if method == "sync":
            _sync_epoch(rank, nw, w, prob, args.lam, lr, order, args.batch, barrier, sync_bufs)
        else:
            _async_epoch(w, prob, args.lam, lr, order[rank::nw], lock)
        barrier.wait()
        if rank == 0:  # the objective evaluation is not training time
            spent += time.perf_counter() - t0
            log[2 * epoch], log[2 * epoch + 1] = spent, objective(w, idx, val, y, args.lam)
        barrier.wait()


def _async_epoch(w, prob, lam, lr, rows, lock):
    """Per-sample SGD on shared w: lock-free when lock is None, else one lock per update."""
    idx, val, y = prob
    for i in rows:
        j, v, yi = idx[i], val[i], y[i]
        if lock is not None:
            lock.acquire()
        wj = w[j]
        # d/dw log(1+exp(-y x.w)) = -y x sigmoid(-y x.w); the regulariser touches supp(x) only
        g = -yi / (1.0 + np.exp(yi * (v @ wj)))
        w[j] = wj - lr * (g * v + lam * wj)
        if lock is not None:
            lock.release()


def _sync_epoch(rank, nw, w, prob, lam, lr, order, batch, barrier, sync_bufs):
    """Minibatch SGD: each worker writes its sparse gradient into its slot; one worker applies the sum."""
    idx, val, y = prob
    gbuf, ibuf = (np.frombuffer(b, dtype=t).reshape(nw, -1) for b, t in zip(sync_bufs, (np.float64, np.int64)))
    per = batch // nw
    size = per * idx.shape[1]
    for s in range(0, len(order) - batch + 1, batch):
        rows = order[s + rank * per: s + (rank + 1) * per]
        j, v, yi = idx[rows], val[rows], y[rows]
        wj = w[j]
        g = (-yi / (1.0 + np.exp(yi * (v * wj).sum(1))))[:, None] * v + lam * wj
        gbuf[rank, :size], ibuf[rank, :size] = g.ravel(), j.ravel()
        barrier.wait()
        if rank == 0:  # the "all-reduce": every worker's gradient summed into one update
            # lr x the summed gradient: the linear scaling rule (lr x batch for the mean gradient)
            np.subtract.at(w, ibuf[:, :size].ravel(), lr * gbuf[:, :size].ravel())
        barrier.wait()


def run(method: str, nw: int, prob, args) -> tuple[float, float, np.ndarray]:
    buf = mp.RawArray("d", args.d)  # shared weights, starting at 0; no lock: the methods decide
    lock = mp.Lock() if method == "locked" else None
    barrier = mp.Barrier(nw)
    log = mp.RawArray("d", 2 * args.epochs)
    slot = (args.batch // nw) * prob[0].shape[1]
    sync_bufs = (mp.RawArray("d", nw * slot), mp.RawArray("q", nw * slot)) if method == "sync" else None
    ctx = mp.get_context("fork")  # workers inherit the data and the shared buffers without copying
    procs = [ctx.Process(target=_worker, args=(r, nw, method, buf, lock, barrier, log, prob, sync_bufs, args))
             for r in range(nw)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{method} worker failed with exit code {p.exitcode}")
    curve = np.frombuffer(log).reshape(-1, 2).copy()
    return curve[-1, 0], curve[-1, 1], curve


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--n", type=int, default=120_000, help="samples")
    ap.add_argument("--d", type=int, default=200_000, help="features")
    ap.add_argument("--nnz", type=int, default=10, help="nonzeros per sample")
    ap.add_argument("--lam", type=float, default=1e-4)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--decay", type=float, default=0.8, help="step size factor per epoch")
    ap.add_argument("--batch", type=int, default=64, help="sync: global minibatch size")
    ap.add_argument("--repeats", type=int, default=1, help="rounds; the best wall time of each method is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/hogwild.png")
    args = ap.parse_args()

    prob = make_problem(args.n, args.d, args.nnz, args.seed)
    f0 = objective(np.zeros(args.d), *prob, args.lam)
    print(f"sparse logistic regression: n={args.n} d={args.d} nnz/sample={args.nnz}; "
          f"f(0)={f0:.4f}; {mp.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.workers} workers")
    methods = [("serial", 1), ("hogwild", args.workers), ("locked", args.workers), ("sync", args.workers),
               ("private", args.workers)]
    results = {}
    for _ in range(args.repeats):  # rounds, not back-to-back repeats: load from other jobs hits all methods alike
        for method, nw in methods:
            r = run(method, nw, prob, args)
            if method not in results or r[0] < results[method][0]:
                results[method] = r
    for method, nw in methods[:-1]:
        wall, f, _ = results[method]
        print(f"{method:8s} workers={nw}  wall {wall:6.2f}s  final objective {f:.5f}")
    hw, lk, se = results["hogwild"], results["locked"], results["serial"]
    ceiling = se[0] / results.pop("private")[0]
    print(f"hogwild speed-up: {lk[0] / hw[0]:.2f}x over locked, {se[0] / hw[0]:.2f}x over serial "
          f"(ceiling now: {ceiling:.2f}x, {args.workers} workers on private copies); "
          f"objective gap to serial {hw[1] - se[1]:+.5f} (locked {lk[1] - se[1]:+.5f})")
    plot(results, f0, args)


def plot(results, f0, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (_, _, curve) in results.items():
        ax.plot(np.r_[0, curve[:, 0]], np.r_[f0, curve[:, 1]], marker="o", label=name)
    ax.set_xlabel("wall time (s, objective evaluation excluded)")
    ax.set_ylabel("objective f(w)")
    ax.set_yscale("log")
    ax.set_title(f"sparse logistic regression, {args.workers} workers, {args.epochs} epochs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
