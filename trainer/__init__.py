"""meshtrain's Python API: `load_config` (pure), `resolve` (what a config points at) and `train(cfg)`.

The names load on first use, so that importing one layer of the package (trainer.errors, trainer.config,
...) does not import the layers above it (the loop, checkpoints, the planner). A module that moved still
imports by its old name (MOVED), so a user's `run.plugins` module written against it loads.
"""
import importlib
import importlib.abc
import importlib.util
import sys

from trainer.platforms import avoid_absent_tpu

avoid_absent_tpu()  # libtpu installed, no TPU chip: jax starts without a TPU runtime (trainer/platforms.py)

_API = {"Config": "trainer.config", "load_config": "trainer.config", "replace": "trainer.config",
        "UserError": "trainer.errors", "resolve": "trainer.ckpt.sources", "train": "trainer.run.loop"}
__all__ = sorted(_API)
MOVED = {"trainer.run.guard": "trainer.run.on_nan", "trainer.run.goodput": "trainer.run.goodput_record",
         "trainer.plan.cli": "trainer.plan.command",
         # models/ grouped by kind (issue 66): a family module written against the flat layout still imports
         **{f"models.{old}": f"models.{new}" for old, new in (
             ("qwen", "families.qwen"), ("mistral", "families.mistral"), ("gemma", "families.gemma"),
             ("moe", "families.moe"), ("llama_hf", "hf.llama"), ("qwen_hf", "hf.qwen"), ("gemma_hf", "hf.gemma"),
             ("moe_hf", "hf.moe"), ("attention", "kernels.attention"), ("fast_cpu", "kernels.fast_cpu"),
             ("flash_cpu", "kernels.flash_cpu"), ("experts", "kernels.experts"), ("moe_tpu", "kernels.moe_tpu"),
             ("context", "context_parallel.gather"), ("ring", "context_parallel.ring"),
             ("loss", "objectives.objective"), ("dpo", "objectives.dpo"))}}  # old name: the module's name now


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a MOVED module's old name as the module itself (one module object under both names)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved())


def __getattr__(name):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute '{name}'")
