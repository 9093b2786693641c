"""A config's sources: what it points at, read in one step that every entry point (train, plan, simulate, generate,
export) calls after the pure `load_config`: a Hugging Face `model.init_from` folder's model shape keys
(checked against its tensors before anything is written) and a prepared .bin's sidecar or a folder's manifest
(data.tokenizer, data.bin_dtype and, unless set, model.vocab_size; a mixture's: the first source's tokenizer and the
largest vocabulary)."""
from __future__ import annotations

import logging

from trainer.ckpt.hf import with_hf_shapes
from trainer.config import Config, replace
from trainer.config.mixture_entries import parse_entries
from trainer.config.widths import padded_vocab
from trainer.data import remote
from trainer.data.batches import needs_documents, read_sidecar, tokenizer_of
from trainer.data.manifest import Where, is_manifest, read_manifest

log = logging.getLogger(__name__)


def resolve(cfg: Config, tensors: bool = True) -> Config:
    """cfg with what its model.init_from and data.source supply; an explicit key that contradicts them
    is a one-line error. Without `tensors` an HF folder's weight files are left unopened (a run checks
    them when it reads them, after its step compiled and fit)."""
    url = cfg.model.init_from and remote.is_url(cfg.model.init_from)
    if url and not remote.exists(remote.join(cfg.model.init_from, "checkpoints")):  # a run's are read in place
        cfg = replace(cfg, model={"init_from": str(remote.mirror(cfg.model.init_from))})
    if cfg.model.init_from:
        cfg = with_hf_shapes(cfg, tensors)
    return _with_sidecar(cfg)


def _meta(source: str) -> dict | None:
    """What a prepared source says of itself: (vocab_size, tokenizer path from here, dtype, loss mask or not), from a
    .bin's sidecar or a folder's manifest and first shard; None for any other source."""
    url = remote.is_url(source)
    if source.endswith(".bin"):
        meta = read_sidecar(source) if not url else remote.read_json(source + ".json")
        return meta and {"vocab_size": int(meta["vocab_size"]), "tokenizer": tokenizer_of(source, meta) if not url
                         else remote.join(source.rpartition("/")[0], meta["tokenizer"]["path"]),
                         "dtype": meta["dtype"], "masked": bool(meta.get("loss_mask"))}
    if not is_manifest(source):
        return None
    m = read_manifest(source)
    where = Where(source)
    first = where.json(m["shards"][0]["path"] + ".json")
    return {"vocab_size": int(m["vocab_size"]), "tokenizer": str(where.at(m["tokenizer"]["path"])),
            "dtype": first.get("dtype", "uint16"), "masked": any(e.get("loss_mask") for e in m["shards"])}


def _with_sidecar(cfg: Config) -> Config:
    if cfg.data.mixture:  # the sources share a tokenizer (checked as they load): the first's, the largest vocabulary
        metas = [m for src in parse_entries(cfg.data.mixture)[0] if (m := _meta(src))]
        model = {} if cfg.model.vocab_size is not None or not metas else {
            "vocab_size": _vocab(cfg, max(m["vocab_size"] for m in metas))}
        return replace(cfg, data={"tokenizer": metas[0]["tokenizer"]} if metas else {}, model=model)
    meta = _meta(cfg.data.source)
    masked = bool(meta and meta["masked"])
    if masked and cfg.data.document_mask is False:
        raise needs_documents(cfg.data.source)
    documents = {"document_mask": True} if masked else {}  # unset stays unset: false
    if not meta:
        return replace(cfg, data=documents)
    model = {} if cfg.model.vocab_size is not None else {"vocab_size": _vocab(cfg, meta["vocab_size"])}
    return replace(cfg, data={"tokenizer": meta["tokenizer"], "bin_dtype": meta["dtype"], **documents}, model=model)


def _vocab(cfg: Config, vocab: int) -> int:
    """model.vocab_size for the data's vocabulary of `vocab` tokens: padded up to a multiple of mesh.model, which
    splits the embedding and output rows, with a line saying so (mesh.model=-1: left as it is, validation names
    the size to set)."""
    ranks = cfg.mesh.model
    if ranks <= 0 or vocab % ranks == 0:
        return vocab
    padded = padded_vocab(vocab, ranks)
    log.warning(f"model.vocab_size={padded}: the data's vocabulary of {vocab} tokens padded up to a multiple of "
                f"mesh.model={ranks} ({padded - vocab} rows no token uses; an explicit model.vocab_size overrides)")
    return padded
