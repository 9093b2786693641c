"""XLA:CPU's compiled memory of one train step, LoRA (rank 8, every projection) against full fine-tuning, same model
and layout ((2,1,4) ZeRO-3 on 8 simulated devices), from the compiled step's memory_analysis (docs/lora.md).
    .venv/bin/python scripts/bench/lora_memory.py [more config keys]"""
import sys
sys.path.insert(0, "tests")  # run from the repo root: conftest sets 8 simulated devices
import conftest  # noqa: F401
import jax  # noqa: E402
import numpy as np  # noqa: E402

from models.batch import from_windows  # noqa: E402
from trainer import load_config, resolve  # noqa: E402
from trainer.state import make_setup  # noqa: E402
from trainer.step import jit_train_step  # noqa: E402

BASE = ["model.preset=small", "mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3", "train.batch_size=8"]
for name, extra in (("full", []), ("lora", ["model.lora.rank=8", "model.lora.targets=[all-linear]"])):
    cfg = resolve(load_config(BASE + extra + sys.argv[1:]))
    s = make_setup(cfg, jax.devices()[:8])
    windows = np.zeros((8, s.model.seq_len + 1), np.int32)
    b = from_windows(windows)
    abstract_b = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s.batch_sharding()), b)
    state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), s.shapes, s.shardings)
    with jax.set_mesh(s.mesh):
        m = jit_train_step(s).lower(state, abstract_b).compile().memory_analysis()
    print(f"{name}: argument {m.argument_size_in_bytes:,} temp {m.temp_size_in_bytes:,} output {m.output_size_in_bytes:,} "
          f"total {m.argument_size_in_bytes + m.temp_size_in_bytes:,}")
