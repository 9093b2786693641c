"""GRPO's sampling speed against its learning step's, on this machine (ratios only: absolute times hold on an
accelerator): tokens per second of drawing N completions of L tokens together with the KV cache
(models/sampler.py), and of one train step on the rows they make (prompt + completion), alternated R times.
    .venv/bin/python scripts/bench/grpo_sampling.py [N L R] (from the repo root; model.preset=small, one CPU device)"""
import sys
import time

import jax  # noqa: E402  (XLA's default optimisation: not the tests' -O0)
import numpy as np  # noqa: E402

from models.sampler import sample_completions  # noqa: E402
from trainer import load_config  # noqa: E402
from trainer.ckpt.initial import initial_state  # noqa: E402
from trainer.rl.rollout import Settings, generation  # noqa: E402
from trainer.state import make_setup  # noqa: E402
from trainer.step import jit_train_step  # noqa: E402

N, L, R = (int(a) for a in (sys.argv[1:4] if len(sys.argv) > 3 else (64, 64, 3)))
cfg = load_config(["model.preset=small", "mesh.data=1", f"train.batch_size={N}", "train.objective=grpo",
                   "grpo.num_generations=8", f"grpo.max_completion_length={L}", "grpo.rewards=[regex:a]"])
s = make_setup(cfg, jax.devices()[:1])
state = initial_state(s)
prompts = [list(np.random.default_rng(i).integers(1, 255, 16)) for i in range(N)]
st = Settings(G=8, max_new=L, decode=lambda ids: bytes(i % 256 for i in ids).decode("latin-1"))
records = [{"prompt_ids": prompts[i]} for i in range(N // 8)]
step = jit_train_step(s)
batch, _ = generation(s.model, state["params"], records, [("a", lambda completions, **k: [float("a" in c) for c in
                                                                                       completions])], [1.0], st,
                      jax.random.key(0))
with jax.set_mesh(s.mesh):
    dev = jax.device_put(batch, s.batch_sharding())
    state, _ = jax.block_until_ready(step(state, dev))  # compiled (the step donates its state: keep the new one)
    jax.block_until_ready(sample_completions(s.model, state["params"], prompts, L, jax.random.key(1))["tokens"])
    sample_s, step_s = [], []
    for r in range(R):
        t0 = time.perf_counter()
        got = sample_completions(s.model, state["params"], prompts, L, jax.random.key(r))
        sample_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state, _ = jax.block_until_ready(step(state, dev))
        step_s.append(time.perf_counter() - t0)
drawn = N * L
learnt = N * s.model.seq_len
a, b = drawn / np.median(sample_s), learnt / np.median(step_s)
family = [ln.split(":")[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("cpu family")][0]
print(f"cpu family {family}; N={N} completions x L={L} tokens, rows of {s.model.seq_len}")
print(f"sampling {a:,.0f} tokens/s (median of {R}), learning step {b:,.0f} tokens/s; sampling / learning {a / b:.3f}")
