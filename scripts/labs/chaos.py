"""Chaos drill: SIGKILL a training run N times at random moments (about half of them while a
checkpoint is being written), resume it each time, then compare it with an uninterrupted run of
the same config: final train state bitwise, the loss of every step, and metrics.jsonl holding
every step exactly once.

    python scripts/labs/chaos.py --kills 10                       # tiny model, 8 simulated CPU devices
    python scripts/labs/chaos.py --kills 3 train.zero_stage=3     # extra key=value pairs override the config

Exit 0 if the interrupted run equals the uninterrupted one, 1 if not. Children share one persistent
compilation cache, so only the first one compiles.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the comparison reads checkpoints with trainer.ckpt.checkpoint
CONFIG = ["model.preset=tiny", "train.batch_size=16", "train.warmup_steps=2", "train.lr=1e-2",
          "train.eval_every=0", "run.log_every=1", "run.progress=false", "data.source=synthetic",
          "checkpoint.every=2", "checkpoint.keep=2"]


def child_env(devices: int, cache: Path) -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
                PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=str(cache),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def start(run: Path, args: list[str], env: dict) -> subprocess.Popen:
    run.mkdir(parents=True, exist_ok=True)
    log = open(run.parent / f"{run.name}.log", "a")
    return subprocess.Popen([sys.executable, "-m", "trainer.cli", "train", *args, f"run.dir={run}"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def records(run: Path) -> list[dict]:
    out = []
    path = run / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def saving(run: Path) -> bool:
    d = run / "checkpoints"
    return d.is_dir() and any("tmp" in p.name for p in d.iterdir())


def newest_checkpoint(run: Path) -> int:
    d = run / "checkpoints"
    return max((int(p.name) for p in d.iterdir() if p.name.isdigit()), default=0) if d.is_dir() else 0


def wait(cond, p: subprocess.Popen, timeout: float) -> bool:
    """Poll cond until true (True) or the process exits (False)."""
    t0 = time.time()
    while not cond():
        if p.poll() is not None:
            return False
        if time.time() - t0 > timeout:
            raise TimeoutError("the run made no progress: see its log")
        time.sleep(0.002)
    return True


def interrupted_run(run: Path, args: list[str], env: dict, kills: int, rng: random.Random, timeout: float) -> dict:
    """Start, kill -9 `kills` times (even kills: while a save is in flight), resume; then finish."""
    done, during_save, expected = 0, 0, []
    log = run.parent / f"{run.name}.log"
    offsets = []  # where each start's lines begin in the shared log
    while done < kills:
        offsets.append(log.stat().st_size if log.exists() else 0)
        p, base = start(run, args, env), newest_checkpoint(run)
        progress = lambda: newest_checkpoint(run) > base  # noqa: E731 - each start commits one checkpoint at least
        if done % 2 == 0:  # a kill while Orbax writes the next checkpoint
            ok = wait(lambda: progress() and saving(run), p, timeout)
            time.sleep(rng.uniform(0, 0.01))
        else:  # a kill at a random moment: mid-step, mid-log, mid-save (soon: a fast run may
            ok = wait(progress, p, timeout)  # have only a few steps left to interrupt)
            time.sleep(rng.uniform(0, 0.05))
        if not ok or p.poll() is not None:
            break  # it finished first: no steps left to interrupt
        during_save += saving(run)
        p.send_signal(signal.SIGKILL)
        p.wait()
        done += 1
        expected.append(newest_checkpoint(run))  # what the next start must resume from
    offsets.append(log.stat().st_size if log.exists() else 0)
    p = start(run, args, env)
    rc = p.wait(timeout=timeout)
    text = log.read_bytes()
    starts = [text[a:b].decode(errors="replace") for a, b in zip(offsets[1:], offsets[2:] + [len(text)])]
    # each restart's first resume (the final run's rollback resumes again, later in its lines)
    resumed = [m.group(1) for m in (re.search(r"resumed from \S+/checkpoints/(\d+) ", x) for x in starts) if m]
    return {"kills": done, "during_save": during_save, "rc": rc,
            "resumed_newest": [int(x) for x in resumed] == [e for e in expected if e]}


def compare(ref: Path, run: Path, steps: int) -> dict:
    """Bitwise state, loss curve and step coverage of `run` against `ref`."""
    import numpy as np
    import jax
    from trainer.ckpt.store import read_meta
    from trainer.ckpt.params import load_params
    loss = {d: [(r["step"], r["loss"]) for r in records(d) if "loss" in r] for d in (ref, run)}
    once = [s for s, _ in loss[run]] == list(range(1, steps + 1))
    same_curve = loss[run] == loss[ref]
    pa, pb = (jax.tree.map(np.asarray, load_params(d, steps)[0]) for d in (ref, run))
    params_equal = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))
    sums = [{k: v["checksum"] for k, v in read_meta(d, steps)["leaves"].items()} for d in (ref, run)]
    return {"params_bitwise_equal": params_equal, "state_checksums_equal": sums[0] == sums[1],
            "losses_equal": same_curve, "steps_once": once, "steps_logged": len(loss[run])}


def reference(overrides: list[str] = (), workdir: Path | None = None, devices: int = 8, steps: int = 20,
              timeout: float = 600) -> dict:
    """The uninterrupted run the drill compares with: (workdir, its args, its environment, its wall time)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="chaos-"))
    args = CONFIG + [f"train.steps={steps}", *overrides]
    env = child_env(devices, workdir / "jax-cache")
    t0 = time.time()
    p = start(workdir / "ref", args, env)  # the same checkpoints: a rollback goes back to the newest one
    if p.wait(timeout=timeout) != 0:
        raise RuntimeError(f"the uninterrupted run failed: see {workdir / 'ref.log'}")
    return {"workdir": workdir, "args": args, "env": env, "steps": steps, "ref_s": time.time() - t0}


