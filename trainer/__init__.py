"""meshtrain's Python API: `load_config` (pure), `resolve` (what a config points at) and `train(cfg)`.

The names load on first use, so that importing one layer of the package (trainer.errors, trainer.config,
...) does not import the layers above it (the loop, checkpoints, the planner).
"""
import importlib

from trainer.platforms import avoid_absent_tpu

avoid_absent_tpu()  # libtpu installed, no TPU chip: jax starts without a TPU runtime (trainer/platforms.py)

_API = {"Config": "trainer.config", "load_config": "trainer.config", "replace": "trainer.config",
        "UserError": "trainer.errors", "resolve": "trainer.ckpt.sources", "train": "trainer.run.loop"}
__all__ = sorted(_API)


def __getattr__(name):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute '{name}'")
