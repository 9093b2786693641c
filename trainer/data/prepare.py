"""`meshtrain prepare`: text sources -> a token .bin (train documents, then held-out ones) and its JSON sidecar.

Documents are files; each goes to train or held-out by a hash of its name (trainer/data/batches.py's file split),
and an end-of-text token follows every document. The sidecar (DATA.bin.json) tells trainer/data/batches.py the
dtype, the vocabulary, the held-out token range and the bytes per token, and records the tokenizer. The
document index (DATA.bin.docs, named by the sidecar's `document_index`) holds the start offset of every
document, uint64, and the total token count last (one more entry than documents): the one source of document
boundaries, since end-of-text tokens may also occur inside a document (a chat template's turns).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.batches import _split_files, index_path, mask_path, sidecar_path, stdlib_files, template_path
from trainer.data.chat import load_template, parse_date
from trainer.data.records import Encoder, Kinds, is_records, kind_of, normalised, read
from trainer.data.writers import Bar, Split, mask_name, write_files, write_records
from trainer.errors import UserError

VERSION = 2  # 2: the document index
EOT = "<|endoftext|>"
EOS_NAMES = (EOT, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")
LOSS_ON = ("assistant", "all")  # --loss-on: the tokens a conversation's loss counts
PIECE = 1 << 22  # bytes of one document handed to the encoder at a time: bounds memory on huge files


@dataclass
class Doc:
    name: str  # source label + path inside it: what the split hashes and the input hash records
    path: Path
    size: int


def collect(sources: list[str], heldout: float) -> tuple[list[Doc], list[Doc], list[Doc]]:
    """Every source's files: text files split into train and held-out documents by a hash of their names,
    and record files (JSONL, Parquet), whose records are split one by one as they are read."""
    train, held, records = [], [], []
    for src in sources:
        if src == "builtin":
            root = Path(sysconfig.get_paths()["stdlib"])
            files = stdlib_files()
        else:
            p = Path(src)
            if not p.exists():
                raise UserError(f"source '{src}' does not exist; give text files, JSONL or Parquet files, folders "
                                "or builtin")
            root = p if p.is_dir() else p.parent
            files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        try:
            docs = {f: Doc(f"{src}:{f.relative_to(root)}", f, f.stat().st_size) for f in files}
        except OSError as e:
            raise UserError(f"source '{src}' cannot be read ({e.strerror or e}: {e.filename}); "
                            "give readable files") from None
        if sum(d.size for d in docs.values()) == 0:
            raise UserError(f"source '{src}' is empty (no bytes to tokenize); give files with text in them")
        records += [docs[f] for f in files if docs[f].size and is_records(f)]
        texts = [f for f in files if docs[f].size and not is_records(f)]
        if texts:
            tr, ho = _split_files(texts, root, heldout)
            train += [docs[f] for f in tr]
            held += [docs[f] for f in ho]
    return train, held, records


def _pieces(doc: Doc):
    """A document's text in pieces of about PIECE bytes, cut after a newline (a whole UTF-8 character)."""
    with open(doc.path, "rb") as f:
        rest = b""
        while chunk := f.read(PIECE):
            buf = rest + chunk
            cut = buf.rfind(b"\n") + 1 or len(buf)  # no newline at all: cut anyway, memory stays bounded
            rest = buf[cut:]
            yield buf[:cut].decode("utf-8", errors="replace"), cut
        if rest:
            yield rest.decode("utf-8", errors="replace"), len(rest)


def _texts(docs: list[Doc], records: list[Doc], enc: Encoder):
    """The text a tokenizer is trained on: the files' pieces, each record's text (conversations rendered)."""
    for d in docs:
        for text, _ in _pieces(d):
            yield text
    for d in records:
        for where, rec, _ in read(d.path):
            kind = kind_of(rec := normalised(rec), where, enc.field)
            yield enc.render(where, kind, rec)[0]