def chaos(kills: int, overrides: list[str] = (), workdir: Path | None = None, seed: int = 0, devices: int = 8,
          steps: int | None = None, timeout: float = 600, ref: dict | None = None) -> dict:
    """Run the drill (after `ref`, a reference() run, or a new one); returns the figures (see compare) plus
    kills, kills during saves and wall times."""
    ref = ref or reference(overrides, workdir, devices, steps or 8 + 4 * kills, timeout)
    workdir, steps = ref["workdir"], ref["steps"]
    t1 = time.time()
    res = interrupted_run(workdir / "chaos", ref["args"], ref["env"], kills, random.Random(seed), timeout)
    t2 = time.time()
    if res["rc"] != 0:
        raise RuntimeError(f"the final resume failed (rc {res['rc']}): see {workdir / 'chaos.log'}")
    res.update(compare(workdir / "ref", workdir / "chaos", steps))
    res.update(steps=steps, ref_s=ref["ref_s"], chaos_s=t2 - t1, workdir=str(workdir),
               ok=res["params_bitwise_equal"] and res["state_checksums_equal"] and res["losses_equal"]
               and res["steps_once"] and res["resumed_newest"])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices per run")
    ap.add_argument("--steps", type=int, help="train.steps (default: 8 + 4 x kills)")
    ap.add_argument("--out", type=Path, help="work folder (default: a new temporary one)")
    ap.add_argument("overrides", nargs="*", help="key=value pairs for both runs")
    a = ap.parse_args(argv)
    r = chaos(a.kills, a.overrides, a.out, a.seed, a.devices, a.steps)
    print(f"chaos: {r['kills']} kills ({r['during_save']} while a checkpoint was being written) over "
          f"{r['steps']} steps | final parameters bitwise equal: {r['params_bitwise_equal']} | every state leaf's "
          f"checksum equal: {r['state_checksums_equal']} | loss curve equal: {r['losses_equal']} | each step "
          f"logged exactly once: {r['steps_once']} | each resume from the newest checkpoint: "
          f"{r['resumed_newest']} | wall: uninterrupted {r['ref_s']:.1f}s, interrupted "
          f"{r['chaos_s']:.1f}s | {r['workdir']}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
