"""Steady-state step time, tokens/s and model FLOP/s for any config and mesh, against the
matmul rates measured in the same process, and against a minimal hand-written jitted step.

  python scripts/bench/bench.py [CONFIG.yaml ...] [key=value ...] [--steps N] [--devices N] [--no-reference]

Example (the issue-2 figure):
  python scripts/bench/bench.py model.d_model=256 model.n_layers=4 model.n_heads=4 model.n_kv_heads=4 \
      model.d_ff=1024 model.vocab_size=256 model.seq_len=256 train.batch_size=4 train.dtype=float32 mesh.data=1

--devices N simulates N CPU devices (sets XLA_FLAGS before jax is imported).
All figures are ratios taken in one run; absolute times mean something only on a real accelerator.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("args", nargs="*", help="configs and key=value overrides")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    ap.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    ap.add_argument("--no-reference", action="store_true", help="skip the hand-written reference step")
    return ap.parse_args()


def time_steps(fn, state, batch, steps):
    """Median seconds of `steps` steps after 2 warm-up steps, and the last state."""
    import jax
    for _ in range(2):
        state, m = fn(state, batch)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = fn(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    return statistics.median(times), state


def matmul_rates() -> dict:
    """float32 and bfloat16 matmul FLOP/s measured now in this process (the MFU denominators)."""
    import jax.numpy as jnp
    from trainer.hardware import measure_matmul_rate
    # the best of two sizes: on this CPU 1024^3 runs a few % faster than 2048^3
    return {"float32": max(measure_matmul_rate(jnp.float32, n, 5) for n in (1024, 2048)),
            "bfloat16": max(measure_matmul_rate(jnp.bfloat16, n, 5) for n in (1024, 2048))}


def reference_step(s):
    """A minimal jitted step of the same model: value_and_grad + clip + adamw, no layout machinery."""
    import optax
    from models import loss_fn
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
        params, opt = state
        loss, g = jax.value_and_grad(lambda p: loss_fn(s.model, p, batch, dtype=s.dtype, placement=s.placement))(params)
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), loss

    return step, tx


def main():
    a = parse()
    if a.devices:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
    global jax, functools
    import functools
    import jax
    from models import flops_per_token
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step

    cfg = load_config(list(a.args) + ["run.progress=false"])
    s = make_setup(cfg)
    t = cfg.train
    batches = Batches(load_corpus("synthetic"), 0, t.batch_size, s.model.seq_len, s.model.vocab_size)
    batch = jax.device_put(batches.global_train(0), s.batch_sharding())
    tokens = t.batch_size * s.model.seq_len
    fpt = flops_per_token(s.model)

    rates = matmul_rates()
    with jax.set_mesh(s.mesh):
        dt, _ = time_steps(jit_train_step(s), init_state(s), batch, a.steps)
    ref_dt = None
    if not a.no_reference and s.mesh.size == 1:
        step, tx = reference_step(s)
        params = jax.device_put(init_state(s)["params"])
        ref_dt, _ = time_steps(step, (params, tx.init(params)), batch, a.steps)
    rates2 = matmul_rates()
    rate = {k: max(rates[k], rates2[k]) for k in rates}  # best of before/after: less noise
    flops_s = fpt * tokens / dt
    on_cpu = jax.devices()[0].platform == "cpu"
    peak_n = 1 if on_cpu else s.mesh.size
    mesh = "x".join(str(v) for v in s.mesh.shape.values())
    print(f"config: {s.model} mesh(data,stage,model)={mesh} zero={t.zero_stage} sync={t.grad_sync} "
          f"dtype={s.dtype.name} batch={t.batch_size} microbatches={t.microbatches}")
    print(f"matmul rate (best of 1024^3 and 2048^3, before and after, this process): float32 {rate['float32'] / 1e9:.1f} GFLOP/s, "
          f"bfloat16 {rate['bfloat16'] / 1e9:.1f} GFLOP/s" + (" per device" if not on_cpu else " (whole CPU)"))
    print(f"step time (median of {a.steps}): {dt * 1e3:.1f} ms | tokens/s {tokens / dt:,.0f} | "
          f"model TFLOP/s {flops_s / 1e12:.4f} ({fpt / 1e6:.2f} MFLOP/token)")
    print(f"ratio model FLOP/s / {s.dtype.name} matmul rate: {flops_s / (rate[s.dtype.name] * peak_n):.3f}")
    if ref_dt:
        print(f"hand-written reference step: {ref_dt * 1e3:.1f} ms | ratio {fpt * tokens / ref_dt / rate[s.dtype.name]:.3f}"
              f" | meshtrain / reference speed {ref_dt / dt:.3f}")


if __name__ == "__main__":
    main()