def sha256_file(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_tokenizer(path: str):
    """(Tokenizer, its tokenizer.json path, end-of-text id) from a tokenizer.json or a folder holding one."""
    from tokenizers import Tokenizer
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        raise UserError(f"--tokenizer '{path}' is not a tokenizer.json file or a folder holding one; "
                        "give a Hugging Face tokenizer.json or use --train-tokenizer VOCAB_SIZE")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # the library raises its own Exception type for any unparsable file
        raise UserError(f"--tokenizer '{path}' is not a tokenizer ({str(e).splitlines()[0][:120]}); give a "
                        "Hugging Face tokenizer.json or use --train-tokenizer VOCAB_SIZE") from None
    return tok, p, _eos_id(tok, p, path)


def _eos_id(tok, p: Path, path: str) -> int:
    names = list(EOS_NAMES)
    try:  # an HF folder names its eos token in tokenizer_config.json
        eos = json.loads((p.parent / "tokenizer_config.json").read_text()).get("eos_token")
        names.insert(0, eos.get("content") if isinstance(eos, dict) else eos)
    except (OSError, ValueError, AttributeError):
        pass
    for name in names:
        if isinstance(name, str) and (i := tok.token_to_id(name)) is not None:
            return i
    raise UserError(f"--tokenizer '{path}' has no end-of-text token (none of {', '.join(EOS_NAMES)}, nor "
                    "tokenizer_config.json's eos_token); add one to it or use --train-tokenizer VOCAB_SIZE")


def train_tokenizer(texts, vocab_size: int, length: int):
    """A byte-level BPE trained on the texts, with EOT as its one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=length)
    return tok


def inputs_hash(train: list[Doc], held: list[Doc], settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for part, docs in (("train", train), ("heldout", held)):
        for d in docs:
            h.update(f"{part}\0{d.name}\0{d.size}\0{sha256_file(d.path)}\n".encode())
    return h.hexdigest()


def _up_to_date(out: Path, digest: str, require_counted: bool) -> bool:
    try:
        meta = json.loads(sidecar_path(out).read_text())
        if require_counted and meta.get("records", {}).get("uncounted"):
            return False  # prepared again, to stop at the first such record
        tok = Path(meta["tokenizer"]["path"])
        tok = tok if tok.is_absolute() else out.parent / tok
        index = out.parent / meta["document_index"]["path"]
        mask = meta.get("loss_mask")
        if mask and (out.parent / mask["path"]).stat().st_size != meta["tokens"]["total"]:
            return False
        return (meta.get("inputs_sha256") == digest and sha256_file(tok) == meta["tokenizer"]["sha256"]
                and out.stat().st_size == meta["tokens"]["total"] * np.dtype(meta["dtype"]).itemsize
                and index.stat().st_size == 8 * meta["document_index"]["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prepare(sources: list[str], out: str, tokenizer: str | None = None, train_vocab: int | None = None,
            heldout: float = 0.05, log=print, show_progress: bool = True, field: str = "text",
            chat_template: str | None = None, date: str | None = None, loss_on: str = "assistant",
            require_counted: bool = False) -> dict:
    """Tokenize the sources into `out` and its sidecar; returns the sidecar (`skipped`: it was up to date)."""
    # require_counted: a record without a token the loss counts is an error; else it is kept and counted
    if (tokenizer is None) == (train_vocab is None):
        raise UserError("give exactly one of --tokenizer PATH and --train-tokenizer VOCAB_SIZE")
    if train_vocab is not None and not 257 <= train_vocab <= 2**32:
        raise UserError(f"--train-tokenizer {train_vocab} is too small; a byte-level BPE needs at least 257 "
                        "tokens (256 bytes and the end-of-text token); use e.g. 4096")
    if not 0 <= heldout < 1:
        raise UserError(f"--heldout {heldout} must be in [0, 1); e.g. 0.05")
    if loss_on not in LOSS_ON:
        raise UserError(f"--loss-on {loss_on} is unknown; choose one of {', '.join(LOSS_ON)}")
    if not sources:
        raise UserError("give at least one source: text files, folders or builtin")
    out_p = Path(out)
    if out_p.suffix != ".bin":
        raise UserError(f"--out '{out}' must end in .bin (data.source tells token files by that suffix)")
    day = parse_date(date)
    train_docs, held_docs, record_docs = collect(sources, heldout)
    given = load_tokenizer(tokenizer) if tokenizer else None
    template = load_template(given[1] if given else None, chat_template, day)
    settings = {"version": VERSION, "sources": sources, "heldout": heldout, "train_vocab": train_vocab,
                "tokenizer_sha256": given and sha256_file(given[1])}
    if record_docs:  # what else decides a record file's tokens (a text-only prepare hashes as it always did)
        settings.update(field=field, loss_on=loss_on, date=day.isoformat(),
                        chat_template=template and template.sha256)
    digest = inputs_hash(train_docs, held_docs + record_docs, settings)
    if _up_to_date(out_p, digest, require_counted):
        log(f"skipped: {out} is up to date (same inputs and settings as its {sidecar_path(out_p).name})")
        return {**json.loads(sidecar_path(out_p).read_text()), "skipped": True}

    out_p.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    enc = Encoder(None, -1, template, loss_on, field, require_counted)
    if given:
        tok, tok_path, eot = given
    else:
        log(f"training a byte-level BPE tokenizer ({train_vocab} tokens) on {len(train_docs)} documents"
            + (f" and {len(record_docs)} record files" if record_docs else ""))
        tok = train_tokenizer(_texts(train_docs, record_docs, enc), train_vocab, len(train_docs) + len(record_docs))
        tok_path, eot = out_p.parent / "tokenizer.json", tok.token_to_id(EOT)
    enc.tok, enc.eot = tok, eot
    train_s = time.perf_counter() - t0
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    progress = Progress(TextColumn("tokenizing"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                        TextColumn("{task.fields[tokens]:,} tokens | {task.fields[rate]}"), TimeRemainingColumn(),
                        console=Console(stderr=True), disable=not show_progress)
    names = _Names(out_p)
    t1 = time.perf_counter()
    kinds, splits = Kinds(), []
    try:
        train, held = splits[:] = (Split(names.tokens, dtype, bool(record_docs)),
                                   Split(names.held, dtype, bool(record_docs)))
        with progress:
            bar = Bar(progress, sum(d.size for d in train_docs + held_docs + record_docs), (train, held))
            write_files(tok, train_docs, eot, train, bar, _pieces)
            write_files(tok, held_docs, eot, held, bar, _pieces)
            for d in record_docs:
                write_records(enc, d, heldout, train, held, kinds, bar)
        train.close()
        held.close()
        encode_s = time.perf_counter() - t1
        masked = bool(kinds.conversations or kinds.exchanges)
        _check_splits(record_docs, kinds, train, held, heldout, masked, names)
        meta = _finish(names, out_p, train, held, masked, tok, tok_path, given is not None, eot, vocab, dtype,
                       template if masked else None, sources, heldout, digest, kinds, day, loss_on,
                       {"train_tokenizer": round(train_s, 2), "encode": round(encode_s, 2)}, encode_s)
    finally:
        for split in splits:  # closed already unless something failed on the way
            split.close()
        names.clean()
    if masked:
        log(f"{kinds.conversations:,} conversations, {kinds.exchanges:,} exchanges, {kinds.text:,} text records; "
            f"{meta['loss_mask']['counted']['train']:,} train tokens counted in the loss ({loss_on})"
            + (f"; {kinds.uncounted:,} records kept without a counted token (the first: {kinds.first_uncounted}; "
               "--require-counted makes them errors)" if kinds.uncounted else ""))
    log(f"wrote {out}: {meta['tokens']['total']:,} {dtype.name} tokens ({train.n:,} train, {held.n:,} held-out) from "
        f"{train.docs + held.docs} documents, {meta['bytes_per_token']:.3f} bytes/token, vocab {vocab}; "
        f"{'tokenizer trained in ' + f'{train_s:.1f}s, ' if not given else ''}encoded in {encode_s:.1f}s "
        f"({meta['tokens_per_sec']:,} tokens/s)")
    return meta


class _Names:
    """The temporary files a prepare writes, renamed into place at the end or removed."""

    def __init__(self, out: Path):
        self.out = out
        self.tokens = out.with_name(out.name + ".tmp")
        self.held = out.with_name(out.name + ".heldout.tmp")
        self.tokenizer = out.parent / "tokenizer.json.tmp"
        # each final file beside the .bin -> its temporary name
        self.staged = {p: p.with_name(p.name + ".tmp") for p in (index_path(out), sidecar_path(out), mask_path(out),
                                                                 template_path(out))}

    def all(self):
        return [self.tokens, self.held, mask_name(self.tokens), mask_name(self.held), self.tokenizer,
                *self.staged.values()]

    def clean(self):
        for p in self.all():
            p.unlink(missing_ok=True)


def _check_splits(record_docs, kinds: Kinds, train: Split, held: Split, heldout: float, masked: bool, names: _Names):
    n = kinds.total
    none = (f"{kinds.uncounted:,} of the {n:,} records have no assistant turn the template marks (the first: "
            f"{kinds.first_uncounted}); add assistant turns, or use --loss-on all")
    if masked and not train.counted:
        raise UserError("the loss mask counts no token of the training split: " + (
            none if train.docs else f"--heldout {heldout} holds out all {n:,} records; use a smaller --heldout"))
    if record_docs and heldout > 0 and held.docs == 0:
        raise UserError(f"--heldout {heldout} held out none of the {n:,} records (a record is held out by a hash "
                        "of its content); use a larger --heldout, more records, or --heldout 0 to hold out none")
    if masked and held.docs and not held.counted:
        raise UserError(f"the loss mask counts no token of the held-out split ({held.docs:,} records), so eval would "
                        f"measure nothing: {none}, or another --heldout")


def _append(dst: Path, src: Path):
    with open(dst, "ab") as f, open(src, "rb") as g:
        shutil.copyfileobj(g, f, 1 << 24)


def _finish(names: _Names, out_p: Path, train: Split, held: Split, masked: bool, tok, tok_path: Path, given: bool,
            eot: int, vocab: int, dtype, template, sources, heldout, digest, kinds: Kinds, day, loss_on,
            seconds: dict, encode_s: float) -> dict:
    """Join the splits, write the index, the mask and the sidecar under temporary names, then rename them all."""
    _append(names.tokens, names.held)
    total = train.n + held.n
    index = np.asarray([0] + train.ends + [train.n + e for e in held.ends], np.uint64)
    assert len(index) == train.docs + held.docs + 1 and int(index[-1]) == total
    tmp = names.staged
    index.tofile(tmp[index_path(out_p)])
    mask_meta = None
    if masked:
        mask_tmp = mask_name(names.tokens)
        _append(mask_tmp, mask_name(names.held))
        os.replace(mask_tmp, tmp[mask_path(out_p)])
        mask_meta = {"path": mask_path(out_p).name, "dtype": "uint8", "loss_on": loss_on,
                     "counted": {"train": train.counted, "heldout": held.counted}}
        if template is not None:
            tmp[template_path(out_p)].write_text(template.text)
    if not given:
        tok.save(str(names.tokenizer))
        os.replace(names.tokenizer, tok_path)
    rel = tok_path.resolve().relative_to(out_p.parent.resolve()) if tok_path.resolve().is_relative_to(
        out_p.parent.resolve()) else tok_path.resolve()
    meta = {
        "format": "meshtrain-tokens", "version": VERSION, "dtype": dtype.name, "vocab_size": vocab, "eot_id": eot,
        "tokenizer": {"path": str(rel), "sha256": sha256_file(tok_path), "trained": not given},
        "documents": {"train": train.docs, "heldout": held.docs},
        "document_index": {"path": index_path(out_p).name, "dtype": "uint64", "entries": len(index)},
        "tokens": {"train": train.n, "heldout": held.n, "total": total},
        "bytes": {"train": train.bytes, "heldout": held.bytes},
        "bytes_per_token": (train.bytes + held.bytes) / total,
        "heldout_bytes_per_token": held.bytes / held.n if held.n else None,
        "heldout_range": [train.n, total], "sources": sources, "heldout_fraction": heldout,
        "seconds": seconds, "tokens_per_sec": round(total / max(encode_s, 1e-9)), "inputs_sha256": digest,
    }
    if masked:
        meta["loss_mask"] = mask_meta
        meta["records"] = {"text": kinds.text, "conversations": kinds.conversations, "exchanges": kinds.exchanges,
                           "uncounted": kinds.uncounted}
        meta["chat_template"] = template and {"path": template_path(out_p).name, "source": template.source,
                                              "sha256": template.sha256,
                                              "generation_blocks": template.blocks, "date": day.isoformat()}
    tmp[sidecar_path(out_p)].write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(names.tokens, out_p)
    for final, t in tmp.items():  # the sidecar last: it names the others
        if t.exists() and final != sidecar_path(out_p):
            os.replace(t, final)
    os.replace(tmp[sidecar_path(out_p)], sidecar_path(out_p))
    return meta
