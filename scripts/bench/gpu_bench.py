"""The whole GPU check in one run: the 1B model through `meshtrain train`, matmul rate, HBM
bandwidth, and MFU of the 1B model at several remat/batch settings.

  python scripts/bench/gpu_bench.py [--settings none:8,dots:16,full:32] [--steps 30] [--cli-steps 20]
                                    [--budget 470] [--log FILE] [key=value ...]
  python scripts/bench/gpu_bench.py --smoke      # any machine: tiny model, a few steps (checks the script)

0. Runs `meshtrain train model.preset=1b train.dtype=bfloat16` (seq 2048, global batch 8, synthetic
   data, --cli-steps steps, one device) as a subprocess of the real CLI, before this process starts
   jax (which would take the GPU's memory), and prints tokens/s, model TFLOP/s and MFU against the
   H200's dense bf16 peak (trainer/hardware.py) from its metrics.jsonl (median of the steps after the first 3).
   The run directory is a temporary folder, deleted afterwards (the CLI saves a final checkpoint).
1. Measures the bfloat16 matmul rate (8192^3, best of 10) and the HBM copy bandwidth (a 4 GiB
   array copied: bytes read + written over time), in this process.
2. Trains `model.preset=1b` (seq 2048, bfloat16 compute, float32 master weights and Adam state,
   one device) for --steps steps at each remat:batch setting, through the trainer's own setup,
   init and jitted step (the state donated, the next batch put on the device while a step runs).
   A setting that does not fit prints OOM and the script goes on.
3. Prints, last, one table: tokens/s, model TFLOP/s, MFU against the datasheet peak (trainer/hardware.py
   dense bf16 for H100/H200 SXM), MFU against the measured matmul rate, and which attention
   kernel XLA used (cuDNN fused attention or XLA's own).
--budget (seconds, default 470: the whole check in under 8 minutes) skips the settings of step 2
that would start too late to finish in it. The log (default gpu_bench.log) gets every line printed.
Model FLOPs follow models/config.py (6N + attention, no remat recomputation); remat's recomputed
FLOPs appear only as lower MFU.
XLA flags that help on GPU are set before jax is imported unless XLA_FLAGS is already set.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GPU_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true "
             "--xla_gpu_enable_highest_priority_async_stream=true")
from trainer.hardware import get_device  # noqa: E402  (the datasheet peak lives in the device table)

H200_BF16 = get_device("h200").peak_bf16  # dense bf16 FLOP/s
SETTING_S = 100  # a setting of step 2 that starts with less than this left of --budget is skipped


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("args", nargs="*", help="key=value overrides for every setting")
    ap.add_argument("--settings", default=None,
                    help="comma-separated remat:global_batch pairs (default none:8,dots:16,full:32; smoke: none:4,full:8)")
    ap.add_argument("--steps", type=int, default=30, help="steps per setting (the first 3 are not timed)")
    ap.add_argument("--cli-steps", type=int, default=20, help="steps of the `meshtrain train` run (0: skip it)")
    ap.add_argument("--budget", type=float, default=470, help="seconds for the whole check (default: under 8 minutes)")
    ap.add_argument("--log", default="gpu_bench.log")
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes: checks the script on any machine")
    return ap.parse_args()


class Log:
    def __init__(self, path):
        self.f = open(path, "w")

    def __call__(self, *parts):
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


def copy_bandwidth(jax, jnp, nbytes, reps=10):
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda v: v * 1.0001)  # one read + one write of every byte, no reuse
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def cli_run(log, a):
    """`meshtrain train` of the 1B model (tiny with --smoke) in bfloat16: its own figures, from metrics.jsonl."""
    from models import flops_per_token
    from trainer.config import load_config, model_config
    base = ["model.preset=tiny", "model.seq_len=128", "train.batch_size=4"] if a.smoke else \
        ["model.preset=1b", "model.seq_len=2048", "train.batch_size=8"]
    run_dir = tempfile.mkdtemp(prefix="gpu_bench_cli_")
    args = base + ["train.dtype=bfloat16", "mesh.data=1", "data.source=synthetic", f"train.steps={a.cli_steps}",
                   "run.log_every=1", "train.eval_every=0", "run.progress=false", f"run.dir={run_dir}"] + list(a.args)
    exe = shutil.which("meshtrain")
    cmd = ([exe] if exe else [sys.executable, "-m", "trainer.cli"]) + ["train"] + args
    log("meshtrain train " + " ".join(x for x in args if not x.startswith("run.dir=")))
    t = time.perf_counter()
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60.0, a.budget - 60), env=env, cwd=ROOT)
        wall = time.perf_counter() - t
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if p.returncode == 0 else []
    except subprocess.TimeoutExpired:
        p, wall, lines = None, time.perf_counter() - t, []
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    recs = [r for r in map(json.loads, lines) if "tokens_per_sec" in r]
    if not recs:
        why = "timed out" if p is None else f"exit {p.returncode}: " + " | ".join((p.stderr or p.stdout).strip().splitlines()[-2:])
        log(f"meshtrain train failed ({why})")
        return None
    timed = recs[3:] or recs
    tok_s = statistics.median(r["tokens_per_sec"] for r in timed)
    step_s = statistics.median(r["step_time_s"] for r in timed)
    cfg = load_config(args)
    mc = model_config(cfg)
    flops = flops_per_token(mc) * tok_s
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    row = dict(batch=cfg.train.batch_size, seq=mc.seq_len, tok_s=tok_s, step_ms=step_s * 1e3, tflops=flops / 1e12,
               mfu_h200=flops / H200_BF16,
               mfu_cli=statistics.median(mfu) if mfu else None, loss=recs[-1]["loss"], wall=wall, steps=len(timed))
    log(f"meshtrain train: {row['steps']} timed steps, median {row['step_ms']:.1f} ms | {tok_s:,.0f} tokens/s | "
        f"{row['tflops']:.3g} model TFLOP/s | MFU {row['mfu_h200']:.1%} of the H200's {H200_BF16 / 1e12:.0f} TFLOP/s"
        + (f" (the CLI's own mfu: {row['mfu_cli']:.1%})" if row["mfu_cli"] is not None else "")
        + f" | loss {row['loss']:.3f} | {wall:.0f} s wall, start-up and final checkpoint included")
    return row


def run_setting(log, remat, batch, a):
    import jax
    from models import flops_per_token, hardware_flops_per_token
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step

    base = ["model.preset=tiny", "model.seq_len=128"] if a.smoke else ["model.preset=1b", "model.seq_len=2048"]
    cfg = load_config(base + ["train.dtype=bfloat16", "mesh.data=1", "run.progress=false",
                              f"model.remat={remat}", f"train.batch_size={batch}"] + list(a.args))
    s = make_setup(cfg, jax.devices()[:1])
    seq = s.model.seq_len
    data = Batches(load_corpus("synthetic"), 0, batch, seq, s.model.vocab_size)
    host = [data.global_train(i) for i in range(4)]  # cycled: the input path, not the corpus, is timed
    with jax.set_mesh(s.mesh):
        t0 = time.perf_counter()
        state = init_state(s)
        step = jit_train_step(s)
        sharding = s.batch_sharding()
        compiled = step.lower(state, jax.device_put(host[0], sharding)).compile()
        hlo = compiled.as_text()
        impl = s.model.attention if s.model.attention != "auto" else (
            "manual" if jax.devices()[0].platform == "cpu" else "xla")
        attention = "cudnn" if "cudnn$fmha" in hlo or "__cudnn" in hlo else impl
        compile_s = time.perf_counter() - t0
        nxt = jax.device_put(host[0], sharding)
        times = []
        for i in range(a.steps):
            t = time.perf_counter()
            cur = nxt
            state, m = compiled(state, cur)
            nxt = jax.device_put(host[(i + 1) % len(host)], sharding)  # overlaps the running step
            loss = float(m["loss"]) if i == a.steps - 1 else None
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t)
    dt = statistics.median(times[3:])
    tokens = batch * seq
    mf = flops_per_token(s.model) * tokens / dt
    hf = hardware_flops_per_token(s.model) * tokens / dt
    mem = jax.devices()[0].memory_stats() or {}
    peak_gb = mem.get("peak_bytes_in_use", 0) / 2**30
    log(f"remat={remat:5s} batch={batch:3d} compile {compile_s:5.1f}s step {dt * 1e3:8.1f} ms "
        f"loss {loss:.3f} attention={attention} peak mem {peak_gb:.1f} GiB")
    del state
    return dict(remat=remat, batch=batch, step_ms=dt * 1e3, tok_s=tokens / dt, tflops=mf / 1e12,
                hw_tflops=hf / 1e12, attention=attention)


def main():
    a = parse()
    os.environ.setdefault("XLA_FLAGS", "" if a.smoke else GPU_FLAGS)
    settings = a.settings or ("none:4,full:8" if a.smoke else "none:8,dots:16,full:32")
    if a.smoke:
        a.steps, a.cli_steps = min(a.steps, 8), min(a.cli_steps, 10)
    log = Log(a.log)
    t_start = time.perf_counter()
    cli = cli_run(log, a) if a.cli_steps > 0 else None  # first: once jax starts here it holds the GPU's memory
    import jax
    import jax.numpy as jnp
    from trainer.hardware import from_kind, measure_matmul_rate

    dev = jax.devices()[0]
    log(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, XLA_FLAGS={os.environ['XLA_FLAGS']!r}")
    n, nbytes = (1024, 2**26) if a.smoke else (8192, 2**32)
    rate = measure_matmul_rate(jnp.bfloat16, n, 10)
    bw = copy_bandwidth(jax, jnp, nbytes)
    row = from_kind(dev.device_kind)
    peak = row.peak_bf16 if row else None
    log(f"bf16 matmul {n}^3: {rate / 1e12:.1f} TFLOP/s"
        + (f" ({rate / peak:.0%} of the {peak / 1e12:.0f} TFLOP/s datasheet peak)" if peak else "")
        + f" | HBM copy ({nbytes / 2**30:.2f} GiB): {bw / 1e9:.0f} GB/s")

    rows = []
    for item in settings.split(","):
        remat, batch = item.split(":")
        left = a.budget - (time.perf_counter() - t_start)
        if left < SETTING_S and not a.smoke:
            log(f"remat={remat} batch={batch}: skipped, {left:.0f} s left of --budget {a.budget:.0f}")
            rows.append(dict(remat=remat, batch=int(batch), error="skipped: time budget"))
            continue
        try:
            rows.append(run_setting(log, remat, int(batch), a))
        except Exception as e:  # noqa: BLE001 - an OOM in one setting must not stop the others
            msg = str(e).splitlines()[0][:160]
            log(f"remat={remat} batch={batch}: {'OOM' if 'RESOURCE_EXHAUSTED' in msg or 'memory' in msg.lower() else 'failed'}: {msg}")
            rows.append(dict(remat=remat, batch=int(batch), error=msg))

    log("")
    log(f"{'remat':6s} {'batch':>5s} {'tokens/s':>10s} {'step ms':>9s} {'TFLOP/s':>8s} "
        f"{'MFU(datasheet)':>15s} {'MFU(matmul)':>12s} {'HFU(matmul)':>12s} attention")
    for r in rows:
        if "error" in r:
            log(f"{r['remat']:6s} {r['batch']:5d} {'-- ' + r['error'][:60]}")
            continue
        ds = f"{r['tflops'] * 1e12 / peak:.1%}" if peak else "n/a"
        log(f"{r['remat']:6s} {r['batch']:5d} {r['tok_s']:10,.0f} {r['step_ms']:9.1f} {r['tflops']:8.3g} "
            f"{ds:>15s} {r['tflops'] * 1e12 / rate:12.1%} {r['hw_tflops'] * 1e12 / rate:12.1%} {r['attention']}")
    if cli:
        log(f"meshtrain train (bf16, remat none, batch {cli['batch']} x {cli['seq']}): {cli['tok_s']:,.0f} tokens/s, "
            f"{cli['step_ms']:.1f} ms, {cli['tflops']:.3g} TFLOP/s, MFU {cli['mfu_h200']:.1%} of {H200_BF16 / 1e12:.0f} TFLOP/s (H200 bf16 dense)"
            + (" -- CPU smoke run: not a GPU figure" if a.smoke else ""))
    log(f"whole check: {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
