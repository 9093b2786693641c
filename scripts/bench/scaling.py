"""The scaling table of docs/performance.md, from one script.

  python scripts/bench/scaling.py [--part a,b,c,d] [--quick] [--print] [--doc docs/performance.md]

a  step time, tokens/s and model FLOP/s over the float32 matmul rate measured in the same process
   (scripts/bench/bench.py's helpers) for presets tiny, small and 125m at 1 device and at 8
   simulated devices (data parallel, ZeRO-3, the same global batch).
b  compile time and step time of scanned vs unrolled layers (`model.scan_layers`) at 4, 8, 16
   and 32 layers of the tiny preset's width.
c  peak compiled memory (XLA's memory_analysis: temp + arguments) of the 125m step at vocabulary
   32k and 128k, whole logits (`model.loss_chunk=0`) and tiled (the default rule); compile only.
d  the planner's (roofline, no overlap) and the simulator's (kernels at sim.efficiency, stragglers)
   step time and MFU of presets 1b and 7b on 8 H100s and on a v5p-256, for the fastest layout
   `meshtrain plan --search` finds; no device needed.

Every measured configuration runs in its own subprocess (the device count is fixed when jax starts,
through XLA_FLAGS). The result is written between `<!-- scaling:X:begin -->` and
`<!-- scaling:X:end -->` (X = the part) in --doc, or printed with --print. --quick: fewer and
smaller configurations (a check of the script, not figures to quote).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

PARTS = "abcd"
GIB = 2 ** 30
SYNTHETIC = ["data.source=synthetic", "run.progress=false", "train.dtype=float32"]
# part a: per preset, a global batch (and for 125m a shorter sequence) that keeps a step under ~10 s here
A_SHAPES = {"tiny": ["train.batch_size=32"], "small": ["train.batch_size=16"],
            "125m": ["train.batch_size=8", "model.seq_len=256"]}
B_LAYERS = (4, 8, 16, 32)
C_SHAPE = ["model.preset=125m", "model.seq_len=1024", "train.batch_size=8", "mesh.data=1", "mesh.stage=1",
           "mesh.model=1", "run.progress=false", "train.dtype=float32"]
# part d: (preset, device row, devices, global batch): 2 sequences per device, as torchtitan's 8-GPU runs
D_CASES = [("1b", "h100-80g", 8, 16), ("7b", "h100-80g", 8, 16), ("1b", "tpu-v5p", 256, 512),
           ("7b", "tpu-v5p", 256, 512)]


# ---------------------------------------------------------------- workers (one process each)

def _setup(overrides, n_devices):
    import jax
    from trainer.config import load_config
    from trainer.state import make_setup
    return make_setup(load_config(list(overrides)), jax.devices()[:n_devices])


def _batch(s):
    import jax
    from trainer.data.batches import Batches, load_corpus
    b = Batches(load_corpus("synthetic"), 0, s.cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
    return jax.device_put(b.global_train(0), s.batch_sharding())


def work_a(job):
    """One preset on `devices` devices: step time, tokens/s, ratio to the float32 matmul rate."""
    import jax
    from bench import matmul_rates, time_steps
    from models import flops_per_token
    from trainer.state import init_state
    from trainer.step import jit_train_step
    n = job["devices"]
    layout = ["mesh.data=1"] if n == 1 else [f"mesh.data={n}", "train.zero_stage=3"]
    s = _setup(SYNTHETIC + [f"model.preset={job['preset']}"] + A_SHAPES[job["preset"]] + layout + job["extra"], n)
    rate = matmul_rates()["float32"]
    with jax.set_mesh(s.mesh):
        t = time.perf_counter()
        state = init_state(s)
        step = jit_train_step(s).lower(state, _batch(s)).compile()
        compile_s = time.perf_counter() - t
        dt, _ = time_steps(step, state, _batch(s), job["steps"])
    rate = max(rate, matmul_rates()["float32"])  # best of before/after, as bench.py
    tokens = s.cfg.train.batch_size * s.model.seq_len
    return dict(step_s=dt, tok_s=tokens / dt, ratio=flops_per_token(s.model) * tokens / dt / rate, rate=rate,
                compile_s=compile_s, batch=s.cfg.train.batch_size, seq=s.model.seq_len)


def work_b(job):
    """Compile time and step time of one depth, scanned and unrolled."""
    import jax
    from bench import time_steps
    from trainer.state import init_state
    from trainer.step import jit_train_step
    out = {}
    for scan in (True, False):
        s = _setup(SYNTHETIC + ["model.preset=tiny", f"model.n_layers={job['layers']}", "train.batch_size=8",
                                "mesh.data=1", f"model.scan_layers={str(scan).lower()}"] + job["extra"], 1)
        with jax.set_mesh(s.mesh):
            state, batch = init_state(s), _batch(s)
            t = time.perf_counter()
            step = jit_train_step(s).lower(state, batch).compile()
            compile_s = time.perf_counter() - t
            dt, _ = time_steps(step, state, batch, job["steps"])
        out["scan" if scan else "unrolled"] = dict(compile_s=compile_s, step_s=dt)
    return out


def work_c(job):
    """temp and argument bytes of the compiled 125m step at one vocabulary, whole and tiled logits."""
    from loss_memory import memory_analysis
    from trainer.plan.verify import fast_compile
    out = {}
    for name, extra in (("whole", ["model.loss_chunk=0"]), ("tiled", [])):
        t = time.perf_counter()
        # fast_compile(): about 3x faster; XLA:CPU's scratch differs by < 0.1% (trainer/plan/verify.py)
        m = memory_analysis(C_SHAPE + [f"model.vocab_size={job['vocab']}"] + extra + job["extra"],
                            compiler_options=fast_compile())
        out[name] = dict(temp=m.temp_size_in_bytes, args=m.argument_size_in_bytes,
                         compile_s=time.perf_counter() - t)
    return out


def work_d(job):
    """Planner and simulator for the D_CASES, fastest searched layout each."""
    from trainer.config import load_config, model_config
    from trainer.hardware import get_device
    from trainer.plan.search import search
    from trainer.plan.simulate import simulate
    rows = []
    for preset, hw, n, batch in job["cases"]:
        base = [f"model.preset={preset}", f"train.batch_size={batch}", "train.dtype=bfloat16"] + job["extra"]
        cfg = load_config(base)
        device = get_device(hw)
        hosts = -(-n // device.node)
        ranked = search(model_config(cfg), cfg.train, n, device, hosts, "bfloat16")
        best = ranked.plans[0]
        st = best.strategy
        layout = [f"mesh.data={st.data}", f"mesh.stage={st.stage}", f"mesh.model={st.model}",
                  f"train.zero_stage={st.zero}", f"train.microbatches={st.microbatches}", f"model.remat={st.remat}",
                  f"train.pipeline_repeats={st.repeats}", f"sim.hardware={hw}", f"sim.max_devices={n}"]
        sim_rows = simulate(load_config(base + layout), out=lambda *_: None)
        own = next(r for r in sim_rows if r["own"])
        tokens = batch * best.model.seq_len
        rows.append(dict(preset=preset, hardware=hw, devices=n, hosts=hosts, batch=batch, seq=best.model.seq_len,
                         layout=st.describe(), plan_step_s=best.step_s, plan_mfu=best.mfu,
                         plan_tok_s_dev=tokens / best.step_s / n, sim_step_s=own["step_s"]["sync"],
                         sim_mfu=own["mfu"]["sync"], sim_tok_s_dev=tokens / own["step_s"]["sync"] / n,
                         fit=len(ranked.plans), tried=ranked.tried))
    return rows


WORKERS = {"a": work_a, "b": work_b, "c": work_c, "d": work_d}


def worker(part, job):
    import jax
    print("RESULT " + json.dumps({"job": job, "out": WORKERS[part](job), "jax": jax.__version__}), flush=True)


# ---------------------------------------------------------------- driver

def jobs(part, quick, extra):
    steps = 3 if quick else 5
    if part == "a":
        presets = ("tiny", "small") if quick else ("tiny", "small", "125m")
        return [dict(preset=p, devices=d, steps=steps, extra=extra) for p in presets for d in (1, 8)]
    if part == "b":
        # steps of the tiny width take milliseconds: more of them for a steadier median
        return [dict(layers=n, steps=4 * steps, extra=extra) for n in (B_LAYERS[:2] if quick else B_LAYERS)]
    if part == "c":
        return [dict(vocab=v, extra=extra + (["model.n_layers=2", "model.seq_len=256"] if quick else []))
                for v in (32000, 131072)]
    return [dict(cases=D_CASES[:1] if quick else D_CASES, extra=extra)]


def run_job(part, job, log):
    n = job.get("devices", 1)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
                        + f" --xla_force_host_platform_device_count={n}").strip()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compile times are of cold compiles
    t = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--worker", part, json.dumps(job)], env=env,
                       capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"scaling part {part} job {job} failed (exit {p.returncode}): " + " | ".join(tail))
    log(f"part {part} {json.dumps({k: v for k, v in job.items() if k not in ('extra', 'cases')})}: "
        f"{time.perf_counter() - t:.0f} s")
    return json.loads(line[len("RESULT "):])


def _ms(s):
    return f"{s * 1e3:,.1f}"


def render_a(res):
    # a process that shares the host with other work measures a low rate (and a high ratio): the
    # best rate of the run, the machine's peak, is the steadier denominator
    best = max(r["out"]["rate"] for r in res)
    rows = ["| preset | devices | global batch x seq | step ms | tokens/s | f32 matmul rate, this process (GFLOP/s) | "
            "model FLOP/s / that rate | model FLOP/s / best rate of the run | compile s |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in res:
        j, o = r["job"], r["out"]
        layout = "1" if j["devices"] == 1 else f"{j['devices']} (data, ZeRO-3)"
        rows.append(f"| {j['preset']} | {layout} | {o['batch']} x {o['seq']} | {_ms(o['step_s'])} | "
                    f"{o['tok_s']:,.0f} | {o['rate'] / 1e9:.0f} | {o['ratio']:.3f} | {o['ratio'] * o['rate'] / best:.3f} | "
                    f"{o['compile_s']:.1f} |")
    rows.append(f"\nMeasured float32 matmul peak (the best rate of the run, 1024^3 and 2048^3, any of its "
                f"processes): **{best / 1e9:.0f} GFLOP/s**.")
    return "\n".join(rows)


def render_b(res):
    rows = ["| layers | scanned: compile s | unrolled: compile s | scanned: step ms | unrolled: step ms | "
            "unrolled / scanned step |", "|---:|---:|---:|---:|---:|---:|"]
    for r in res:
        s, u = r["out"]["scan"], r["out"]["unrolled"]
        rows.append(f"| {r['job']['layers']} | {s['compile_s']:.1f} | {u['compile_s']:.1f} | {_ms(s['step_s'])} | "
                    f"{_ms(u['step_s'])} | {u['step_s'] / s['step_s']:.2f} |")
    return "\n".join(rows)


def render_c(res):
    rows = ["| vocabulary | logits | temp GiB | arguments GiB | temp + arguments GiB | temp vs whole |",
            "|---:|---|---:|---:|---:|---:|"]
    for r in res:
        whole = r["out"]["whole"]["temp"]
        for name in ("whole", "tiled"):
            m = r["out"][name]
            label = "whole (`loss_chunk=0`)" if name == "whole" else "tiled (default rule)"
            rows.append(f"| {r['job']['vocab']:,} | {label} | {m['temp'] / GIB:.2f} | {m['args'] / GIB:.2f} | "
                        f"{(m['temp'] + m['args']) / GIB:.2f} | {m['temp'] / whole - 1:+.0%} |")
    return "\n".join(rows)


def render_d(res):
    rows = ["| model | hardware | global batch x seq | fastest layout (`plan --search`) | planner step s | planner MFU | "
            "simulator step s | simulator MFU | simulator tokens/s/device |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in res[0]["out"]:
        hw = f"{r['devices']} x {r['hardware']}" + (f" ({r['hosts']} nodes)" if r["hosts"] > 1 else "")
        rows.append(f"| {r['preset']} | {hw} | {r['batch']} x {r['seq']} | {r['layout']} | {r['plan_step_s']:.3f} | "
                    f"{r['plan_mfu']:.1%} | {r['sim_step_s']:.3f} | {r['sim_mfu']:.1%} | {r['sim_tok_s_dev']:,.0f} |")
    return "\n".join(rows)


RENDER = {"a": render_a, "b": render_b, "c": render_c, "d": render_d}
TITLE = {"a": "a. Presets at 1 and 8 simulated devices", "b": "b. Scanned vs unrolled layers (tiny width, batch 8 x 32)",
         "c": "c. Peak compiled memory of the 125m step (batch 8 x 1024, float32, 1 device)",
         "d": "d. Predicted step time and MFU (bfloat16)"}


def block(part, res, cmd, quick):
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = f"**{TITLE[part]}**" + (" (--quick: smaller configurations, not figures to quote)" if quick else "")
    meta = f"`{cmd}`, {stamp}, jax {res[0]['jax']}, {platform.machine()} ({os.cpu_count()} CPUs)"
    return f"{head}\n\n{RENDER[part](res)}\n\n{meta}"


def write(doc: Path, part: str, text: str):
    """Replace part's block between its markers; append the markers (inside the outer ones) if absent."""
    src = doc.read_text()
    begin, end = f"<!-- scaling:{part}:begin -->", f"<!-- scaling:{part}:end -->"
    new = f"{begin}\n{text}\n{end}"
    if begin in src and end in src:
        src = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: new, src, flags=re.S)
    elif "<!-- scaling:end -->" in src:
        src = src.replace("<!-- scaling:end -->", f"{new}\n\n<!-- scaling:end -->")
    else:
        src = src.rstrip("\n") + f"\n\n<!-- scaling:begin -->\n{new}\n\n<!-- scaling:end -->\n"
    doc.write_text(src)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("args", nargs="*", help="key=value overrides for every configuration of the chosen parts")
    ap.add_argument("--part", default=",".join(PARTS), help="comma-separated parts to run (a,b,c,d)")
    ap.add_argument("--quick", action="store_true", help="fewer, smaller configurations: checks the script")
    ap.add_argument("--print", action="store_true", help="print the markdown instead of writing --doc")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "performance.md"))
    ap.add_argument("--worker", nargs=2, metavar=("PART", "JOB"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker[0], json.loads(a.worker[1]))
    parts = [p.strip() for p in a.part.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part {bad[0]!r}; choose from a, b, c, d")
    cmd = " ".join(["python scripts/bench/scaling.py", f"--part {','.join(parts)}"] + (["--quick"] if a.quick else [])
                   + a.args)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress, not the table
    t0 = time.perf_counter()
    for part in parts:
        res = [run_job(part, j, log) for j in jobs(part, a.quick, list(a.args))]
        text = block(part, res, cmd, a.quick)
        if a.print:
            print(text + "\n")
        else:
            write(Path(a.doc), part, text)
            log(f"part {part} written to {a.doc}")
    log(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
