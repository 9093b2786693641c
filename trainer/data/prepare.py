"""`meshtrain prepare`: text sources -> a token .bin (train documents, then held-out ones) and its JSON sidecar.

Documents are files; each goes to train or held-out by a hash of its name (trainer/data/batches.py's file split),
is encoded as transformers' tokenizer(text) (the special tokens the post-processor puts around it: a BOS first for
Llama's), and an end-of-text token follows unless that ends with one. The sidecar (DATA.bin.json) tells
trainer/data/batches.py the dtype, the vocabulary, the held-out token range and the bytes per token, and records
the tokenizer and those special tokens (`text_specials`, which generate puts before a prompt). The
document index (DATA.bin.docs, named by the sidecar's `document_index`) holds the start offset of every
document, uint64, and the total token count last (one more entry than documents): the one source of document
boundaries, since end-of-text tokens may also occur inside a document (a chat template's turns).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data import remote
from trainer.data.batches import _split_files, index_path, mask_path, sidecar_path, stdlib_files, template_path
from trainer.data.chat import ChatTemplate, load_template, parse_date
from trainer.data import pairs
from trainer.data.tokenizer import EOT, load_tokenizer, train_tokenizer  # noqa: F401 (load_tokenizer: re-exported)
from trainer.data.records import Encoder, Kinds, is_records, kind_of, normalised, read, text_specials
from trainer.data.prompts import records_path
from trainer.data.writers import Bar, Names, Split, mask_name, records_name, write_files, write_records
from trainer.errors import UserError

VERSION = 2  # 2: the document index
LOSS_ON = ("assistant", "all")  # --loss-on: the tokens a conversation's loss counts
PIECE = 1 << 22  # bytes of one document handed to the encoder at a time: bounds memory on huge files


@dataclass
class Doc:
    name: str  # source label + path inside it: what the split hashes and the input hash records
    path: Path
    size: int
    start: int = 0  # a piece of a record file (trainer/data/shards.py): its bytes [start, stop), from line `line`
    stop: int | None = None
    line: int = 1


def collect(sources: list[str], heldout: float) -> tuple[list[Doc], list[Doc], list[Doc]]:
    """Every source's files: text files split into train and held-out documents by a hash of their names,
    and record files (JSONL, Parquet), whose records are split one by one as they are read."""
    train, held, records = [], [], []
    for src in sources:
        if src == "builtin":
            root = Path(sysconfig.get_paths()["stdlib"])
            files = stdlib_files()
        elif remote.is_url(src):  # objects read in place (trainer/data/remote.py Object)
            root, files = remote.objects(src)
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
    with remote.open_source(doc.path) as f:
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
    with remote.open_source(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_doc(d: Doc) -> str:
    """The SHA-256 of a document's bytes: its file's, or a piece's range of them."""
    if d.stop is None:
        return sha256_file(d.path)
    h, left = hashlib.sha256(), d.stop - d.start
    with remote.open_source(d.path) as f:
        f.seek(d.start)
        while left > 0 and (b := f.read(min(left, 1 << 24))):
            h.update(b)
            left -= len(b)
    return h.hexdigest()


