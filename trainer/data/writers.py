"""Writing a prepare's output as it is encoded: each split's tokens and loss mask under temporary names, text files
in pieces and record files a batch at a time, with the progress bar."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from trainer.data.batches import index_path, mask_path, sidecar_path, template_path
from trainer.data.prompts import records_path
from trainer.data.records import Encoder, Kinds, as_text, held_out, key, kind_of, normalised, read
from trainer.errors import UserError

BATCH = 1 << 23  # bytes per encode_batch call (the library encodes a batch's texts in parallel)


class Split:
    """One split's output as it is written: tokens and their loss mask under temporary names, and the end of
    each document (the offset after its last token, in this split)."""

    def __init__(self, tokens: Path, dtype, masks: bool):
        """`masks`: write the loss mask too (only records can have one: a text-only prepare writes none)."""
        self.path, self.dtype, self.n, self.ends, self.docs, self.bytes, self.counted = tokens, dtype, 0, [], 0, 0, 0
        self.first_uncounted = ""  # where its first record without a counted token is
        self.f, self.m = open(tokens, "wb"), open(mask_name(tokens), "wb") if masks else None
        self.r = None  # GRPO's prompts: each document's record, a JSON line (opened with the first)

    def add_record(self, rec: dict):
        """Keep a prompt's record beside its document (trainer/data/prompts.py)."""
        if self.r is None:
            self.r = open(records_name(self.path), "w", encoding="utf-8")
        self.r.write(json.dumps(rec, ensure_ascii=False) + "\n")

    def add(self, ids: np.ndarray, mask: np.ndarray, end: bool):
        """Append a piece of a document (`end`: its last)."""
        np.asarray(ids, self.dtype).tofile(self.f)
        if self.m is not None:
            np.asarray(mask, np.uint8).tofile(self.m)
        self.n += len(ids)
        self.counted += int(np.count_nonzero(mask))
        if end:
            self.ends.append(self.n)
            self.docs += 1

    def close(self):
        self.f.close()
        for f in (self.m, self.r):
            if f is not None:
                f.close()


def mask_name(p: Path) -> Path:
    return p.with_name(p.name + ".mask")


def records_name(p: Path) -> Path:
    return p.with_name(p.name + ".prompts")


class Names:
    """The temporary files a prepare writes, renamed into place at the end or removed."""

    def __init__(self, out: Path):
        self.out = out
        self.tokens = out.with_name(out.name + ".tmp")
        self.held = out.with_name(out.name + ".heldout.tmp")
        self.tokenizer = out.parent / "tokenizer.json.tmp"
        # each final file beside the .bin -> its temporary name
        self.staged = {p: p.with_name(p.name + ".tmp") for p in (index_path(out), sidecar_path(out), mask_path(out),
                                                                 template_path(out), records_path(out))}

    def all(self):
        return [self.tokens, self.held, mask_name(self.tokens), mask_name(self.held), records_name(self.tokens),
                records_name(self.held), self.tokenizer, *self.staged.values()]

    def clean(self):
        for p in self.all():
            p.unlink(missing_ok=True)


class Bar:
    """The progress bar's task: bytes read of all sources, tokens written and tokens/s."""

    def __init__(self, progress, total: int, splits: tuple[Split, Split]):
        self.p, self.splits, self.t0 = progress, splits, time.perf_counter()
        self.task = progress.add_task("tokenize", total=total, tokens=0, rate="")

    def advance(self, nbytes: int):
        n = sum(s.n for s in self.splits)
        self.p.update(self.task, advance=nbytes, tokens=n,
                      rate=f"{n / max(time.perf_counter() - self.t0, 1e-9):,.0f} tok/s")


def write_files(tok, docs: list, eot: int, specials, split: Split, bar: Bar, pieces):
    """Encode text files in batches into the split, each document as tokenizer(text) encodes it (`specials`: the
    ids around a text) followed by EOT unless it ends with one (as_text), a document's pieces as one text."""
    batch, nbytes = [], 0  # (text, its document's first piece, its last)

    def flush():
        nonlocal batch, nbytes
        for enc, (_, first, last) in zip(tok.encode_batch_fast([t for t, _, _ in batch], add_special_tokens=False),
                                         batch):
            ids = as_text(enc.ids, specials, eot, first, last)[0]
            split.add(ids, np.ones(len(ids), np.uint8), last)
        bar.advance(nbytes)
        batch, nbytes = [], 0

    for d in docs:
        split.bytes += d.size
        for i, ((text, size), last) in enumerate(_last_marked(pieces(d))):
            batch.append((text, i == 0, last))
            nbytes += size
            if nbytes >= BATCH:
                flush()
    if batch:
        flush()


def _last_marked(pieces):
    """(piece, whether it is the last) for each piece; one empty piece where there are none (a file emptied since
    it was listed is still a document)."""
    prev = None
    for piece in pieces:
        if prev is not None:
            yield prev, False
        prev = piece
    yield (prev if prev is not None else ("", 0)), True


def write_records(enc: Encoder, doc, heldout: float, train: Split, held: Split, kinds: Kinds, bar: Bar):
    """Encode a record file's records in batches into the split each one's hash sends it to."""
    batch, nbytes, done = [], 0, 0

    def flush():
        nonlocal batch, nbytes
        for (split, n, (where, kind, rec)), docs in zip(batch, enc.encode([b for _, _, b in batch])):
            if kind == "prompt":  # GRPO's: its ids, no token counted, the record beside them
                split.add(docs[0], np.zeros(len(docs[0]), np.uint8), True)
                split.add_record(rec)
                split.bytes += n
                continue
            if kind == "pair" and not docs:  # its prompt alone reaches --max-length: dropped, counted
                kinds.drop_pair(docs.prompt)
                continue
            for ids, mask in docs if kind == "pair" else [docs]:  # a pair: two documents, chosen then rejected
                if not mask.any():
                    _uncounted(enc, kinds, where, kind)
                    split.first_uncounted = split.first_uncounted or where
                split.add(ids, mask, True)
            split.bytes += n
        bar.advance(0)
        batch, nbytes = [], 0

    for where, rec, at in read(doc.path, doc.start, doc.stop, doc.line):
        kind = kind_of(rec := normalised(rec), where, enc.field)
        kinds.add(kind)
        if kinds.prompts and kinds.prompts != kinds.total:
            raise UserError(f"{where}: prompts alone (GRPO's) and records to train on (texts, conversations, "
                            "exchanges, pairs) are in one prepare; prepare the prompts apart")
        k = key(rec)
        size = len(k)
        batch.append((held if held_out(k, heldout) else train, size, (where, kind, rec)))
        nbytes += size
        if at > done:
            bar.advance(at - done)
            done = at
        if nbytes >= BATCH // 8:  # rendering is Python; keep the batches the tokenizer encodes in parallel big
            flush()
    if batch:
        flush()
    bar.advance(doc.size - done)


def _uncounted(enc: Encoder, kinds: Kinds, where: str, kind: str):
    """A record without a token the loss counts: counted (summary and sidecar), or with --require-counted an error."""
    if enc.require_counted:
        field = "messages" if kind == "conversation" else "completion"
        raise UserError(f"{where}: {field} gives no token the loss counts (--loss-on {enc.loss_on}: no assistant "
                        "turn the template marks); add one, or leave out --require-counted to keep such records "
                        "(prepare counts them)")
    kinds.add_uncounted(where)
