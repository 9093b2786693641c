"""The Llama-style transformer (Flax NNX), its config, presets and FLOP counting."""
from models.config import (PRESETS, REMAT_POLICIES, ModelConfig, flops_per_token, from_preset,
                           hardware_flops_per_token, matmul_param_count, param_count)
from models.loss import loss_fn, loss_sum
from models.precision import FLOAT32_WEIGHTS, compute_dtypes
from models.transformer import Transformer, abstract_model, forward, logical_axes_of, params_of, weight_decay_of

__all__ = ["FLOAT32_WEIGHTS", "PRESETS", "REMAT_POLICIES", "ModelConfig", "Transformer", "abstract_model",
           "compute_dtypes", "flops_per_token",
           "forward", "from_preset", "hardware_flops_per_token", "logical_axes_of", "loss_fn", "loss_sum", "matmul_param_count",
           "param_count", "params_of", "weight_decay_of"]
