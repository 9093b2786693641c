"""Export a sharded model to a Hugging Face folder and import it onto 8 simulated devices (ZeRO-3):
seconds for each and the peak host memory above the sharded state, against the largest tensor.

  python scripts/bench/hf_bench.py [key=value ...]      # default: the 1b preset, bfloat16 files

Peak RSS is the kernel's high-water mark (VmHWM), reset (/proc/self/clear_refs) just before each phase,
minus the RSS at that moment (which holds the sharded parameters of the simulated devices).
"""
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from models import Transformer, params_of  # noqa: E402

from models.spec import leaf_shape  # noqa: E402
from trainer.ckpt.hf import leaves  # noqa: E402
from trainer.ckpt.hf_export import write_hf  # noqa: E402
from trainer.ckpt.params import init_params  # noqa: E402
from trainer import load_config, resolve  # noqa: E402
from trainer.state import make_setup  # noqa: E402

BASE = ["model.preset=1b", "mesh.data=8", "train.zero_stage=3", "run.progress=false"]
DTYPE = "bfloat16"


def _status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak():
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    return _status("VmRSS")


def main(argv):
    cfg = load_config(BASE + argv)
    s = make_setup(cfg, jax.devices()[:8])
    with jax.set_mesh(s.mesh):  # parameters only (no optimizer state), created sharded by a jitted init
        params = jax.jit(lambda: params_of(Transformer(s.model, rngs=nnx.Rngs(0))),
                         out_shardings=s.shardings["params"])()
    jax.block_until_ready(params)
    state_b = sum(x.nbytes for x in jax.tree.leaves(params))
    largest = max(int(np.prod(leaf_shape(lf)[1:] if lf.stacked else leaf_shape(lf))) for lf in leaves(s.model)) * 4
    print(f"{cfg.model.preset}: {state_b / 1e9:.2f} GB of float32 parameters on 8 devices; largest tensor "
          f"{largest / 1e6:.0f} MB (float32)")
    with tempfile.TemporaryDirectory(dir=os.environ.get("HF_BENCH_DIR")) as tmp:
        out = Path(tmp) / "hf"
        base = _reset_peak()
        t = time.perf_counter()
        write_hf(params, s.model, out, DTYPE)
        dt = time.perf_counter() - t
        peak = _status("VmHWM") - base
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"export: {dt:.1f} s, {size / 1e9:.2f} GB written ({DTYPE}), peak RSS above the state "
              f"{peak / 1e6:.0f} MB = {peak / largest:.2f}x the largest tensor")
        del params
        s2 = make_setup(resolve(load_config(BASE + argv + [f"model.init_from={out}"])), jax.devices()[:8])
        base = _reset_peak()
        t = time.perf_counter()
        got = init_params(s2, out)
        jax.block_until_ready(got)
        dt = time.perf_counter() - t
        peak = _status("VmHWM") - base - state_b  # the imported state itself is expected
        print(f"import: {dt:.1f} s onto (8,1,1) ZeRO-3, peak RSS above the sharded state it creates "
              f"{peak / 1e6:.0f} MB = {peak / largest:.2f}x the largest tensor")


if __name__ == "__main__":
    main(sys.argv[1:])
