"""Temp memory of the compiled train step with the whole logits (model.loss_chunk=0) and tiled
(the default rule, or --chunk N), from XLA's memory analysis; compile only, nothing runs.

  python scripts/bench/loss_memory.py [key=value ...] [--chunk N]

Default: the 125m model, batch 8 x 1024 tokens, vocabulary 131072, float32, 1 device.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DEFAULT = ["model.preset=125m", "model.vocab_size=131072", "model.seq_len=1024", "train.batch_size=8",
           "train.dtype=float32", "mesh.data=1", "mesh.stage=1", "mesh.model=1", "run.progress=false"]


def temp_bytes(overrides, devices=None) -> int:
    """temp_size_in_bytes of the compiled train step for a config (abstract shapes only)."""
    return memory_analysis(overrides, devices).temp_size_in_bytes


def memory_analysis(overrides, devices=None, compiler_options=None):
    """XLA's memory analysis of the compiled train step for a config (abstract shapes only)."""
    import jax
    from trainer.config import load_config
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    s = make_setup(load_config(list(overrides)), devices or jax.devices()[:1])
    batch = s.abstract_batch()
    with jax.set_mesh(s.mesh):
        compiled = jit_train_step(s).lower(s.shapes, batch).compile(compiler_options)
    return compiled.memory_analysis()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("args", nargs="*", help="key=value overrides on top of the default shape")
    ap.add_argument("--chunk", type=int, default=None, help="model.loss_chunk of the tiled run (default: auto)")
    a = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    base = DEFAULT + a.args
    tiled = [] if a.chunk is None else [f"model.loss_chunk={a.chunk}"]
    out = {}
    for name, extra in (("whole logits (loss_chunk=0)", ["model.loss_chunk=0"]),
                        (f"tiled (loss_chunk={'auto' if a.chunk is None else a.chunk})", tiled)):
        t = time.perf_counter()
        out[name] = temp_bytes(base + extra)
        print(f"{name:32s} temp {out[name] / 2**30:8.3f} GiB   (compiled in {time.perf_counter() - t:.0f} s)")
    whole, tile = out.values()
    print(f"tiled / whole: {tile / whole:.3f} ({100 * (1 - tile / whole):.1f}% less temp memory)")


if __name__ == "__main__":
    main()
