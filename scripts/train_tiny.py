"""Example: train through the Python API (what the CLI does), then read the results.

  python scripts/train_tiny.py [key=value ...]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import load_config, replace, train  # noqa: E402

cfg = load_config(["model.preset=tiny", "run.dir=runs/tiny", "train.steps=100", "train.eval_every=50"]
                  + sys.argv[1:])
cfg = replace(cfg, run=dict(log_every=25))  # configs are frozen dataclasses; replace() makes a copy
result = train(cfg)
if not result.history:  # run.dir already holds a checkpoint at train.steps: nothing left to train
    sys.exit(f"{cfg.run.dir} is already trained to step {result.start_step}; raise train.steps or use another run.dir")
first, last = result.history[0], result.history[-1]
print(f"loss {first['loss']:.3f} -> {last['loss']:.3f}; eval loss {result.eval_loss:.3f}")
