"""Model config, presets, and parameter / FLOP counting.

FLOP convention (used for MFU everywhere in meshtrain):
  training FLOPs per token = 6 * N  +  6 * L * T * H * Dh
  N   = parameters that take part in matmuls (attention and MLP weights of every layer,
        plus the output head; the embedding lookup is a gather and norms are elementwise,
        so neither is counted). A tied head counts its V*D once, as the head.
  6   = 2 FLOPs per multiply-add x (1 forward + 2 backward).
  attention: QK^T and PV are 2 * 2 * T * Dh FLOPs per head per token forward; x3 for
        training gives 12 * L * T * H * Dh; causal masking halves the useful work -> 6.
Remat recomputation is not model FLOPs; `hardware_flops_per_token` adds it.
"""
from __future__ import annotations

import dataclasses

REMAT_POLICIES = ("none", "full", "dots", "sublayer")
ATTENTION_IMPLS = ("auto", "manual", "xla", "cudnn")
KERNELS = ("auto", "reference", "fast")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Llama 3.x RoPE frequency scaling, as transformers' `llama3` rope type:
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings); None = plain RoPE
    rope_scaling: tuple[float, float, float, int] | None = None
    remat: str = "none"
    init_std: float = 0.02
    # Run the layers as one lax.scan (one compiled layer: compile time independent of depth) or
    # unrolled (no loop: faster steps, see docs/performance.md). None: unroll up to 8 layers
    # when there is no remat, else scan.
    scan_layers: bool | None = None
    # auto | manual | xla | cudnn (models/attention.py); auto = cuDNN's (bf16) or XLA's on GPU,
    # manual on CPU, XLA's on TPU
    attention: str = "auto"
    # manual attention: queries in blocks of this many positions, each against the keys up to
    # its last position (skips most of the masked half); 0 = one block
    attention_block: int = 128
    # auto | reference | fast: the plain math of models/transformer.py or models/fast_cpu.py's
    # XLA:CPU fast paths (equal results); auto = fast on CPU, reference elsewhere
    kernels: str = "auto"
    # Set by the trainer when there are fewer kv heads than tensor-parallel ranks (their weights are
    # replicated): k and v are repeated this many times before attention, so that each rank holds
    # the kv head of its query heads, split like them (cuDNN's kernel takes q, k, v split alike only).
    kv_repeat: int = 1
    # The platform the program is built for ("cpu", "gpu", "tpu"): the kernels and the attention are that
    # platform's. Set by the trainer from its mesh's devices (a TPU topology compiled ahead of time on a CPU
    # host is "tpu"); None: the runtime's default device.
    platform: str | None = None
    # Documents (data.document_mask): attention stays inside each token's document (the batch's segment_ids)
    # and RoPE takes each token's position in it (positions); False: one document per row, positions 0..T-1
    documents: bool = False
    # Cross-entropy tiled over chunks of this many tokens (models/loss.py): the float32 logits
    # are never whole. 0 = whole logits; None = tile only when they would exceed 256 MB.
    loss_chunk: int | None = None
    # Width of one attention head; None: d_model // n_heads. Families such as Qwen3 and Gemma set their own
    # (n_heads x head_dim need not equal d_model: the output projection maps it back).
    head_dim: int | None = None
    # The family (models/spec.py) whose inventory and layer function the model runs
    family: str = "llama"

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)

    @property
    def target_platform(self) -> str:
        """The platform the program is built for: `platform`, else the runtime's default device's."""
        import jax
        return self.platform or jax.devices()[0].platform

    @property
    def fused_qkv(self) -> bool:
        """q, k and v projected in one call: their weights have the same shape (the fast path shares a backward)."""
        return self.n_heads == self.n_kv_heads


PRESETS: dict[str, dict] = {
    # tests: tiny widths so that every layout compiles in seconds
    "tiny": dict(d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128, vocab_size=256, seq_len=32),
    # the default run: ~3.2M parameters, learns the built-in corpus in minutes on a 2-core CPU
    "small": dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=768, vocab_size=256, seq_len=128),
    "125m": dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=2048, vocab_size=32000,
                 seq_len=2048),
    "1b": dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, vocab_size=32000,
               seq_len=2048, tie_embeddings=True),
    # Llama-2-7B shapes
    "7b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008, vocab_size=32000,
               seq_len=4096, tie_embeddings=False),
}


def from_preset(preset: str, **overrides) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset '{preset}'; choose one of {', '.join(PRESETS)}")
    kw = dict(PRESETS[preset])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(**kw)


def layer_matmul_params(c: ModelConfig) -> int:
    attn = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    mlp = 3 * c.d_model * c.d_ff
    return attn + mlp


def param_count(c: ModelConfig) -> int:
    """All parameters (embedding, norms and head included)."""
    per_layer = layer_matmul_params(c) + 2 * c.d_model
    head = 0 if c.tie_embeddings else c.d_model * c.vocab_size
    return c.vocab_size * c.d_model + c.n_layers * per_layer + c.d_model + head


def matmul_param_count(c: ModelConfig) -> int:
    """N of the FLOP convention: layer matmul weights plus the output head."""
    return c.n_layers * layer_matmul_params(c) + c.d_model * c.vocab_size


def flops_per_token(c: ModelConfig, seq_len: int | None = None) -> float:
    """Model training FLOPs per token (the convention above)."""
    t = seq_len or c.seq_len
    return 6 * matmul_param_count(c) + 6 * c.n_layers * t * c.n_heads * c.head_dim


def hardware_flops_per_token(c: ModelConfig, seq_len: int | None = None) -> float:
    """FLOPs executed per token, counting remat's recomputed forward (same convention).

    full: the layer forward runs again, except its last projection (w_down), whose output the
    backward pass does not need; dots: projection outputs are saved, but the attention
    score/value products (batched dots) are recomputed; sublayer: as full, less the attention's
    output projection too (each half's backward needs its input, not its output).
    """
    t = seq_len or c.seq_len
    attn_fwd = 2 * c.n_layers * t * c.n_heads * c.head_dim
    full = 2 * c.n_layers * (layer_matmul_params(c) - c.d_model * c.d_ff) + attn_fwd
    wo = 2 * c.n_layers * c.n_heads * c.head_dim * c.d_model
    extra = {"none": 0, "full": full, "dots": attn_fwd, "sublayer": full - wo}[c.remat]
    return flops_per_token(c, seq_len) + extra
