"""Build tests/fixtures/hf_trained/: each new family's fixture (Qwen2, Qwen3, Mistral, Gemma 2 and 3, Gemma 3's
multimodal folder, exported as its text model) trained for 3 steps and exported as a Hugging Face folder, with
transformers' logits for it (tests/test_family_parity.py and tests/test_gemma.py retrain each run and compare).

Two steps, two environments (transformers is not a meshtrain dependency):
    python scripts/make_trained_hf_fixture.py [--only NAME]                 # meshtrain's venv: train, export
    for d in tests/fixtures/hf_trained/*/; do
        /path/to/hf-venv/bin/python scripts/make_hf_fixture.py --reference $d; done
The run: the fixture as model.init_from, 1 device, 3 SGD steps on synthetic windows of 32 tokens (twice Mistral's
window of 16, as Gemma's), exported in float32 (the export of a sharded run is tests/test_hf.py's).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC, OUT = ROOT / "tests" / "fixtures" / "hf", ROOT / "tests" / "fixtures" / "hf_trained"
NAMES = ["qwen2_tied_bias_f32", "qwen3_head_dim_bf16", "mistral_window16_f32", "gemma2_mixed_f32", "gemma3_mixed_bf16",
         "gemma3_vlm_f32"]
CONFIG = ["model.preset=tiny", "model.seq_len=32", "mesh.data=1", "train.batch_size=8", "train.optimizer=sgd", "train.grad_clip=0", "train.lr=0.5", "train.warmup_steps=0",
          "train.steps=3", "train.eval_every=0", "data.source=synthetic", "run.progress=false"]


def export_run(name: str, run_dir: Path, out: Path) -> Path:
    """Train CONFIG from fixture `name` in run_dir and export it to out as an HF folder."""
    import jax
    from trainer import load_config, train
    from trainer.ckpt.hf_export import export_hf
    train(load_config(CONFIG + [f"model.init_from={SRC / name}", f"run.dir={run_dir}"]), jax.devices()[:1])
    return export_hf(run_dir, out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=NAMES, help="build only this one (the others are left as they are)")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    for name in NAMES:
        if args.only in (None, name):
            shutil.rmtree(OUT / name, ignore_errors=True)
            with tempfile.TemporaryDirectory() as tmp:
                export_run(name, Path(tmp) / "run", OUT / name)
            print(f"exported to {OUT / name}; now run make_hf_fixture.py --reference {OUT / name} in the "
                  "transformers venv")
