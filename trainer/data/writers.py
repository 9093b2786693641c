"""Writing a prepare's output as it is encoded: each split's tokens and loss mask under temporary names, text files
in pieces and record files a batch at a time, with the progress bar."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from trainer.data.records import Encoder, Kinds, held_out, key, kind_of, normalised, read
from trainer.errors import UserError

BATCH = 1 << 23  # bytes per encode_batch call (the library encodes a batch's texts in parallel)

class Split:
    """One split's output as it is written: tokens and their loss mask under temporary names, and the end of
    each document (the offset after its last token, in this split)."""

    def __init__(self, tokens: Path, dtype, masks: bool):
        """`masks`: write the loss mask too (only records can have one: a text-only prepare writes none)."""
        self.path, self.dtype, self.n, self.ends, self.docs, self.bytes, self.counted = tokens, dtype, 0, [], 0, 0, 0
        self.f, self.m = open(tokens, "wb"), open(mask_name(tokens), "wb") if masks else None

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
        if self.m is not None:
            self.m.close()


def mask_name(p: Path) -> Path:
    return p.with_name(p.name + ".mask")


class Bar:
    """The progress bar's task: bytes read of all sources, tokens written and tokens/s."""

    def __init__(self, progress, total: int, splits: tuple[Split, Split]):
        self.p, self.splits, self.t0 = progress, splits, time.perf_counter()
        self.task = progress.add_task("tokenize", total=total, tokens=0, rate="")

    def advance(self, nbytes: int):
        n = sum(s.n for s in self.splits)
        self.p.update(self.task, advance=nbytes, tokens=n,
                      rate=f"{n / max(time.perf_counter() - self.t0, 1e-9):,.0f} tok/s")


def write_files(tok, docs: list, eot: int, split: Split, bar: Bar, pieces):
    """Encode text files in batches, each document followed by EOT, into the split."""
    batch, ends, nbytes = [], [], 0

    def flush():
        nonlocal batch, ends, nbytes
        for enc, end in zip(tok.encode_batch_fast(batch, add_special_tokens=False), ends):
            ids = np.append(np.asarray(enc.ids, np.int64), eot) if end else np.asarray(enc.ids, np.int64)
            split.add(ids, np.ones(len(ids), np.uint8), end)
        bar.advance(nbytes)
        batch, ends, nbytes = [], [], 0

    for d in docs:
        split.bytes += d.size
        for text, size in pieces(d):
            batch.append(text)
            ends.append(False)
            nbytes += size
            if nbytes >= BATCH:
                flush()
        if ends:
            ends[-1] = True
        else:  # the document's last piece went out in the previous batch: its EOT alone
            split.add(np.asarray([eot]), np.ones(1, np.uint8), True)
    if batch:
        flush()


def write_records(enc: Encoder, doc, heldout: float, train: Split, held: Split, kinds: Kinds, bar: Bar):
    """Encode a record file's records in batches into the split each one's hash sends it to."""
    batch, nbytes, done = [], 0, 0

    def flush():
        nonlocal batch, nbytes
        for (split, n, (where, kind, _)), (ids, mask) in zip(batch, enc.encode([b for _, _, b in batch])):
            if not mask.any():
                _uncounted(enc, kinds, where, kind)
            split.add(ids, mask, True)
            split.bytes += n
        bar.advance(0)
        batch, nbytes = [], 0

    for where, rec, at in read(doc.path):
        kind = kind_of(rec := normalised(rec), where, enc.field)
        kinds.add(kind)
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
