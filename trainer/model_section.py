"""The `model:` section of the config schema (trainer/config.py)."""
from __future__ import annotations

import dataclasses
from typing import List, Optional


@dataclasses.dataclass(frozen=True)
class ModelSection:
    preset: str = "small"
    family: Optional[str] = None  # models/spec.py's registry; null: an HF init_from's, else llama
    d_model: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None  # one attention head's width; null: d_model / n_heads
    d_ff: Optional[int] = None
    vocab_size: Optional[int] = None
    seq_len: Optional[int] = None
    tie_embeddings: Optional[bool] = None
    rope_theta: Optional[float] = None
    norm_eps: Optional[float] = None
    rope_scaling: Optional[List[float]] = None  # llama3 [factor, low_freq, high_freq, original_max_positions]
    window: Optional[int] = None  # sliding-window attention (Mistral): keys fewer than this many positions back
    # Gemma's (models/gemma.py; an HF import sets them): local (true) / global (false) per layer, RoPE of the local
    # layers and the global ones' linear factor, soft-caps, the attention's query_pre_attn_scalar, sqrt(d) x
    # embeddings, (1 + w) norm gains
    local_layers: Optional[List[bool]] = None
    rope_local_theta: Optional[float] = None
    rope_linear: Optional[float] = None
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    query_scale: Optional[float] = None
    embed_scale: Optional[bool] = None
    norm_plus_one: Optional[bool] = None
    remat: str = "none"  # none | full | dots | sublayer
    scan_layers: Optional[bool] = None  # null: unroll up to 8 layers without remat, else scan (docs/performance.md)
    attention: str = "auto"  # auto | manual | xla | cudnn (models/attention.py)
    attention_block: int = 128  # manual attention's causal query block (0 = no blocking)
    kernels: str = "auto"  # auto | reference | fast: plain math or XLA:CPU fast paths (models/fast_cpu.py)
    loss_chunk: Optional[int] = None  # tokens per cross-entropy chunk (models/loss.py); 0 = whole logits; null: auto
    init_from: Optional[str] = None  # parameters from `meshtrain export`, a run, or a Hugging Face model folder
