"""The `model:` section of the config schema (trainer/sections.py); null keys take the preset's (or family's) value."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from models import FAMILIES, PRESETS, REMAT_POLICIES
from models.config import ATTENTION_IMPLS, KERNELS
from trainer.errors import UserError
from trainer.schema import FLOAT32, INT32, POSITIVE, Form, check_choice, in_range, setting

DIM = f"> 0 and <= {INT32}"  # a dimension, a count of tokens: int32 in XLA


def _rope_scaling(v, name: str):
    """transformers' llama3 rules: factor >= 1, 0 < low_freq_factor < high_freq_factor (the band between them is
    interpolated, divided by their difference), an original context length that is a whole number of tokens."""
    v = list(v)
    if len(v) != 4 or not all(in_range(abs(x), f"<= {FLOAT32}") for x in v):  # nan and inf fail the range
        why = f"has {len(v)} numbers" if len(v) != 4 else "holds a number that is not finite in float32"
    elif v[0] < 1:
        why = f"factor {v[0]} is below 1 (it would shorten the context)"
    elif not 0 < v[1] < v[2]:
        why = f"low_freq_factor {v[1]} and high_freq_factor {v[2]} are not 0 < low < high"
    elif v[3] != int(v[3]) or not in_range(v[3], DIM):
        why = f"original_max_position_embeddings {v[3]} is not a whole number of tokens in {DIM}"
    else:
        return
    raise UserError(f"{name}={v} {why}; give [factor >= 1, low_freq_factor > 0, high_freq_factor > low_freq_factor, "
                    "original_max_position_embeddings (an integer >= 1)], e.g. Llama 3.1's [8, 1, 4, 8192]")


# the built-in families for the docs; a family registered later (a plug-in) is accepted too
FAMILY = Form(f"{', '.join(FAMILIES)} (models/spec.py's registry)", lambda v, k: check_choice(k, v, FAMILIES))
ROPE_SCALING = Form("[factor >= 1, low_freq_factor > 0, high_freq_factor > low_freq_factor, "
                    "original_max_position_embeddings (an integer >= 1)]", _rope_scaling)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    preset: str = setting("small", PRESETS, "the shapes (models/config.py); explicit model.* keys override them")
    family: Optional[str] = setting(None, FAMILY, "the model family; null: an HF init_from's, else llama")
    d_model: Optional[int] = setting(None, DIM, "the residual stream's width")
    n_layers: Optional[int] = setting(None, "> 0 and <= 65536", "transformer layers (per-layer tables, such as "
                                      "Gemma's layer kinds, are built on the host)")
    n_heads: Optional[int] = setting(None, DIM, "attention (query) heads")
    n_kv_heads: Optional[int] = setting(None, DIM, "key/value heads; fewer than n_heads: grouped-query attention")
    head_dim: Optional[int] = setting(None, DIM, "one attention head's width (even); null: d_model / n_heads")
    d_ff: Optional[int] = setting(None, DIM, "the MLP's hidden units")
    vocab_size: Optional[int] = setting(None, DIM, "tokens of the vocabulary (embedding and output rows)")
    seq_len: Optional[int] = setting(None, DIM, "tokens per training sequence")
    tie_embeddings: Optional[bool] = setting(None, None, "the output head shares the embedding's weights")
    rope_theta: Optional[float] = setting(None, POSITIVE, "RoPE base")
    norm_eps: Optional[float] = setting(None, POSITIVE, "RMSNorm epsilon")
    rope_scaling: Optional[List[float]] = setting(None, ROPE_SCALING, "Llama 3.x `llama3` RoPE scaling; null: none")
    window: Optional[int] = setting(None, DIM, "sliding-window attention (Mistral): keys fewer than this many "
                                    "positions back; null: no window")
    # Gemma's (models/gemma.py; an HF import sets them)
    local_layers: Optional[List[bool]] = setting(None, None, "Gemma: per layer, true local (model.window) or false "
                                                 "global; null: every layer alike")
    rope_local_theta: Optional[float] = setting(None, POSITIVE, "Gemma 3: the local layers' RoPE base; null: "
                                                "rope_theta")
    rope_linear: Optional[float] = setting(None, POSITIVE, "Gemma 3: the global layers' linear RoPE factor; null: "
                                           "none")
    attn_softcap: Optional[float] = setting(None, POSITIVE, "Gemma: attention scores soft-capped at this; null: none")
    final_softcap: Optional[float] = setting(None, POSITIVE, "Gemma: output logits soft-capped at this; null: none")
    query_scale: Optional[float] = setting(None, POSITIVE, "Gemma: scores scaled by query_scale ** -0.5; null: "
                                           "head_dim")
    embed_scale: Optional[bool] = setting(None, None, "Gemma: embeddings x sqrt(d_model); null: the family's")
    norm_plus_one: Optional[bool] = setting(None, None, "Gemma: RMSNorm gains applied as 1 + w; null: the family's")
    remat: str = setting("none", REMAT_POLICIES, "what the backward recomputes (docs/performance.md)")
    scan_layers: Optional[bool] = setting(None, None, "layers as one lax.scan; null: unroll up to 8 layers "
                                          "without remat, else scan")
    attention: str = setting("auto", ATTENTION_IMPLS, "the attention implementation (models/attention.py)")
    attention_block: int = setting(128, f">= 0 and <= {INT32}", "manual attention's causal query block; 0: no "
                                   "blocking")
    kernels: str = setting("auto", KERNELS, "plain math or XLA:CPU fast paths (models/fast_cpu.py); equal results")
    loss_chunk: Optional[int] = setting(None, f">= 0 and <= {INT32}", "tokens per cross-entropy chunk "
                                        "(models/loss.py); 0: whole logits; null: auto")
    init_from: Optional[str] = setting(None, None, "parameters from `meshtrain export`, a run, or a Hugging Face "
                                       "model folder")
