"""The Qwen2 / Qwen2.5 and Qwen3 families: Llama's layer with the attention options of models/transformer.py's
`qkv` (ATTENTION_OPTIONS), each family a few parameters more than Llama's inventory.

  qwen2  biases on the q, k and v projections (none on the output projection)
  qwen3  RMSNorm of every q and k head over head_dim before RoPE, one (head_dim,) weight each shared by the
         heads (replicated under tensor parallelism); head_dim independent of d_model / n_heads
"""
from __future__ import annotations

from models.config import ModelConfig
from models.hf.qwen import QWEN2_HF, QWEN3_HF
from models.spec import ModelSpec, Param, register
from models.families.llama import llama_inventory
from models.transformer import layer


def qwen2_inventory(c: ModelConfig) -> dict:
    inv = llama_inventory(c)
    H, K, E = c.n_heads, c.n_kv_heads, c.head_dim
    biases = {"bq": Param((H, E), ("heads", "head_dim"), "zeros", False),
              "bk": Param((K, E), ("kv_heads", "head_dim"), "zeros", False),
              "bv": Param((K, E), ("kv_heads", "head_dim"), "zeros", False)}
    return {**inv, "layers": {**inv["layers"], **biases}}


def qwen3_inventory(c: ModelConfig) -> dict:
    inv = llama_inventory(c)
    norms = {"q_norm": Param((c.head_dim,), ("head_dim",), "ones", False),
             "k_norm": Param((c.head_dim,), ("head_dim",), "ones", False)}
    return {**inv, "layers": {**inv["layers"], **norms}}


QWEN2 = register(ModelSpec("qwen2", qwen2_inventory, layer, QWEN2_HF))
QWEN3 = register(ModelSpec("qwen3", qwen3_inventory, layer, QWEN3_HF))
