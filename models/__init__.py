"""The model: the families (a registry of specs, models/spec.py; each family a module of models/families/, Llama the
default), the generic decoder in Flax NNX (models/transformer.py), its config, presets and FLOP counting; the Hugging
Face adapters (models/hf/), kernels (models/kernels/), context-parallel attention (models/context_parallel/) and the
objectives (models/objectives/)."""
from models.config import PRESETS, REMAT_POLICIES, ModelConfig, from_preset
from models.counts import flops_per_token, hardware_flops_per_token, matmul_param_count, param_count
from models.objectives.objective import loss_fn, loss_sum
from models.layers import Placement
from models.precision import compute_dtypes
from models.spec import FAMILIES, ModelSpec, Param, family, register
from models.families.llama import LLAMA  # registers the llama family (the default)
from models.families.gemma import GEMMA2, GEMMA3  # registers the gemma2 and gemma3 families
from models.families.mistral import MISTRAL  # registers the mistral family
from models.families.moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE  # registers the mixtral, qwen3_moe and qwen2_moe families
from models.families.deepseek import DEEPSEEK_V3, GLM4_MOE_LITE  # registers the deepseek_v3 and glm4_moe_lite families
from models.families.qwen import QWEN2, QWEN3  # registers the qwen2 and qwen3 families
from models.families.gpt_oss import GPT_OSS  # registers the gpt_oss family
from models.transformer import (Transformer, abstract_model, forward, inventory, logical_axes_of, params_of,
                                weight_decay_of)

__all__ = ["FAMILIES", "GEMMA2", "GEMMA3", "GPT_OSS", "LLAMA", "MISTRAL", "MIXTRAL", "PRESETS", "QWEN2", "QWEN2_MOE", "QWEN3",
           "QWEN3_MOE", "REMAT_POLICIES", "ModelConfig", "ModelSpec", "Param", "Placement", "Transformer",
           "abstract_model", "compute_dtypes", "family", "flops_per_token", "forward", "from_preset",
           "hardware_flops_per_token", "inventory", "logical_axes_of", "loss_fn", "loss_sum", "matmul_param_count",
           "param_count", "params_of", "register", "weight_decay_of"]
