"""The Llama family (`LlamaForCausalLM`), the default `model.family`: its parameter inventory and its registration.

Its layer is models/transformer.py's `layer` with the default halves, pre-norm GQA attention with RoPE
(`attention_half`) and a SwiGLU MLP (`mlp_half`), built of models/layers.py's pieces: the plain reference (einsum
projections with autodiff, jax.nn.silu, rotate-half RoPE, jax.nn attention) or, by `kernels_for`,
models/kernels/fast_cpu.py's equal but faster forms on XLA:CPU (model.kernels: auto | reference | fast). Its Hugging
Face adapter is models/hf/llama.py. The other families start from its inventory (models/families/).
"""
from __future__ import annotations

from models.config import ModelConfig
from models.hf.llama import LLAMA_HF
from models.spec import ModelSpec, Param, register
from models.transformer import layer


def llama_inventory(c: ModelConfig) -> dict:
    """Every parameter of the Llama, written once: {name: Param}, with the stack's per-layer ones under
    "layers". The module, the HF name map, the planner and the precision rules read it."""
    D, H, K, E, F, V = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size
    out = {"embed": Param((V, D), ("vocab", "embed"), "normal", True, as_stored=True),
           "layers": {"attn_norm": Param((D,), ("embed",), "ones", False),
                      "wq": Param((D, H, E), ("embed", "heads", "head_dim"), "normal", True),
                      "wk": Param((D, K, E), ("embed", "kv_heads", "head_dim"), "normal", True),
                      "wv": Param((D, K, E), ("embed", "kv_heads", "head_dim"), "normal", True),
                      "wo": Param((H, E, D), ("heads", "head_dim", "embed"), "residual", True),
                      "mlp_norm": Param((D,), ("embed",), "ones", False),
                      "w_gate": Param((D, F), ("embed", "mlp"), "normal", True),
                      "w_up": Param((D, F), ("embed", "mlp"), "normal", True),
                      "w_down": Param((F, D), ("mlp", "embed"), "residual", True)}}
    if not c.tie_embeddings:
        out["lm_head"] = Param((D, V), ("embed", "vocab"), "normal", True, as_stored=True)
    out["final_norm"] = Param((D,), ("embed",), "ones", False, as_stored=True)
    return out


LLAMA = register(ModelSpec("llama", llama_inventory, layer, LLAMA_HF))
