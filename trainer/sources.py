"""A config's sources: what it points at, read in one step that every entry point (train, plan, simulate, generate,
export) calls after the pure `load_config`: a Hugging Face `model.init_from` folder's model shape keys
(checked against its tensors before anything is written) and a prepared .bin's sidecar (data.tokenizer,
data.bin_dtype and, unless set, model.vocab_size)."""
from __future__ import annotations

from trainer.ckpt.hf import with_hf_shapes
from trainer.config import Config, replace
from trainer.data.batches import read_sidecar, tokenizer_of


def resolve(cfg: Config) -> Config:
    """cfg with what its model.init_from and data.source supply; an explicit key that contradicts them
    is a one-line error."""
    if cfg.model.init_from:
        cfg = with_hf_shapes(cfg)
    return _with_sidecar(cfg)


def _with_sidecar(cfg: Config) -> Config:
    if not cfg.data.source.endswith(".bin") or not (meta := read_sidecar(cfg.data.source)):
        return cfg
    model = {} if cfg.model.vocab_size is not None else {"vocab_size": int(meta["vocab_size"])}
    return replace(cfg, data={"tokenizer": tokenizer_of(cfg.data.source, meta), "bin_dtype": meta["dtype"]},
                   model=model)
