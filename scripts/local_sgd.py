"""Local SGD / DiLoCo with H local steps vs synchronous training: eval loss after the same tokens.

  python scripts/local_sgd.py [--h 8] [--devices 8] [--modes every_step,local_sgd,diloco] [key=value ...]

Trains the same config (default: the `small` model, 200 steps of 32 x 128 tokens on the
built-in corpus) once per train.sync mode on `--devices` simulated CPU devices (mesh.data = all),
and prints each run's held-out loss, its gap to the synchronous run, and the bytes each device
sends on the data axis per step (a ring all-reduce of the float32 parameters or gradients:
2(K-1)/K x their size, every H steps instead of every step).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("args", nargs="*", help="configs and key=value overrides for every run")
    ap.add_argument("--h", type=int, default=8, help="train.sync_every for the local modes")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (= mesh.data)")
    ap.add_argument("--modes", default="every_step,local_sgd,diloco")
    ap.add_argument("--out", default="runs/local_sgd", help="parent of the runs' run.dir")
    a = ap.parse_args()
    # Simulated devices are threads; on a busy host one can reach a collective long after the
    # others, past XLA:CPU's default 40 s rendezvous timeout, which aborts the process.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
                               " --xla_cpu_collective_call_terminate_timeout_seconds=1200").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    # One program at a time: with asynchronous dispatch an eval program and a train step can be in
    # flight together, and on an overloaded host their collectives have deadlocked XLA:CPU's threads.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    from models import param_count
    from trainer import load_config, train
    from trainer.config import model_config
    from trainer.localsgd import data_bytes_per_step

    results = {}
    for mode in a.modes.split(","):
        over = [f"mesh.data={a.devices}", "run.progress=false", "run.log_every=50", f"run.dir={a.out}/{mode}",
                f"train.sync={mode}", f"train.sync_every={1 if mode == 'every_step' else a.h}"]
        cfg = load_config(a.args + over)
        t0 = time.perf_counter()
        r = train(cfg)
        k = jax.device_count()
        sent = data_bytes_per_step(cfg, 4 * param_count(model_config(cfg)), k)
        results[mode] = (r.eval_loss, sent, time.perf_counter() - t0)
    base, base_sent, _ = results.get("every_step", (None, None, None))
    tokens = cfg.train.steps * cfg.train.batch_size * model_config(cfg).seq_len
    print(f"\n{tokens:,} tokens per run on {a.devices} replicas; H={a.h}")
    for mode, (loss, sent, wall) in results.items():
        gap = f"{100 * (loss / base - 1):+.2f}% vs synchronous" if base else ""
        fewer = f", {base_sent / sent:.0f}x less" if base_sent and sent else ""
        print(f"{mode:10s} eval loss {loss:.4f} {gap} | data-axis bytes/device/step {sent / 1e6:.2f} MB{fewer} "
              f"| {wall:.0f}s")


if __name__ == "__main__":
    main()
