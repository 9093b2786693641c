"""The data checks of a run's start, made before anything compiles by `meshtrain train` and `meshtrain plan` alike
(`check_data`: one function, so both say the same line): the data's tokenizer against model.init_from's (bytes for a
model with a tokenizer of its own, or another vocabulary; data.tokenizer_check=false when that is meant), a mixture's
sources of one tokenizer, documents for data.document_mask=true, preference pairs for train.objective=dpo and a
model.seq_len that holds each. They read sidecars, manifests, tokenizer files and a pair source's document index,
never the tokens; a source that does not exist is left to the run's loading (which says so).

Two tokenizers are the same when their vocabularies are (every token and its id, added tokens included): a
tokenizer.json written again with other formatting is the same tokenizer, one token more or moved is not."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from trainer.config import model_config
from trainer.config.mixture_entries import parse_entries
from trainer.data import remote
from trainer.data.batches import load_corpus, no_documents
from trainer.data.manifest import Where, is_manifest, read_manifest
from trainer.data.pairs import packed_pairs
from trainer.data.sidecars import beside, data_sidecar
from trainer.errors import UserError

BYTES = "bytes"  # the data's tokens are its bytes (builtin, text files, unprepared records)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    file: str  # its tokenizer.json (or the folder holding its files)
    vocab: str | None  # sha256 of its vocabulary; None where it cannot be read
    size: int | None  # tokens in it
    arg: str = ""  # what `meshtrain prepare --tokenizer` takes for it

    def __str__(self) -> str:
        return f"{self.file}, {self.size} tokens" if self.size else self.file


_VOCABULARIES: dict[str, tuple[str, int]] = {}  # a tokenizer.json's sha256 -> its vocabulary's, its size


def _vocabulary(text: str) -> tuple[str, int]:
    """(sha256 of the vocabulary, its size) of a tokenizer.json's text (a large one parses in a few tenths of a
    second: each file once per process)."""
    from tokenizers import Tokenizer as HF
    file = hashlib.sha256(text.encode()).hexdigest()
    if file not in _VOCABULARIES:
        vocab = HF.from_str(text).get_vocab(with_added_tokens=True)
        items = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
        _VOCABULARIES[file] = hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest(), len(vocab)
    return _VOCABULARIES[file]


def tokenizer_at(file: str, arg: str | None = None) -> Tokenizer:
    """The tokenizer in a tokenizer.json (local or a URL); its vocabulary None where it cannot be read."""
    try:
        text = remote.read_bytes(file).decode() if remote.is_url(file) else Path(file).read_text()
        vocab, size = _vocabulary(text)
    except Exception:  # a missing or unparsable file (the tokenizers library raises its own Exception type)
        vocab, size = None, None
    return Tokenizer(str(file), vocab, size, arg or str(file))


def _prepared(source: str) -> dict | None:
    """What a prepared source says of itself (its sidecar or manifest); None for any other source."""
    if source.endswith(".bin"):
        meta = data_sidecar(source)
        if not meta:
            return None
        return {"tokenizer": beside(source, meta["tokenizer"]["path"]), "pairs": bool(meta.get("pairs")),
                "prompts": bool(meta.get("prompts")), "sources": meta.get("sources") or [],
                "documents": bool(meta.get("document_index")) or meta.get("eot_id") is not None}
    if not is_manifest(source):
        return None
    m = read_manifest(source)
    return {"tokenizer": str(Where(source).at(m["tokenizer"]["path"])), "pairs": False, "documents": True,
            "prompts": any(e.get("prompts") for e in m["shards"]), "sources": m.get("sources") or []}


def _exists(source: str) -> bool:
    return source in ("builtin", "synthetic") or remote.is_url(source) or Path(source).exists()


def data_tokenizer(source: str) -> Tokenizer | str | None:
    """The tokenizer of a source's tokens: a prepared source's, BYTES for bytes, None where unknown (synthetic, a bare
    .bin, a source that does not exist)."""
    if source == "synthetic" or not _exists(source):
        return None
    meta = _prepared(source)
    if meta is not None:
        return tokenizer_at(meta["tokenizer"])
    return None if source.endswith(".bin") or remote.is_url(source) else BYTES


def _recorded(config_yaml: Path) -> Tokenizer | str | None:
    """The tokenizer a run or an export trained with, from its resolved config: data.tokenizer, or BYTES where its
    data was bytes."""
    import yaml
    data = (yaml.safe_load(config_yaml.read_text()) or {}).get("data") or {}
    if data.get("tokenizer"):
        return tokenizer_at(data["tokenizer"])
    source = str(data.get("source", "builtin"))
    if data.get("mixture") or source == "synthetic" or source.endswith(".bin") or remote.is_url(source):
        return None
    return BYTES


def model_tokenizer(init_from: str | None) -> Tokenizer | str | None:
    """The tokenizer model.init_from's weights know: a run's or an export's recorded one, an HF folder's own
    (tokenizer.json; other tokenizer files alone: one of unknown vocabulary); None where it has none we can tell."""
    if not init_from or remote.is_url(init_from) or not Path(init_from).is_dir():
        return None
    p = Path(init_from)
    if (p / "config.yaml").is_file():  # a run.dir or an export (meshtrain writes it; an HF folder has config.json)
        return _recorded(p / "config.yaml")
    if (p / "tokenizer.json").is_file():
        return tokenizer_at(str(p / "tokenizer.json"), init_from)
    if any((p / n).is_file() for n in ("tokenizer.model", "vocab.json")):
        return Tokenizer(str(p), None, None, init_from)
    return None


def _key(tok) -> str | None:
    return tok.vocab or tok.file if isinstance(tok, Tokenizer) else None


def same_tokenizer(names: list[str], toks: list):
    """One line where a mixture's sources have different tokenizers (bytes and a bare .bin: none)."""
    first = (names[0], _key(toks[0]))
    for n, tok in zip(names[1:], toks[1:]):
        if _key(tok) != first[1]:
            what = lambda s: f"tokenizer {s[:12]}" if s else "no tokenizer (bytes or a bare .bin)"  # noqa: E731
            raise UserError(f"data.mixture mixes tokenizers: '{first[0]}' has {what(first[1])}, '{n}' "
                            f"{what(_key(tok))}; prepare every source with one tokenizer (meshtrain prepare "
                            "--tokenizer FILE)")


