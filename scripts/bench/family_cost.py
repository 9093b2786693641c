"""Each model family's train step against another's on the bench shape, in one process: Qwen2, Qwen3, Mistral,
Gemma 2 and Gemma 3 against Llama, and Mistral's sliding window against full attention at T = 4 x window.

  python scripts/bench/family_cost.py [--steps 20] [--rounds 5] [--window 64] [--only gemma2,gemma3]
                                      [-- key=value ...]

Gemma 2: layers local, global, local, global (the window), soft-caps 50 and 30 (transformers' defaults),
query_pre_attn_scalar = head_dim; Gemma 3: local, local, local, global, the global layers' RoPE scaled x8.
--only: the pairs whose second member's name starts with one of these (every pair by default).

Every step (scripts/bench/bench.yaml plus any key=value, data.source=builtin) is compiled in this process; each
pair runs in alternating blocks of --steps steps (scripts/bench/alternate.py) on the same batch, so both see the
same machine at the same moments: the median per-round ratio of their step times is the figure (absolute times
hold only on a quiet machine). XLA's FLOPs per step (cost_analysis) are printed beside each.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from alternate import alternate, alternating_args

ROOT = Path(__file__).resolve().parents[2]


def main():
    a, extra = alternating_args(__doc__, ("--window", dict(type=int, default=64,
                                                        help="Mistral's window (the bench's seq_len is 256)")),
                                ("--only", dict(default="", help="comma-separated family names")))
    sys.path.insert(0, str(ROOT))
    import jax
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step
    variants = {"llama": ["model.family=llama"], "qwen2": ["model.family=qwen2"], "qwen3": ["model.family=qwen3"],
                "mistral-full": ["model.family=mistral"],
                f"mistral-window{a.window}": ["model.family=mistral", f"model.window={a.window}"],
                "gemma2": ["model.family=gemma2", f"model.window={a.window}",
                           "model.local_layers=[true,false,true,false]", "model.attn_softcap=50.0",
                           "model.final_softcap=30.0"],
                "gemma3": ["model.family=gemma3", f"model.window={a.window}",
                           "model.local_layers=[true,true,true,false]", "model.rope_theta=1e6", "model.rope_linear=8"]}
    pairs = [("llama", "qwen2"), ("llama", "qwen3"), ("llama", f"mistral-window{a.window}"),
             ("mistral-full", f"mistral-window{a.window}"), ("llama", "gemma2"), ("llama", "gemma3")]
    if a.only:
        pairs = [p for p in pairs if p[1].startswith(tuple(a.only.split(",")))]
        variants = {k: v for k, v in variants.items() if any(k in p for p in pairs)}
    steps, states, batches = {}, {}, {}
    for name, over in variants.items():
        cfg = load_config([str(ROOT / "scripts/bench/bench.yaml"), *extra, *over, "data.source=builtin",
                           "run.progress=false"])
        s = make_setup(cfg, jax.devices()[:1])
        states[name] = init_state(s)
        if not batches:
            batch = jax.device_put(Batches(load_corpus("builtin"), 0, cfg.train.batch_size, s.model.seq_len,
                                           s.model.vocab_size).global_train(0))
        batches[name] = batch
        steps[name] = jit_train_step(s)
        cost = steps[name].lower(states[name], batch).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        print(f"{name}: seq_len {s.model.seq_len}, window {s.model.window}, XLA {cost['flops'] / 1e6:,.1f} MFLOP "
              "per step", flush=True)
    results = {}
    for pair in pairs:
        ratios = alternate(steps, states, batches, a.steps, a.rounds, pair)
        results[pair] = statistics.median(ratios)
    print("summary (median step-time ratio, one process):")
    for (x, y), r in results.items():
        print(f"  {y} / {x}: {r:.3f}")


if __name__ == "__main__":
    main()
