"""Model config and presets (parameter and FLOP counting: models/counts.py)."""
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
    # Sliding-window attention (Mistral): a query sees only the keys fewer than this many positions before it,
    # itself included, in every attention path; None: the whole causal context
    window: int | None = None
    # Gemma's options (models/gemma.py), read by the pieces every family shares: embeddings x sqrt(d_model) in the
    # compute dtype; every RMSNorm gain stored as w and applied as (1 + w); the logits soft-capped as
    # cap * tanh(logits / cap) (in the tiled loss's forward and backward too)
    embed_scale: bool = False
    norm_plus_one: bool = False
    final_softcap: float | None = None
    # ... and the Gemma layer's own: attention scores soft-capped the same way; scores scaled by
    # query_scale ** -0.5 (query_pre_attn_scalar) instead of head_dim ** -0.5
    attn_softcap: float | None = None
    query_scale: float | None = None
    # Layers of two kinds (Gemma): True where a layer is local (attends through `window`), False where global;
    # None: every layer alike (`window`, if set, for all of them)
    local_layers: tuple[bool, ...] | None = None
    # Gemma 3: the local layers' RoPE base, and the global layers' linear RoPE factor (positions / factor)
    rope_local_theta: float | None = None
    rope_linear: float | None = None

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.local_layers is not None:
            object.__setattr__(self, "local_layers", tuple(bool(x) for x in self.local_layers))

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one (a window-length KV ring, block skipping); None for no
        window or a stack of local and global layers (masked layer by layer, a full-length cache)."""
        return self.window if self.local_layers is None else None

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
