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
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.batches import _split_files, index_path, sidecar_path, stdlib_files
from trainer.errors import UserError

VERSION = 2  # 2: the document index
EOT = "<|endoftext|>"
EOS_NAMES = (EOT, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")
PIECE = 1 << 22  # bytes of one document handed to the encoder at a time: bounds memory on huge files
BATCH = 1 << 23  # bytes per encode_batch call (the library encodes a batch's texts in parallel)


@dataclass
class Doc:
    name: str  # source label + path inside it: what the split hashes and the input hash records
    path: Path
    size: int


def collect(sources: list[str], heldout: float) -> tuple[list[Doc], list[Doc]]:
    """Every source's files, split into train and held-out documents by a hash of their names."""
    train, held = [], []
    for src in sources:
        if src == "builtin":
            root = Path(sysconfig.get_paths()["stdlib"])
            files = stdlib_files()
        else:
            p = Path(src)
            if not p.exists():
                raise UserError(f"source '{src}' does not exist; give text files, folders or builtin")
            root = p if p.is_dir() else p.parent
            files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        try:
            docs = {f: Doc(f"{src}:{f.relative_to(root)}", f, f.stat().st_size) for f in files}
        except OSError as e:
            raise UserError(f"source '{src}' cannot be read ({e.strerror or e}: {e.filename}); "
                            "give readable files") from None
        if sum(d.size for d in docs.values()) == 0:
            raise UserError(f"source '{src}' is empty (no bytes to tokenize); give files with text in them")
        tr, ho = _split_files([f for f in files if docs[f].size], root, heldout)
        train += [docs[f] for f in tr]
        held += [docs[f] for f in ho]
    return train, held


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


def _texts(docs: list[Doc]):
    for d in docs:
        for text, _ in _pieces(d):
            yield text


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


def train_tokenizer(docs: list[Doc], vocab_size: int):
    """A byte-level BPE trained on the documents' text, with EOT as its one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(docs), trainer, length=len(docs))
    return tok


def _write_tokens(tok, docs: list[Doc], eot: int, f, dtype, progress, task, counts: list[int],
                  doc_ends: list[int]) -> int:
    """Encode documents in batches, each followed by EOT, appending to f; returns the tokens written and
    appends each document's end (the offset after its EOT, in the whole file) to doc_ends."""
    batch, ends, nbytes, written = [], [], 0, 0

    def flush():
        nonlocal batch, ends, nbytes, written
        encs = tok.encode_batch_fast(batch, add_special_tokens=False)
        parts, at = [], counts[0]
        for enc, end in zip(encs, ends):
            parts.append(np.asarray(enc.ids, dtype))
            at += len(enc.ids)
            if end:
                parts.append(np.asarray([eot], dtype))
                at += 1
                doc_ends.append(at)
        arr = np.concatenate(parts) if parts else np.zeros(0, dtype)
        arr.tofile(f)
        written += len(arr)
        counts[0] += len(arr)
        progress.update(task, advance=nbytes, tokens=counts[0],
                        rate=f"{counts[0] / max(time.perf_counter() - counts[1], 1e-9):,.0f} tok/s")
        batch, ends, nbytes = [], [], 0

    for d in docs:
        for text, size in _pieces(d):
            batch.append(text)
            ends.append(False)
            nbytes += size
            if nbytes >= BATCH:
                flush()
        if ends:
            ends[-1] = True
        else:  # the document's last piece went out in the previous batch: its EOT alone
            np.asarray([eot], dtype).tofile(f)
            written += 1
            counts[0] += 1
            doc_ends.append(counts[0])
    if batch:
        flush()
    return written


def inputs_hash(train: list[Doc], held: list[Doc], settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for part, docs in (("train", train), ("heldout", held)):
        for d in docs:
            h.update(f"{part}\0{d.name}\0{d.size}\0{sha256_file(d.path)}\n".encode())
    return h.hexdigest()


def _up_to_date(out: Path, digest: str) -> bool:
    try:
        meta = json.loads(sidecar_path(out).read_text())
        tok = Path(meta["tokenizer"]["path"])
        tok = tok if tok.is_absolute() else out.parent / tok
        index = out.parent / meta["document_index"]["path"]
        return (meta.get("inputs_sha256") == digest and sha256_file(tok) == meta["tokenizer"]["sha256"]
                and out.stat().st_size == meta["tokens"]["total"] * np.dtype(meta["dtype"]).itemsize
                and index.stat().st_size == 8 * meta["document_index"]["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prepare(sources: list[str], out: str, tokenizer: str | None = None, train_vocab: int | None = None,
            heldout: float = 0.05, log=print, show_progress: bool = True) -> dict:
    """Tokenize the sources into `out` and its sidecar; returns the sidecar (`skipped`: it was up to date)."""
    if (tokenizer is None) == (train_vocab is None):
        raise UserError("give exactly one of --tokenizer PATH and --train-tokenizer VOCAB_SIZE")
    if train_vocab is not None and not 257 <= train_vocab <= 2**32:
        raise UserError(f"--train-tokenizer {train_vocab} is too small; a byte-level BPE needs at least 257 "
                        "tokens (256 bytes and the end-of-text token); use e.g. 4096")
    if not 0 <= heldout < 1:
        raise UserError(f"--heldout {heldout} must be in [0, 1); e.g. 0.05")
    if not sources:
        raise UserError("give at least one source: text files, folders or builtin")
    out_p = Path(out)
    if out_p.suffix != ".bin":
        raise UserError(f"--out '{out}' must end in .bin (data.source tells token files by that suffix)")
    train_docs, held_docs = collect(sources, heldout)
    given = load_tokenizer(tokenizer) if tokenizer else None
    settings = {"version": VERSION, "sources": sources, "heldout": heldout, "train_vocab": train_vocab,
                "tokenizer_sha256": given and sha256_file(given[1])}
    digest = inputs_hash(train_docs, held_docs, settings)
    if _up_to_date(out_p, digest):
        log(f"skipped: {out} is up to date (same inputs and settings as its {sidecar_path(out_p).name})")
        return {**json.loads(sidecar_path(out_p).read_text()), "skipped": True}

    out_p.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if given:
        tok, tok_path, eot = given
    else:
        log(f"training a byte-level BPE tokenizer ({train_vocab} tokens) on {len(train_docs)} documents")
        tok = train_tokenizer(train_docs, train_vocab)
        tok_path, eot = out_p.parent / "tokenizer.json", tok.token_to_id(EOT)
        tok.save(str(tok_path) + ".tmp")
    train_s = time.perf_counter() - t0
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    n_bytes = [sum(d.size for d in train_docs), sum(d.size for d in held_docs)]

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    progress = Progress(TextColumn("tokenizing"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                        TextColumn("{task.fields[tokens]:,} tokens | {task.fields[rate]}"), TimeRemainingColumn(),
                        console=Console(stderr=True), disable=not show_progress)
    tmp = out_p.with_name(out_p.name + ".tmp")
    t1 = time.perf_counter()
    counts, doc_ends = [0, t1], []  # tokens so far, start time (the progress line's tokens/s); documents' ends
    with progress, open(tmp, "wb") as f:
        task = progress.add_task("tokenize", total=sum(n_bytes), tokens=0, rate="")
        n_train = _write_tokens(tok, train_docs, eot, f, dtype, progress, task, counts, doc_ends)
        n_held = _write_tokens(tok, held_docs, eot, f, dtype, progress, task, counts, doc_ends)
    encode_s = time.perf_counter() - t1
    total = n_train + n_held
    index_p = index_path(out_p)
    index = np.asarray([0] + doc_ends, np.uint64)
    assert len(index) == len(train_docs) + len(held_docs) + 1 and int(index[-1]) == total
    index.tofile(index_p.with_name(index_p.name + ".tmp"))
    if not given:
        os.replace(str(tok_path) + ".tmp", tok_path)
    os.replace(tmp, out_p)
    os.replace(index_p.with_name(index_p.name + ".tmp"), index_p)
    rel = tok_path.resolve().relative_to(out_p.parent.resolve()) if tok_path.resolve().is_relative_to(
        out_p.parent.resolve()) else tok_path.resolve()
    meta = {
        "format": "meshtrain-tokens", "version": VERSION, "dtype": dtype.name, "vocab_size": vocab, "eot_id": eot,
        "tokenizer": {"path": str(rel), "sha256": sha256_file(tok_path), "trained": not given},
        "documents": {"train": len(train_docs), "heldout": len(held_docs)},
        "document_index": {"path": index_p.name, "dtype": "uint64", "entries": len(index)},
        "tokens": {"train": n_train, "heldout": n_held, "total": total},
        "bytes": {"train": n_bytes[0], "heldout": n_bytes[1]},
        "bytes_per_token": sum(n_bytes) / total,
        "heldout_bytes_per_token": n_bytes[1] / n_held if n_held else None,
        "heldout_range": [n_train, total], "sources": sources, "heldout_fraction": heldout,
        "seconds": {"train_tokenizer": round(train_s, 2), "encode": round(encode_s, 2)},
        "tokens_per_sec": round(total / max(encode_s, 1e-9)), "inputs_sha256": digest,
    }
    side = sidecar_path(out_p)
    side.with_name(side.name + ".tmp").write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(side.with_name(side.name + ".tmp"), side)
    log(f"wrote {out}: {total:,} {dtype.name} tokens ({n_train:,} train, {n_held:,} held-out) from "
        f"{len(train_docs) + len(held_docs)} documents, {meta['bytes_per_token']:.3f} bytes/token, vocab {vocab}; "
        f"{'tokenizer trained in ' + f'{train_s:.1f}s, ' if not given else ''}encoded in {encode_s:.1f}s "
        f"({meta['tokens_per_sec']:,} tokens/s)")
    return meta

