"""The model's config and presets (parameter and FLOP counting: models/counts.py).

Each `model.*` key is declared once, as a field here (the keys every family shares) or of a family's own config (a
subclass of ModelConfig in the family's module, `ModelSpec.config`: Gemma's soft-caps and layer kinds): its default,
its allowed values and one line of meaning are the field's metadata (`key`), which the config schema reads
(trainer/config/model_section.py writes the `model:` section from them). What the trainer knows of its mesh (the platform,
the kv heads' replication) is not part of the config: the model takes it as an argument (models/layers.py
`Placement`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from models.spec import FAMILIES

REMAT_POLICIES = ("none", "full", "dots", "sublayer")
ATTENTION_IMPLS = ("auto", "manual", "xla", "cudnn")
KERNELS = ("auto", "reference", "fast")
# Ceilings of the range rules: sizes (array dimensions, token ids) are int32 in XLA; every float a step computes with
# is a float32, finite below float32's largest
INT32, FLOAT32 = "2**31-1", "3.4e38"
DIM = f"> 0 and <= {INT32}"  # a dimension, a count of tokens
POSITIVE = f"> 0 and <= {FLOAT32}"  # a float a step computes with


def key(default=dataclasses.MISSING, allowed=None, doc: str = "", null: bool = True):
    """A model.* key's field: its default; its allowed values (a rule for a number such as '> 0 and <= 2**31-1', a
    collection of choices, or None: any value of its type); one line of meaning; `null`: a config may leave it null
    (the preset's, the family's or an HF folder's value), else the config's default is this one."""
    return dataclasses.field(default=default, metadata={"allowed": allowed, "doc": doc, "null": null})


def is_key(f: dataclasses.Field) -> bool:
    """Whether a field of a model config is a model.* key (declared by `key`)."""
    return "null" in f.metadata


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: str = key("llama", None, "the model family; null: an HF init_from's, else llama")
    d_model: int = key(allowed=DIM, doc="the residual stream's width")
    n_layers: int = key(allowed="> 0 and <= 65536", doc="transformer layers (per-layer tables, such as Gemma's "
                        "layer kinds, are built on the host)")
    n_heads: int = key(allowed=DIM, doc="attention (query) heads")
    n_kv_heads: int = key(allowed=DIM, doc="key/value heads; fewer than n_heads: grouped-query attention")
    # Families such as Qwen3 and Gemma set their own (n_heads x head_dim need not equal d_model: the output
    # projection maps it back)
    head_dim: int | None = key(None, DIM, "one attention head's width (even); null: d_model / n_heads")
    d_ff: int = key(allowed=DIM, doc="the MLP's hidden units")
    vocab_size: int = key(allowed=DIM, doc="tokens of the vocabulary (embedding and output rows)")
    seq_len: int = key(allowed=DIM, doc="tokens per training sequence")
    tie_embeddings: bool = key(True, None, "the output head shares the embedding's weights")
    rope_theta: float = key(10000.0, POSITIVE, "RoPE base")
    norm_eps: float = key(1e-5, POSITIVE, "RMSNorm epsilon")
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), as transformers' `llama3` rope
    # type; its allowed values are a parser's (trainer/config/model_section.py)
    rope_scaling: tuple[float, float, float, int] | None = key(None, None, "Llama 3.x `llama3` RoPE scaling; null: "
                                                                "none")
    # a query sees only the keys fewer than this many positions before it, itself included, in every attention path
    # (a family whose layers differ in window says which layers have it: ModelSpec.windows)
    window: int | None = key(None, DIM, "sliding-window attention (Mistral): keys fewer than this many positions "
                             "back; null: no window")
    remat: str = key("none", REMAT_POLICIES, "what the backward recomputes (docs/performance.md)", null=False)
    # one lax.scan is one compiled layer (compile time independent of depth); unrolled, no loop: faster steps
    # (docs/performance.md)
    scan_layers: bool | None = key(None, None, "layers as one lax.scan; null: unroll up to 8 layers without remat, "
                                   "else scan")
    # auto = cuDNN's (bf16) or XLA's on GPU, manual on CPU and TPU
    attention: str = key("auto", ATTENTION_IMPLS, "the attention implementation (models/kernels/attention.py)", null=False)
    # each query block attends to the keys up to its last position (skips most of the masked half)
    attention_block: int | None = key(None, f">= 0 and <= {INT32}", "manual attention's causal query block; 0: no "
                                      "blocking; null: the platform's (models/kernels/attention.py BLOCK)")
    # the plain math of models/transformer.py or models/kernels/fast_cpu.py's XLA:CPU fast paths; auto = fast on CPU
    kernels: str = key("auto", KERNELS, "plain math or XLA:CPU fast paths (models/kernels/fast_cpu.py); equal results",
                       null=False)
    # the float32 logits are never whole; null: tile only when they would exceed 256 MB
    loss_chunk: int | None = key(None, f">= 0 and <= {INT32}", "tokens per cross-entropy chunk "
                                 "(models/objectives/cross_entropy.py); 0: whole logits; null: auto")
    # multi-token prediction (DeepSeek-V3's MTP, models/objectives/mtp.py): modules predicting 2, 3, ... tokens ahead
    mtp_depth: int = key(0, ">= 0 and <= 64", "multi-token prediction: modules, each one more token ahead; 0: none",
                         null=False)
    mtp_weight: float = key(0.3, f">= 0 and <= {FLOAT32}", "multi-token prediction: the weight of the mean over "
                            "depths of their losses (logged as aux/mtp_<d>)", null=False)
    init_std: float = 0.02
    # data.document_mask: attention stays inside each token's document (the batch's segment_ids) and RoPE takes each
    # token's position in it (positions); False: one document per row, positions 0..T-1
    documents: bool = False
    # train.objective=dpo: the preference loss and its settings (models/objectives/dpo.py Dpo); None: the token loss
    dpo: Any = None
    # train.objective=grpo: GRPO's loss and its settings (models/objectives/grpo.py Grpo); None: not GRPO
    grpo: Any = None
    # model.lora: low-rank adapters on a frozen base (models/lora.py Lora); None: every weight trained
    lora: Any = None

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one (a window-length KV ring, block skipping); None for no
        window or a stack whose layers differ in window (its family's `windows`: masked layer by layer, a
        full-length cache)."""
        spec = FAMILIES.get(self.family)
        return self.window if spec is None or spec.windows(self) is None else None

    @property
    def fused_qkv(self) -> bool:
        """q, k and v projected in one call: their weights have the same shape (the fast path shares a backward)."""
        return self.n_heads == self.n_kv_heads


def config_class(family: str) -> type:
    """The config class of a family: its own (ModelSpec.config), else ModelConfig."""
    spec = FAMILIES.get(family)
    return ModelConfig if spec is None or spec.config is None else spec.config


def own_keys(family: str) -> tuple[str, ...]:
    """The model.* keys a family declares beyond the shared ones (its config's own fields)."""
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    return tuple(f.name for f in dataclasses.fields(config_class(family)) if is_key(f) and f.name not in shared)


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
    """The preset's shapes with the overrides that are not None, in the config of the family they name (a family's
    own keys are fields of its config only)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset '{preset}'; choose one of {', '.join(PRESETS)}")
    kw = dict(PRESETS[preset])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return config_class(kw.get("family", "llama"))(**kw)
