"""Time per lm-eval request: `meshtrain eval` (this venv, one CPU device) against lm-eval's own Hugging Face backend
(HFLM, transformers + torch, float32, batch size 1 and 8) on the same tiny Llama folder and the three shipped tasks,
alternated R times in one run; each side's median seconds per request after a warm-up pass (compiles excluded).

    .venv/bin/python scripts/bench/eval_requests.py --hf-python /tmp/hfvenv/bin/python [--repeats 3]
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
FIX = ROOT / "tests" / "fixtures" / "eval" / "llama"  # generations end at their until string
TASKS = ["meshtrain_mc", "meshtrain_rolling", "meshtrain_gen"]

HF = """
import json, sys, time
sys.path.insert(0, {root!r})
from scripts.make_eval_fixture import configs
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
lm = HFLM(pretrained={fix!r}, device="cpu", dtype="float32", batch_size={bs})
out = []
for r in range({n}):
    t = time.perf_counter()
    got = simple_evaluate(model=lm, tasks=configs(), bootstrap_iters=0, log_samples=True)
    out.append((time.perf_counter() - t, sum(len(x["arguments"]) for v in got["samples"].values() for x in v)))
print("RESULT", json.dumps(out))
"""


def ours(n: int) -> list:
    """The weights read once (as HFLM reads them once), then lm-eval run n times on them."""
    import jax
    from trainer.ckpt.params import load_params
    from trainer.config import replace
    from trainer.run.harness import Tokenizer, lm_results, make_lm, task_configs, tokenizer_of
    from trainer.state import make_setup
    params, cfg = load_params(str(FIX))
    s = make_setup(replace(cfg, model={"seq_len": 256}, mesh={"data": 1}), jax.devices()[:1])
    lm = make_lm(s.model, jax.device_put(params, s.shardings["params"]), Tokenizer(tokenizer_of(cfg)), 256)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        got = lm_results(lm, task_configs(TASKS), log_samples=True)
        out.append((time.perf_counter() - t, sum(len(x["arguments"]) for v in got["samples"].values() for x in v)))
    return out


def theirs(python: str, n: int, bs: int) -> list:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([python, "-c", HF.format(root=str(ROOT), fix=str(FIX), n=n, bs=bs)], capture_output=True,
                       text=True, env=env, cwd=ROOT)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stderr[-2000:]
    return json.loads(line[0][7:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-python", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    family = next((x.split(":")[1].strip() for x in open("/proc/cpuinfo") if x.startswith("cpu family")), "?")
    mine, hf1, hf8 = [], [], []
    for _ in range(a.repeats):  # alternated: each side's second call in a process is the warm one
        mine += ours(2)[1:]
        hf1 += theirs(a.hf_python, 2, 1)[1:]
        hf8 += theirs(a.hf_python, 2, 8)[1:]

    def per(xs):
        xs = sorted(t / n for t, n in xs)
        return xs[len(xs) // 2]
    m, h1, h8 = per(mine), per(hf1), per(hf8)
    print(f"cpu family {family}; {mine[0][1]} requests of the three shipped tasks, warm, median of {a.repeats}")
    print(f"meshtrain eval {m * 1e3:.1f} ms/request; HFLM batch 1 {h1 * 1e3:.1f} ms, batch 8 {h8 * 1e3:.1f} ms; "
          f"ratio to HFLM batch 1 {m / h1:.2f}x, to batch 8 {m / h8:.2f}x")


if __name__ == "__main__":
    main()
