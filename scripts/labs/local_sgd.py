"""Local SGD / DiLoCo with H local steps vs synchronous training: eval loss after the same tokens.

  python scripts/labs/local_sgd.py [--h 8] [--devices 8] [--replicas R] [--modes every_step,local_sgd,diloco]
                              [key=value ...]

Trains the same config (default: the `small` model, 200 steps of 32 x 128 tokens on the
built-in corpus) once per train.sync mode on `--devices` simulated CPU devices: mesh.data = R
replicas (all devices unless --replicas), each splitting its model over devices / R devices
(mesh.model; DiLoCo's "islands" of devices). It prints each run's held-out loss, its gap to the
synchronous run, and the bytes each device sends on the data axis per step (a ring all-reduce of
the float32 parameters or gradients: 2(R-1)/R x a device's share, every H steps instead of every
step).

Each run is a `meshtrain train` process that checkpoints every 50 steps. Simulated devices are
threads, and on an overloaded host XLA:CPU has hung in a collective (some of the 8 threads in
the rendezvous, the others never arriving). The trainer's step watchdog (train.step_timeout_s),
or XLA's own collective timeout (180 s here, against its default of 40 s), ends such a
run with a non-zero exit, and the run is restarted: it resumes from its newest checkpoint, and
since the batch of a step is a pure function of (seed, step) the result is the uninterrupted
run's. Restarts are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run(mode: str, a, env) -> tuple[float, int, float]:
    """(eval loss, restarts, seconds) of one training run."""
    run_dir = Path(a.out) / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    over = [f"mesh.data={a.replicas}", f"mesh.model={a.devices // a.replicas}", "run.progress=false",
            "run.log_every=10", f"run.dir={run_dir}",
            "checkpoint.every=50", f"train.sync={mode}", f"train.sync_every={1 if mode == 'every_step' else a.h}"]
    t0 = time.perf_counter()
    for attempt in range(a.retries + 1):
        # a hung step ends the process (the trainer's step watchdog, exit 4): restart it
        cmd = [sys.executable, "-m", "trainer.cli", "train", *a.args, *over]
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0:
            break
        print(f"{mode}: the run exited abnormally; resuming from its newest checkpoint", file=sys.stderr)
    else:
        sys.exit(f"{mode}: failed {a.retries + 1} times")
    evals = [r["eval_loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "eval_loss" in r]
    return evals[-1], attempt, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("args", nargs="*", help="configs and key=value overrides for every run")
    ap.add_argument("--h", type=int, default=8, help="train.sync_every for the local modes")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (= mesh.data x mesh.model)")
    ap.add_argument("--replicas", type=int, help="mesh.data (default: --devices); mesh.model = devices / replicas")
    ap.add_argument("--modes", default="every_step,local_sgd,diloco")
    ap.add_argument("--retries", type=int, default=5)
    ap.add_argument("--out", default="runs/local_sgd", help="parent of the runs' run.dir")
    a = ap.parse_args()
    a.replicas = a.replicas or a.devices
    if a.replicas < 1 or a.devices % a.replicas:
        sys.exit(f"--replicas {a.replicas} must divide --devices {a.devices}")
    from models import param_count
    from trainer import load_config
    from trainer.config import model_config
    from trainer.parallel.localsgd import data_bytes_per_step

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
        " --xla_cpu_collective_call_terminate_timeout_seconds=180").strip())
    cfg = load_config(a.args)
    # Evaluate once, after the last step (the figure compared).
    a.args = a.args + [f"train.eval_every={cfg.train.steps}"]
    param_bytes = 4 * param_count(model_config(cfg)) / (a.devices // a.replicas)  # one device's share
    sent_by = lambda mode: data_bytes_per_step(  # noqa: E731 - bytes per device per step of a mode
        load_config(a.args + [f"train.sync={mode}", f"train.sync_every={a.h}"]), param_bytes, a.replicas)
    every = sent_by("every_step")
    results = {}
    for mode in a.modes.split(","):
        loss, restarts, wall = run(mode, a, env)
        results[mode] = (loss, sent_by(mode), restarts, wall)
    base = results.get("every_step")
    steps, warm = cfg.train.steps, min(cfg.train.sync_warmup, cfg.train.steps)
    tokens = steps * cfg.train.batch_size * model_config(cfg).seq_len
    print(f"\n{tokens:,} tokens per run on {a.replicas} replicas of {a.devices // a.replicas} device(s); H={a.h}"
          + (f"; the local modes average every step up to step {warm} (train.sync_warmup)" if warm else ""))
    for mode, (loss, sent, restarts, wall) in results.items():
        gap = f"{100 * (loss / base[0] - 1):+.2f}% vs synchronous" if base else ""
        fewer = f" ({base[1] / sent:.0f}x less)" if base and sent else ""
        # whole run: the warm-up steps send a parameter all-reduce each (the synchronous step's bytes)
        total = sent * steps if mode == "every_step" else every * warm + sent * (steps - warm)
        whole = f" | whole run {total / 1e9:.2f} GB" + (f" ({every * steps / total:.1f}x less)"
                                                        if mode != "every_step" else "")
        print(f"{mode:10s} eval loss {loss:.4f} {gap} | data-axis bytes/device/step {sent / 1e6:.2f} MB{fewer}"
              + (" after the warm-up" if warm and mode != "every_step" else "") + f"{whole} "
              f"| {wall:.0f}s, {restarts} restart(s)")


if __name__ == "__main__":
    main()
