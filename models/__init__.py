"""The Llama-style transformer (Flax NNX), its config, presets and FLOP counting."""
from models.config import (PRESETS, REMAT_POLICIES, ModelConfig, flops_per_token, from_preset,
                           hardware_flops_per_token, matmul_param_count, param_count)
from models.transformer import (Transformer, abstract_model, forward, logical_axes_of, loss_fn, params_of,
                                weight_decay_of)

__all__ = ["PRESETS", "REMAT_POLICIES", "ModelConfig", "Transformer", "abstract_model", "flops_per_token",
           "forward", "from_preset", "hardware_flops_per_token", "logical_axes_of", "loss_fn", "matmul_param_count",
           "param_count", "params_of", "weight_decay_of"]
