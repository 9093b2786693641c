"""A config's sources: what it points at, read in one step that every entry point (train, plan, simulate, generate,
export) calls after the pure `load_config`: a Hugging Face `model.init_from` folder's model shape keys
(checked against its tensors before anything is written) and a prepared .bin's sidecar (data.tokenizer,
data.bin_dtype and, unless set, model.vocab_size)."""
from __future__ import annotations

from trainer.ckpt.hf import with_hf_shapes
from trainer.config import Config, replace
from trainer.data.batches import needs_documents, read_sidecar, tokenizer_of


def resolve(cfg: Config, tensors: bool = True) -> Config:
    """cfg with what its model.init_from and data.source supply; an explicit key that contradicts them
    is a one-line error. Without `tensors` an HF folder's weight files are left unopened (a run checks
    them when it reads them, after its step compiled and fit)."""
    if cfg.model.init_from:
        cfg = with_hf_shapes(cfg, tensors)
    return _with_sidecar(cfg)


def _with_sidecar(cfg: Config) -> Config:
    meta = read_sidecar(cfg.data.source) if cfg.data.source.endswith(".bin") else None
    masked = bool(meta and meta.get("loss_mask"))
    if masked and cfg.data.document_mask is False:
        raise needs_documents(cfg.data.source)
    documents = {"document_mask": True} if masked else {}  # unset stays unset: false
    if not meta:
        return replace(cfg, data=documents)
    model = {} if cfg.model.vocab_size is not None else {"vocab_size": int(meta["vocab_size"])}
    return replace(cfg, data={"tokenizer": tokenizer_of(cfg.data.source, meta), "bin_dtype": meta["dtype"],
                              **documents}, model=model)
