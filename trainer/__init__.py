"""Config, state, train step, data, metrics and the loop; `train(cfg)` is the entry point."""
from trainer.config import Config, load_config, replace
from trainer.errors import UserError
from trainer.loop import train

__all__ = ["Config", "UserError", "load_config", "replace", "train"]