def inputs_hash(train: list[Doc], held: list[Doc], settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for part, docs in (("train", train), ("heldout", held)):
        for d in docs:
            h.update(f"{part}\0{d.name}\0{d.size}\0{sha256_doc(d)}\n".encode())
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


@dataclass
class _Job:
    """One prepare: its documents, settings and output, read by the steps below."""
    out: Path
    sources: list[str]
    heldout: float
    loss_on: str
    day: _dt.date
    template: ChatTemplate | None
    train: list[Doc]
    held: list[Doc]
    records: list[Doc]
    digest: str = ""
    max_length: int = 1024  # a preference pair's sequences keep this many tokens (trainer/data/pairs.py)
    timed: bool = True  # the sidecar records the seconds taken (a shard's does not: its bytes are its inputs')


@dataclass
class _Tok:
    """The tokenizer a prepare encodes with: given (--tokenizer) or trained, its file, end-of-text id and the ids
    tokenizer(text) puts around a text (text_specials)."""
    tok: object
    path: Path
    eot: int
    given: bool
    specials: tuple[list[int], list[int]]


def prepare(sources: list[str], out: str, tokenizer: str | None = None, train_vocab: int | None = None,
            heldout: float = 0.05, log=print, show_progress: bool = True, field: str = "text",
            chat_template: str | None = None, date: str | None = None, loss_on: str = "assistant",
            require_counted: bool = False, max_length: int = 1024) -> dict:
    """Tokenize the sources into `out` and its sidecar; returns the sidecar (`skipped`: it was up to date)."""
    # require_counted: a record without a token the loss counts is an error; else it is kept and counted
    _check_args(sources, out, tokenizer, train_vocab, heldout, loss_on)
    out_p, day = Path(out), parse_date(date)
    docs = collect(sources, heldout)
    tk = _given(tokenizer) if tokenizer else None
    job = _Job(out_p, sources, heldout, loss_on, day, load_template(tk and tk.path, chat_template, day), *docs)
    settings = {"version": VERSION, "sources": sources, "heldout": heldout, "train_vocab": train_vocab,
                "tokenizer_sha256": tk and sha256_file(tk.path)}
    if tk and any(tk.specials):  # a tokenizer that adds none hashes as before text_specials existed
        settings["text_specials"] = tk.specials
    if job.records:  # what else decides a record file's tokens (a text-only prepare hashes as it always did)
        settings.update(field=field, loss_on=loss_on, date=day.isoformat(),
                        chat_template=job.template and job.template.sha256)
        if max_length != 1024:  # what a pair's sequences keep (a prepare without pairs hashes as before)
            settings["max_length"] = max_length
    job.max_length = max_length
    job.digest = inputs_hash(job.train, job.held + job.records, settings)
    if _up_to_date(out_p, job.digest, require_counted):
        log(f"skipped: {out} is up to date (same inputs and settings as its {sidecar_path(out_p).name})")
        return {**json.loads(sidecar_path(out_p).read_text()), "skipped": True}

    out_p.parent.mkdir(parents=True, exist_ok=True)
    enc = Encoder(None, -1, job.template, loss_on, field, require_counted, max_length)
    t0 = time.perf_counter()
    tk = tk or _trained(job, train_vocab, enc, log)
    enc.tok, enc.eot, enc.specials = tk.tok, tk.eot, tk.specials
    meta, (train, held, kinds) = _write(job, tk, enc, time.perf_counter() - t0, show_progress)
    _summary(job, meta, train, held, kinds, tk, log)
    return meta


def _check_args(sources, out: str, tokenizer, train_vocab, heldout: float, loss_on: str, folder: bool = False):
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
    if Path(out).suffix != ".bin" and not folder:
        raise UserError(f"--out '{out}' must end in .bin (data.source tells token files by that suffix)")


def _given(path: str) -> _Tok:
    tok, file, eot = load_tokenizer(path)
    return _Tok(tok, file, eot, True, text_specials(tok, eot))


def _trained(job: _Job, train_vocab: int, enc: Encoder, log) -> _Tok:
    """A byte-level BPE trained on the training documents (saved beside the output by _finish)."""
    log(f"training a byte-level BPE tokenizer ({train_vocab} tokens) on {len(job.train)} documents"
        + (f" and {len(job.records)} record files" if job.records else ""))
    tok = train_tokenizer(_texts(job.train, job.records, enc), train_vocab, len(job.train) + len(job.records))
    eot = tok.token_to_id(EOT)
    return _Tok(tok, job.out.parent / "tokenizer.json", eot, False, text_specials(tok, eot))


def _write(job: _Job, tk: _Tok, enc: Encoder, train_s: float, show_progress: bool):
    """Encode every document into the two splits under temporary names, check them and put the output in place:
    (the sidecar, (train split, held-out split, the records' kinds))."""
    vocab = tk.tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    names, kinds, splits = Names(job.out), Kinds(), []
    t1 = time.perf_counter()
    try:
        train, held = splits[:] = (Split(names.tokens, dtype, bool(job.records)),
                                   Split(names.held, dtype, bool(job.records)))
        with _progress(show_progress) as progress:
            bar = Bar(progress, sum(d.size for d in job.train + job.held + job.records), (train, held))
            write_files(tk.tok, job.train, tk.eot, tk.specials, train, bar, _pieces)
            write_files(tk.tok, job.held, tk.eot, tk.specials, held, bar, _pieces)
            for d in job.records:
                write_records(enc, d, job.heldout, train, held, kinds, bar)
        train.close()
        held.close()
        encode_s = time.perf_counter() - t1
        masked = bool(kinds.conversations or kinds.exchanges or kinds.pairs)
        pairs.check_kinds(kinds)
        _check_splits(job, kinds, train, held, masked)
        meta = _finish(job, names, tk, train, held, masked, kinds,
                       {"train_tokenizer": round(train_s, 2), "encode": round(encode_s, 2)}, encode_s)
    finally:
        for split in splits:  # closed already unless something failed on the way
            split.close()
        names.clean()
    return meta, (train, held, kinds)


def _progress(show: bool):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    return Progress(TextColumn("tokenizing"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                    TextColumn("{task.fields[tokens]:,} tokens | {task.fields[rate]}"), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not show)


def _summary(job: _Job, meta: dict, train: Split, held: Split, kinds: Kinds, tk: _Tok, log):
    if "prompts" in meta:
        log(f"{kinds.prompts:,} prompts ({train.docs:,} train, {held.docs:,} held-out) for train.objective=grpo, "
            f"each record kept in {meta['prompts']['path']} for the reward functions")
    elif "pairs" in meta:
        log(pairs.summary(kinds, meta, job.max_length))
    elif "loss_mask" in meta:
        log(f"{kinds.conversations:,} conversations, {kinds.exchanges:,} exchanges, {kinds.text:,} text records; "
            f"{meta['loss_mask']['counted']['train']:,} train tokens counted in the loss ({job.loss_on})"
            + (f"; {kinds.uncounted:,} records kept without a counted token (the first: {kinds.first_uncounted}; "
               "--require-counted makes them errors)" if kinds.uncounted else ""))
    s = meta["seconds"]
    trained = "" if tk.given else f"tokenizer trained in {s['train_tokenizer']:.1f}s, "
    log(f"wrote {job.out}: {meta['tokens']['total']:,} {meta['dtype']} tokens ({train.n:,} train, {held.n:,} held-out) "
        f"from {train.docs + held.docs} documents, {meta['bytes_per_token']:.3f} bytes/token, vocab "
        f"{meta['vocab_size']}; {trained}encoded in {s['encode']:.1f}s ({meta['tokens_per_sec']:,} tokens/s)")


def _check_splits(job: _Job, kinds: Kinds, train: Split, held: Split, masked: bool):
    """Refuse a split the loss mask counts nothing of (naming its first such record), or a held-out split that
    holds out none of the records."""
    n, heldout = kinds.total, job.heldout
    piece = any(d.stop is not None for d in job.records)  # of a cut file, which shards.py checks whole

    def none(split: Split) -> str:  # every record of a split without a counted token is one without any
        return (f"its {split.docs:,} records have no assistant turn the template marks (the first: "
                f"{split.first_uncounted}); add assistant turns, or use --loss-on all")
    if masked and not train.counted and not (piece and not train.docs):
        raise UserError("the loss mask counts no token of the training split: " + (
            none(train) if train.docs else
            f"--heldout {heldout} holds out all {n:,} records; use a smaller --heldout"))
    if job.records and heldout > 0 and held.docs == 0 and not piece:
        raise none_held(heldout, f"the {n:,} records")
    if masked and held.docs and not held.counted:
        raise UserError(f"the loss mask counts no token of the held-out split ({held.docs:,} records), so eval would "
                        f"measure nothing: {none(held)}, or another --heldout")


def none_held(heldout: float, what: str) -> UserError:
    return UserError(f"--heldout {heldout} held out none of {what} (a record is held out by a hash of its content); "
                     "use a larger --heldout, more records, or --heldout 0 to hold out none")


def _append(dst: Path, src: Path):
    with open(dst, "ab") as f, open(src, "rb") as g:
        shutil.copyfileobj(g, f, 1 << 24)


def _finish(job: _Job, names: Names, tk: _Tok, train: Split, held: Split, masked: bool, kinds: Kinds,
            seconds: dict, encode_s: float) -> dict:
    """Join the splits, write the index, the mask and the sidecar under temporary names, then rename them all."""
    out_p, tmp = job.out, names.staged
    _append(names.tokens, names.held)
    total = train.n + held.n
    index = np.asarray([0] + train.ends + [train.n + e for e in held.ends], np.uint64)
    assert len(index) == train.docs + held.docs + 1 and int(index[-1]) == total
    index.tofile(tmp[index_path(out_p)])
    if masked:
        mask_tmp = mask_name(names.tokens)
        _append(mask_tmp, mask_name(names.held))
        os.replace(mask_tmp, tmp[mask_path(out_p)])
    if kinds.prompts:  # GRPO's: each document's record, train's then held-out's
        for split in (train, held):
            records_name(split.path).touch()
        _append(records_name(names.tokens), records_name(names.held))
        os.replace(records_name(names.tokens), tmp[records_path(out_p)])
    if (masked or kinds.prompts) and job.template is not None:
        tmp[template_path(out_p)].write_text(job.template.text)
    if not tk.given:
        tk.tok.save(str(names.tokenizer))
        os.replace(names.tokenizer, tk.path)
    meta = _sidecar(job, tk, train, held, len(index), seconds, encode_s)
    if masked:
        meta["loss_mask"] = {"path": mask_path(out_p).name, "dtype": "uint8", "loss_on": job.loss_on,
                             "counted": {"train": train.counted, "heldout": held.counted}}
        meta["records"] = {"text": kinds.text, "conversations": kinds.conversations, "exchanges": kinds.exchanges,
                           "uncounted": kinds.uncounted}
        if kinds.pairs:  # documents 2i and 2i + 1 are pair i's chosen and rejected (trainer/data/pairs.py)
            meta["pairs"] = {"train": train.docs // 2, "heldout": held.docs // 2, "dropped": kinds.dropped_pairs,
                             "max_length": job.max_length}
    if kinds.prompts:  # documents 0 .. train - 1 are the training split's prompts (trainer/data/prompts.py)
        meta["prompts"] = {"path": records_path(out_p).name, "train": train.docs, "heldout": held.docs}
    if masked or kinds.prompts:
        t = job.template
        meta["chat_template"] = t and {"path": template_path(out_p).name, "source": t.source, "sha256": t.sha256,
                                       "generation_blocks": t.blocks, "date": job.day.isoformat()}
    tmp[sidecar_path(out_p)].write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(names.tokens, out_p)
    for final, t in tmp.items():  # the sidecar last: it names the others
        if t.exists() and final != sidecar_path(out_p):
            os.replace(t, final)
    os.replace(tmp[sidecar_path(out_p)], sidecar_path(out_p))
    return meta


def _sidecar(job: _Job, tk: _Tok, train: Split, held: Split, entries: int, seconds: dict, encode_s: float) -> dict:
    """The sidecar's keys every prepare writes (docs/data.md lists them)."""
    out_p, total = job.out, train.n + held.n
    path, folder = tk.path.resolve(), out_p.parent.resolve()
    return {
        "format": "meshtrain-tokens", "version": VERSION, "dtype": np.dtype(train.dtype).name,
        "vocab_size": tk.tok.get_vocab_size(with_added_tokens=True), "eot_id": tk.eot,
        "text_specials": {"before": tk.specials[0], "after": tk.specials[1]},
        "tokenizer": {"path": str(path.relative_to(folder) if path.is_relative_to(folder) else path),
                      "sha256": sha256_file(tk.path), "trained": not tk.given},
        "documents": {"train": train.docs, "heldout": held.docs},
        "document_index": {"path": index_path(out_p).name, "dtype": "uint64", "entries": entries},
        "tokens": {"train": train.n, "heldout": held.n, "total": total},
        "bytes": {"train": train.bytes, "heldout": held.bytes},
        "bytes_per_token": (train.bytes + held.bytes) / total,
        "heldout_bytes_per_token": held.bytes / held.n if held.n else None,
        "heldout_range": [train.n, total], "sources": job.sources, "heldout_fraction": job.heldout,
        "inputs_sha256": job.digest,
        **({"seconds": seconds, "tokens_per_sec": round(total / max(encode_s, 1e-9))} if job.timed else {}),
    }