def _prepare_line(sources: list[str], out: str, tok: Tokenizer) -> str:
    return f"meshtrain prepare {' '.join(sources) or 'SOURCE'} --out {out} --tokenizer {tok.arg}"


def _bytes_out(source: str) -> str:
    """Where the prepare a refusal suggests writes a bytes source's tokens."""
    return "builtin.bin" if source == "builtin" else str(Path(source.rstrip("/")).with_suffix(".bin"))


def check_tokenizer(init_from: str, what: str, source: str, data):
    """Items of a fine-tune that would train on the wrong tokens: bytes fed to a model with a tokenizer, or token
    ids of another vocabulary than the model's (`what` names the data: data.source 'X' or a mixture's source)."""
    model = model_tokenizer(init_from)
    if model is None or data is None or (model == BYTES and data == BYTES):
        return
    meant = "; data.tokenizer_check=false trains on them anyway"
    if data == BYTES:
        out = _bytes_out(source)
        raise UserError(f"model.init_from '{init_from}' has a tokenizer of its own ({model}) and {what} is bytes, "
                        f"which it would read as its token ids 0-255; prepare the data with the model's tokenizer: "
                        f"{_prepare_line([source], out, model)}, then train with data.source={out}{meant}")
    if model == BYTES:
        raise UserError(f"model.init_from '{init_from}' was trained on bytes (no tokenizer) and {what} holds token "
                        f"ids of the tokenizer {data}, which it would read as bytes; train it on bytes or start from "
                        f"a model of that tokenizer{meant}")
    if model.vocab and data.vocab and model.vocab != data.vocab:
        meta = _prepared(source) or {}
        raise UserError(f"{what} was prepared with the tokenizer {data} (vocabulary {data.vocab[:12]}) and "
                        f"model.init_from '{init_from}' has another, {model} (vocabulary {model.vocab[:12]}): the "
                        f"data's token ids mean other tokens to it; prepare the data with the model's tokenizer: "
                        f"{_prepare_line(meta.get('sources', []), 'NEW.bin', model)}{meant}")


def has_documents(source: str) -> bool | None:
    """Whether a source has documents (None: it does not exist): a folder, builtin, a prepared file do; a single
    text file, a bare .bin and synthetic are one stream."""
    if source == "synthetic":
        return False
    if not _exists(source):
        return None
    meta = _prepared(source)
    if meta is not None:
        return meta["documents"]
    return source == "builtin" or remote.is_url(source) or Path(source).is_dir()


def no_pairs(source: str) -> UserError:
    return UserError(f"train.objective=dpo trains on preference pairs, and data.source '{source}' has none; prepare "
                     "{prompt, chosen, rejected} records with meshtrain prepare, or set train.objective=lm")


def check_pairs(cfg):
    """train.objective=dpo: data.source holds preference pairs, each of which fits a row of model.seq_len (the
    lines the run's packing gives, from the same function)."""
    d = cfg.data
    if d.mixture:
        raise UserError("train.objective=dpo trains on one prepared .bin of preference pairs, and data.mixture mixes "
                        "sources (a mixture packs no pairs); give the pairs as data.source, or set train.objective=lm")
    if not _exists(d.source):
        return
    meta = _prepared(d.source) if d.source != "synthetic" else None
    if not (meta and meta["pairs"]):
        raise no_pairs(d.source)
    corpus = load_corpus(d.source, d.heldout_fraction, d.bin_dtype)  # memory maps: only the index is read
    packed_pairs(corpus, corpus.documents(), len(corpus.train), model_config(cfg).seq_len, cfg.train.eval_every > 0)


def check_data(cfg):
    """Every check of a run's data that can refuse it before anything compiles (see the module's docstring)."""
    d = cfg.data
    if cfg.train.objective == "grpo" and not (_exists(d.source) and _prepared(d.source)):
        return  # prompts read as they are, encoded with the run's tokenizer (trainer/data/prompts.py)
    sources, names, _ = parse_entries(d.mixture) if d.mixture else ([d.source], [d.source], None)
    compared = d.mixture or (d.tokenizer_check and cfg.model.init_from)  # a tokenizer is read only to compare it
    toks = [data_tokenizer(s) for s in sources] if compared else []
    if d.mixture:
        same_tokenizer(names, toks)
    if d.tokenizer_check and cfg.model.init_from:
        i = next((i for i, t in enumerate(toks) if t is not None), 0)
        what = f"data.mixture source '{names[i]}'" if d.mixture else f"data.source '{sources[i]}'"
        check_tokenizer(cfg.model.init_from, what, sources[i], toks[i])
    if d.document_mask:
        for s in sources:
            if has_documents(s) is False:
                raise no_documents(s)
    if cfg.train.objective == "dpo":
        check_pairs(cfg)
    for s in sources:
        if cfg.train.objective != "grpo" and _exists(s) and (_prepared(s) or {}).get("prompts"):
            raise UserError(f"{s} holds prompts alone (GRPO's, prepared with nothing to complete them), which "
                            f"train.objective={cfg.train.objective} cannot learn from; set train.objective=grpo, or "
                            "prepare records with completions")
