"""Build tests/fixtures/localsgd_hf/: a local-SGD run's parameters exported as a Hugging Face Llama folder,
and transformers' logits for it (tests/test_localsgd.py retrains the same run and compares).

Two steps, two environments (transformers is not a meshtrain dependency):
    python scripts/make_localsgd_fixture.py                               # meshtrain's venv: train, export
    /path/to/hf-venv/bin/python scripts/make_hf_fixture.py --reference tests/fixtures/localsgd_hf
The run: the tiny model, 2 replicas that never sync within its 3 SGD steps (so they differ), synthetic
data; the export holds their average.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "localsgd_hf"
CONFIG = ["model.preset=tiny", "train.sync=local_sgd", "train.sync_every=100", "mesh.data=2", "train.batch_size=8",
          "train.optimizer=sgd", "train.grad_clip=0", "train.lr=0.5", "train.warmup_steps=0", "train.steps=3",
          "train.eval_every=0", "data.source=synthetic", "run.progress=false"]


def export_run(run_dir: Path, out: Path):
    """Train CONFIG on 2 devices in run_dir and export it to out as an HF folder."""
    import jax
    from trainer import load_config, train
    from trainer.ckpt.hf_export import export_hf
    train(load_config(CONFIG + [f"run.dir={run_dir}"]), jax.devices()[:2])
    return export_hf(run_dir, out)


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    shutil.rmtree(OUT, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        export_run(Path(tmp) / "run", OUT)
    print(f"exported to {OUT}; now run make_hf_fixture.py --reference {OUT} in the transformers venv")
