"""The `model:` section of the config schema (trainer/sections.py); null keys take the preset's (or family's) value."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from models import FAMILIES, PRESETS, REMAT_POLICIES
from models.config import ATTENTION_IMPLS, KERNELS
from trainer.errors import UserError
from trainer.schema import Form, choose, key


def _rope_scaling(v, name: str):
    if len(v) != 4 or min(v[:3]) <= 0 or v[3] < 1:
        raise UserError(f"{name}={list(v)} needs 4 positive numbers: factor, low_freq_factor, high_freq_factor, "
                        "original_max_position_embeddings")


# the built-in families for the docs; a family registered later (a plug-in) is accepted too
FAMILY = Form(f"{', '.join(FAMILIES)} (models/spec.py's registry)", lambda v, k: choose(k, v, FAMILIES))
ROPE_SCALING = Form("[factor, low_freq_factor, high_freq_factor, original_max_position_embeddings], each > 0",
                    _rope_scaling)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    preset: str = key("small", PRESETS, "the shapes (models/config.py); explicit model.* keys override them")
    family: Optional[str] = key(None, FAMILY, "the model family; null: an HF init_from's, else llama")
    d_model: Optional[int] = key(None, "> 0", "the residual stream's width")
    n_layers: Optional[int] = key(None, "> 0", "transformer layers")
    n_heads: Optional[int] = key(None, "> 0", "attention (query) heads")
    n_kv_heads: Optional[int] = key(None, "> 0", "key/value heads; fewer than n_heads: grouped-query attention")
    head_dim: Optional[int] = key(None, "> 0", "one attention head's width (even); null: d_model / n_heads")
    d_ff: Optional[int] = key(None, "> 0", "the MLP's hidden units")
    vocab_size: Optional[int] = key(None, "> 0", "tokens of the vocabulary (embedding and output rows)")
    seq_len: Optional[int] = key(None, "> 0", "tokens per training sequence")
    tie_embeddings: Optional[bool] = key(None, None, "the output head shares the embedding's weights")
    rope_theta: Optional[float] = key(None, "> 0", "RoPE base")
    norm_eps: Optional[float] = key(None, "> 0", "RMSNorm epsilon")
    rope_scaling: Optional[List[float]] = key(None, ROPE_SCALING, "Llama 3.x `llama3` RoPE scaling; null: none")
    window: Optional[int] = key(None, "> 0", "sliding-window attention (Mistral): keys fewer than this many "
                                "positions back; null: no window")
    # Gemma's (models/gemma.py; an HF import sets them)
    local_layers: Optional[List[bool]] = key(None, None, "Gemma: per layer, true local (model.window) or false "
                                             "global; null: every layer alike")
    rope_local_theta: Optional[float] = key(None, "> 0", "Gemma 3: the local layers' RoPE base; null: rope_theta")
    rope_linear: Optional[float] = key(None, "> 0", "Gemma 3: the global layers' linear RoPE factor; null: none")
    attn_softcap: Optional[float] = key(None, "> 0", "Gemma: attention scores soft-capped at this; null: none")
    final_softcap: Optional[float] = key(None, "> 0", "Gemma: output logits soft-capped at this; null: none")
    query_scale: Optional[float] = key(None, "> 0", "Gemma: scores scaled by query_scale ** -0.5; null: head_dim")
    embed_scale: Optional[bool] = key(None, None, "Gemma: embeddings x sqrt(d_model); null: the family's")
    norm_plus_one: Optional[bool] = key(None, None, "Gemma: RMSNorm gains applied as 1 + w; null: the family's")
    remat: str = key("none", REMAT_POLICIES, "what the backward recomputes (docs/performance.md)")
    scan_layers: Optional[bool] = key(None, None, "layers as one lax.scan; null: unroll up to 8 layers "
                                      "without remat, else scan")
    attention: str = key("auto", ATTENTION_IMPLS, "the attention implementation (models/attention.py)")
    attention_block: int = key(128, ">= 0", "manual attention's causal query block; 0: no blocking")
    kernels: str = key("auto", KERNELS, "plain math or XLA:CPU fast paths (models/fast_cpu.py); equal results")
    loss_chunk: Optional[int] = key(None, ">= 0", "tokens per cross-entropy chunk (models/loss.py); 0: whole "
                                    "logits; null: auto")
    init_from: Optional[str] = key(None, None, "parameters from `meshtrain export`, a run, or a Hugging Face "
                                   "model folder")
