"""meshtrain against MaxText on the bench config, the two runs alternating in one session.

  python scripts/bench/vs_maxtext.py --maxtext-python /path/to/venv/bin/python [--devices 1|4] [--rounds 3]

MaxText is not a dependency: install it by hand in its own Python 3.12 virtual environment
(`pip install --no-deps maxtext==0.2.5`, then `pip install -r SITE/dependencies/requirements/
generated_requirements/decoupled-requirements.txt`). By default meshtrain runs under that same
Python (this checkout on PYTHONPATH), so both see the same jax and XLA; `--python` picks another.

Both train the bench config (scripts/bench/bench.yaml: 4 layers, d_model 256, 4 heads, d_ff 1024,
vocabulary 256, sequence 256, float32) on synthetic tokens, 4 sequences per device, for `--steps`
steps; with `--devices N > 1` on N simulated CPU devices (XLA_FLAGS), MaxText with
`ici_fsdp_parallelism=N` and meshtrain with `mesh.data=N train.zero_stage=3`. MaxText runs at its
best CPU settings (`remat_policy=minimal_with_context scan_layers=false attention=dot_product`).
Per-step times: MaxText's `completed step: S, seconds: X` lines; meshtrain's `step_time_s` in
metrics.jsonl (`run.log_every=1`: each step is read back, as MaxText's logger does). The first
`--skip` steps of each run (compilation, warm-up) are dropped; each round runs MaxText and meshtrain
once, in alternating order. Prints each round's medians and ratio of step rates (MaxText's
step time / meshtrain's), and the median and lowest of the rounds' ratios: the two runs of a round
see about the same host load, while the load may change between rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench" / "bench.yaml"
MODEL = dict(base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=4, base_mlp_dim=1024,
             base_num_decoder_layers=4, head_dim=64, vocab_size=256, max_target_length=256)
STEP_RE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def run_maxtext(py: str, devices: int, steps: int, out: Path) -> list:
    site = subprocess.run([py, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    args = [py, "-m", "maxtext.trainers.pre_train.train", f"{site}/configs/base.yml", f"run_name=r{os.getpid()}",
            f"base_output_directory={out}", "hardware=cpu", "skip_jax_distributed_system=true",
            "dataset_type=synthetic", f"steps={steps}", "enable_checkpointing=false",
            *(f"{k}={v}" for k, v in MODEL.items()), "attention=dot_product", "dtype=float32",
            "remat_policy=minimal_with_context", "scan_layers=false", "per_device_batch_size=4",
            f"ici_fsdp_parallelism={devices}"]
    p = subprocess.run(args, capture_output=True, text=True, env=_env(devices), cwd=out)
    times = {int(s): float(x) for s, x in STEP_RE.findall(p.stdout + p.stderr)}
    if p.returncode or not times:
        sys.exit(f"MaxText failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return [times[k] for k in sorted(times)]


def run_meshtrain(py: str, devices: int, steps: int, out: Path) -> list:
    args = [py, "-m", "trainer.cli", "train", str(BENCH), f"train.steps={steps}", "run.log_every=1",
            f"run.dir={out / 'meshtrain'}", "data.source=synthetic", "train.eval_every=0", "run.progress=false",
            f"train.batch_size={4 * devices}", f"mesh.data={devices}", f"train.zero_stage={3 if devices > 1 else 0}"]
    env = _env(devices)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=out)
    if p.returncode:
        sys.exit(f"meshtrain failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    recs = [json.loads(line) for line in open(out / "meshtrain" / "metrics.jsonl")]
    return [r["step_time_s"] for r in sorted(recs, key=lambda r: r["step"]) if "step_time_s" in r]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--maxtext-python", required=True, help="python of a virtual environment with maxtext")
    ap.add_argument("--python", help="python that runs meshtrain (default: the MaxText one)")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=10, help="warm-up steps dropped from each run")
    a = ap.parse_args()
    py = a.python or a.maxtext_python
    versions = {n: subprocess.run([p, "-c", "import jax; print(jax.__version__)"], capture_output=True,
                                  text=True).stdout.strip() for n, p in (("maxtext", a.maxtext_python), ("meshtrain", py))}
    print(f"devices {a.devices}, global batch {4 * a.devices}, {a.steps} steps per run, first {a.skip} dropped; "
          f"jax {versions['maxtext']} (MaxText), {versions['meshtrain']} (meshtrain)")
    allt, ratios = {"maxtext": [], "meshtrain": []}, []
    runners = {"maxtext": lambda d: run_maxtext(a.maxtext_python, a.devices, a.steps, d),
               "meshtrain": lambda d: run_meshtrain(py, a.devices, a.steps, d)}
    for r in range(a.rounds):
        order = ("maxtext", "meshtrain") if r % 2 == 0 else ("meshtrain", "maxtext")
        med = {}
        for name in order:
            with tempfile.TemporaryDirectory() as d:
                t = runners[name](Path(d))[a.skip:]
            allt[name] += t
            med[name] = statistics.median(t)
        ratios.append(med["maxtext"] / med["meshtrain"])
        print(f"round {r + 1}: MaxText {med['maxtext']:.4f} s, meshtrain {med['meshtrain']:.4f} s per step, "
              f"ratio {med['maxtext'] / med['meshtrain']:.2f}", flush=True)
    mt, ms = statistics.median(allt["maxtext"]), statistics.median(allt["meshtrain"])
    print(f"all steps: MaxText {mt:.4f} s, meshtrain {ms:.4f} s per step (medians of {len(allt['maxtext'])} and "
          f"{len(allt['meshtrain'])} steps)")
    print(f"meshtrain's step rate is {statistics.median(ratios):.2f}x MaxText's (median of the {len(ratios)} rounds' "
          f"ratios, each from two runs back to back; lowest {min(ratios):.2f})")


if __name__ == "__main__":
    main()
