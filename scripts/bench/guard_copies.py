"""Does the compiler copy the optimizer's state because of the NaN/spike guard's select (trainer/guard.py)?

    python scripts/bench/guard_copies.py [--tpu]

A toy step (4M float32 weights, optax.adamw, the state donated), compiled for this machine's CPU three ways: with
the guard's select over the new state (as trainer/guard.py does), without a guard, and with the parameters updated
from the selected moments (Adam's update written out). Prints each one's temp bytes and the arguments it copies.
With --tpu (libtpu in the venv), the small preset's real step at (2,1,4) compiled for v5p:2x2x2 (ZeRO 0 and 1, remat
full): the arguments XLA:TPU copies, by name.
"""
from __future__ import annotations

import functools
import os
import re
import sys

N = 4_000_000


def toy() -> None:
    import jax
    import jax.numpy as jnp
    import optax
    opt = optax.adamw(1e-3)

    def step(how, state, x):
        p, o = state
        loss, g = jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(p * x)))(p)
        bad = ~jnp.isfinite(loss)
        u, new = opt.update(g, o, p)
        if how == "no guard":
            return (optax.apply_updates(p, u), new), loss
        kept = jax.tree.map(lambda n, old: jnp.where(bad, old, n), new, o)
        if how == "guard's select":
            return (jnp.where(bad, p, optax.apply_updates(p, u)), kept), loss
        adam = kept[0]  # Adam's update from the selected moments (count, mu, nu), weight decay 1e-4
        mu, nu = adam.mu / (1 - 0.9 ** adam.count), adam.nu / (1 - 0.999 ** adam.count)
        return (jnp.where(bad, p, p - 1e-3 * (mu / (jnp.sqrt(nu) + 1e-8) + 1e-4 * p)), kept), loss

    p = jax.ShapeDtypeStruct((N,), jnp.float32)
    state = (p, jax.eval_shape(opt.init, p))
    for how in ("guard's select", "no guard", "update from the selected moments"):
        c = jax.jit(functools.partial(step, how), donate_argnums=0).lower(state, p).compile()
        copies = re.findall(r"= (\S+) copy\(%([\w.]+)\)", c.as_text())
        print(f"CPU toy, {how}: temp {c.memory_analysis().temp_size_in_bytes / 1e6:.1f} MB; copies of "
              f"{', '.join(f'{a} ({s})' for s, a in copies) or 'nothing'}")


def tpu() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from trainer.config import load_config
    from trainer.plan.aot import compile_for
    for zero in (0, 1):
        cfg = load_config(["model.preset=small", "model.seq_len=1024", "train.batch_size=8", "mesh.data=2",
                           "mesh.model=4", "train.dtype=bfloat16", f"train.zero_stage={zero}", "model.remat=full"])
        text = compile_for(cfg, "v5p:2x2x2").measured.text
        names = dict(re.findall(r"%(param[.\d]*) = .*?op_name=\"([^\"]*)\"", text))
        copies = re.findall(r"= (\S+) copy\(%(param[.\d]*)\)", text)
        print(f"XLA:TPU, small preset (2,1,4) ZeRO-{zero}: copies of "
              + ", ".join(f"{names.get(a, a)} ({s.split('{')[0]})" for s, a in copies).replace("\\'", "'"))


if __name__ == "__main__":
    toy()
    if "--tpu" in sys.argv:
        tpu()
