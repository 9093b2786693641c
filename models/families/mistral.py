"""The Mistral family (`MistralForCausalLM`): Llama's parameters and layer with one sliding window for every
layer (`model.window`, config.json's `sliding_window`), which every attention path honours: training (XLA's
attention with its local window, the CPU fast path skipping the key blocks outside it) and KV-cache decoding
(a ring of the window's length). This module is the family and its Hugging Face adapter."""
from __future__ import annotations

from models.hf import llama as llama_hf
from models.spec import HFAdapter, ModelSpec, register
from models.families.llama import llama_inventory
from models.transformer import layer

ARCH = "MistralForCausalLM"


def model_keys(hc: dict) -> dict:
    window = hc.get("sliding_window")
    return {**llama_hf.model_keys(hc), "window": (int(window) if window else None, "sliding_window")}


def hf_config(mc, dtype: str) -> dict:
    base = {k: v for k, v in llama_hf.hf_config(mc, dtype).items() if k not in llama_hf.LLAMA_ONLY}
    return {**base, "architectures": [ARCH], "model_type": "mistral", "sliding_window": mc.window}


MISTRAL_HF = HFAdapter(ARCH, llama_hf.check, model_keys, llama_hf.leaves, hf_config, llama_hf.heads_expressible)
MISTRAL = register(ModelSpec("mistral", llama_inventory, layer, MISTRAL_HF))
