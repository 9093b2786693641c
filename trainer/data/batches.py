"""Data: token sources and the batch of step s as a pure function of (seed, s).

Sources:
  builtin    the Python standard library's .py files read as bytes (vocab 256); files go to
             train or held-out by a hash of their relative path, so the split is stable.
  synthetic  uniform random tokens (for benchmarks; nothing to learn).
  DIR        a folder of shards with its manifest.json (`meshtrain prepare --out DIR/`, trainer/data/manifest.py)
  PATH       a text file or a folder of files (bytes), or a pre-tokenized .bin of uint16/uint32 tokens
             (data.bin_dtype); the last heldout_fraction is held out. A .bin from `meshtrain prepare` has a sidecar
             DATA.bin.json (trainer/data/prepare.py): its dtype, vocabulary, tokenizer and held-out token range.
  URL        s3:// or gs://: a folder of shards or a prepared .bin in object storage (trainer/data/remote.py).
Evaluation never reads training tokens: where the held-out part is shorter than one eval window (a one-file folder,
a small file), the last heldout_fraction of the tokens, at least one window, is held out instead, or the data is
refused as too small.

Batches: step s draws B window starts from numpy's PCG64 seeded with (seed, s); each process builds only its own
rows, as the named fields of models/batch.py (targets shifted here, once; every target counted and one document per
row unless data.document_mask says otherwise). Nothing depends on what came before, so a resumed or resharded run
sees exactly the batches it would have seen. grain runs the per-step batch function in a background thread with a
prefetch buffer (its MapDataset is random-access, which fits a step-indexed source, and it starts at any step).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from models.batch import from_windows
from trainer.errors import UserError
from trainer.config.sections import BIN_DTYPES
from trainer.data.feed import prefetched
from trainer.data.manifest import Concat, is_manifest, load_url, load as load_manifest
from trainer.data.pairs import packed_pairs
from trainer.data.remote import is_url

_TRAIN, _EVAL = 0x7A1, 0xE7A
log = logging.getLogger(__name__)


@dataclasses.dataclass
class Corpus:
    train: np.ndarray  # 1-D token array (uint8/uint16/uint32 or memmap)
    heldout: np.ndarray
    vocab: int  # smallest vocab_size that covers the tokens
    synthetic: bool = False
    whole: np.ndarray | None = None  # train + heldout in one array (they are its two ends)
    source: str = ""
    heldout_fraction: float = 0.05
    bytes_per_token: float | None = None  # source bytes per token where known: eval_bpb
    prepared: bool = False  # from `meshtrain prepare` (vocab is the tokenizer's)
    file_starts: np.ndarray | None = None  # files read as bytes: each file's start in `whole`, the total last
    index: Path | None = None  # a prepared .bin's document index file (its sidecar's `document_index`)
    eot_id: int | None = None  # a prepared .bin's end-of-text token: older ones have no index
    loss_mask: np.ndarray | None = None  # a prepared .bin's loss mask (uint8 per token: 1 = a counted target)
    doc_starts: np.ndarray | None = None  # a manifest's documents, its shards' indexes in `whole`'s order
    pairs: bool = False  # preference pairs: documents 2i and 2i + 1 (trainer/data/pairs.py)

    def documents(self) -> np.ndarray | None:
        """The start offset of every document in `whole`, with len(whole) last (one more entry than documents), or
        None where the source has no documents (a single text file, a bare .bin, synthetic). Files read as bytes are
        one document each; a prepared .bin reads its index (a manifest its shards'), or, prepared before there was
        one, finds its documents by scanning for the end-of-text token (with a log line)."""
        if self.doc_starts is not None:
            return self.doc_starts
        if self.file_starts is not None:
            return self.file_starts
        if self.index is not None:
            return np.fromfile(self.index, dtype=np.uint64).astype(np.int64)
        if self.eot_id is None:
            return None
        whole = self.whole if self.whole is not None else np.concatenate([self.train, self.heldout])
        ends = np.flatnonzero(np.asarray(whole) == self.eot_id) + 1
        starts = np.unique(np.concatenate([[0], ends, [len(whole)]])).astype(np.int64)
        log.warning("data.source '%s' has no document index (prepared before there was one): %d documents found "
                    "by scanning for its end-of-text token %d; run meshtrain prepare again to write the index",
                    self.source, len(starts) - 1, self.eot_id)
        return starts


def bits_per_byte(loss_nats: float, bytes_per_token: float) -> float:
    return loss_nats / math.log(2) / bytes_per_token


def sidecar_path(bin_path) -> Path:
    return Path(str(bin_path) + ".json")


def index_path(bin_path) -> Path:
    """Where `meshtrain prepare` writes a .bin's document index (the sidecar's `document_index` names it)."""
    return Path(str(bin_path) + ".docs")


def mask_path(bin_path) -> Path:
    """Where `meshtrain prepare` writes a .bin's loss mask (the sidecar's `loss_mask` names it)."""
    return Path(str(bin_path) + ".mask")


def template_path(bin_path) -> Path:
    """Where `meshtrain prepare` keeps the chat template its conversations were rendered with."""
    return Path(str(bin_path) + ".chat_template.jinja")


def needs_documents(source: str) -> UserError:
    """A loss mask trains on whole documents: data.document_mask=false contradicts it."""
    return UserError(f"data.source '{source}' has a loss mask (conversations), which trains on whole documents and "
                     "needs data.document_mask=true; drop data.document_mask=false or set it true")


def no_documents(source: str) -> UserError:
    kind = "synthetic data" if source == "synthetic" else f"data.source '{source}'"
    return UserError(f"data.document_mask=true needs documents, and {kind} has none (a single text file, a bare .bin "
                     "and synthetic are one stream); use a folder, builtin or a file from meshtrain prepare, or set "
                     "data.document_mask=false")


def read_sidecar(bin_path) -> dict | None:
    """The JSON sidecar `meshtrain prepare` wrote beside a token .bin, or None for a bare .bin."""
    side = sidecar_path(bin_path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
        meta["dtype"], meta["vocab_size"], meta["heldout_range"][0]  # noqa: B018 (the keys used below)
        return meta
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise UserError(f"'{side}' is not a readable `meshtrain prepare` sidecar ({type(e).__name__}: {e}); "
                        f"run meshtrain prepare again or remove it to read {bin_path} as a bare token file") from None


def tokenizer_of(bin_path, meta: dict) -> str:
    """The sidecar's tokenizer path, as a path from here (it is stored relative to the sidecar)."""
    p = Path(meta["tokenizer"]["path"])
    return str(p if p.is_absolute() else Path(bin_path).parent / p)


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted (os.walk: a tenth of Path.rglob's 0.7 s, paid by every run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        found += [Path(top, n) for n in names if n.endswith(".py")]
    return sorted(p for p in found if p.is_file())


def _split_files(files: list[Path], root: Path, frac: float):
    train, held = [], []
    for p in files:
        h = zlib.crc32(str(p.relative_to(root)).encode()) % 10_000
        (held if h < frac * 10_000 else train).append(p)
    if not held and len(files) > 1:  # tiny folders: hold out the last file
        held, train = train[-1:], train[:-1]
    if not train:  # a lone file that hashed to held-out: train on it, Batches holds out its tail
        train, held = held, []
    return train, held


def _files(train: list[Path], held: list[Path]) -> Corpus:
    """The training files' bytes, then the held-out files', in one array."""
    parts = [p.read_bytes() for p in train + held]
    k = sum(len(b) for b in parts[:len(train)])
    data = np.frombuffer(b"".join(parts), dtype=np.uint8)
    starts = np.unique(np.cumsum([0] + [len(b) for b in parts])).astype(np.int64)  # empty files: no document
    return Corpus(data[:k], data[k:], 256, whole=data, bytes_per_token=1.0, file_starts=starts)


def load_corpus(source: str, heldout_fraction: float = 0.05, bin_dtype: str = "uint16") -> Corpus:
    try:
        c = _load(source, heldout_fraction, bin_dtype)
        return dataclasses.replace(c, source=source, heldout_fraction=heldout_fraction)
    except OSError as e:  # unreadable file, a folder with a dangling link, ...
        raise UserError(f"data.source '{source}' cannot be read ({e.strerror or e}: {e.filename or source}); "
                        "give a readable file or folder") from None


def _load(source: str, heldout_fraction: float, bin_dtype: str) -> Corpus:
    if source == "synthetic":
        return Corpus(np.zeros(0, np.uint8), np.zeros(0, np.uint8), vocab=0, synthetic=True)
    if source == "builtin":
        files = stdlib_files()
        root = Path(sysconfig.get_paths()["stdlib"])
        return _check(_files(*_split_files(files, root, heldout_fraction)), source)
    if is_url(source):  # object storage: a folder of shards or a prepared .bin (trainer/data/remote.py)
        return _check(Corpus(**load_url(source)), source)
    path = Path(source)
    if not path.exists():
        raise UserError(f"data.source '{source}' does not exist; give an existing file or folder, "
                        "or use data.source=builtin")
    if is_manifest(path):  # a folder of shards (meshtrain prepare --out DIR/)
        return _check(Corpus(**load_manifest(path, source)), source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return _check(_files(*_split_files(files, path, heldout_fraction)), source)
    if path.suffix == ".bin" and (meta := read_sidecar(path)):
        toks = np.memmap(path, dtype=meta["dtype"], mode="r") if path.stat().st_size else np.zeros(0, meta["dtype"])
        cut = int(meta["heldout_range"][0])
        bpt = meta.get("heldout_bytes_per_token") or meta.get("bytes_per_token")
        index, mask = meta.get("document_index"), _mask_of(path, meta, len(toks))
        return _check(Corpus(toks[:cut], toks[cut:], int(meta["vocab_size"]), whole=toks,
                             bytes_per_token=None if mask is not None else bpt,  # counted bytes unknown
                             prepared=True, index=path.parent / index["path"] if index else None,
                             eot_id=meta.get("eot_id"), loss_mask=mask, pairs=bool(meta.get("pairs"))), source)
    if path.suffix == ".bin":
        if bin_dtype not in BIN_DTYPES:
            raise UserError(f"data.bin_dtype='{bin_dtype}' is unknown; use {' or '.join(BIN_DTYPES)}")
        size = np.dtype(bin_dtype).itemsize
        if path.stat().st_size % size:
            raise UserError(f"data.source '{source}' has {path.stat().st_size} bytes, not a whole number of "
                            f"{bin_dtype} tokens; check data.bin_dtype (uint16 or uint32) or the file")
        toks = np.memmap(path, dtype=bin_dtype, mode="r") if path.stat().st_size else np.zeros(0, bin_dtype)
        cut = int(len(toks) * (1 - heldout_fraction))
        vocab = int(toks.max()) + 1 if len(toks) else 0
        return _check(Corpus(toks[:cut], toks[cut:], vocab, whole=toks), source)
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    cut = int(len(data) * (1 - heldout_fraction))
    return _check(Corpus(data[:cut], data[cut:], 256, whole=data, bytes_per_token=1.0), source)


def _mask_of(path: Path, meta: dict, n: int) -> np.ndarray | None:
    """The sidecar's loss mask, one uint8 per token, or None where it names none."""
    if not (m := meta.get("loss_mask")):
        return None
    f = path.parent / m["path"]
    if not f.is_file() or f.stat().st_size != n:
        raise UserError(f"the loss mask {f} of data.source '{path}' is missing or not one byte per token ({n:,}); "
                        "run meshtrain prepare again")
    return np.memmap(f, dtype=np.uint8, mode="r") if n else np.zeros(0, np.uint8)


def _check(c: Corpus, source: str) -> Corpus:
    if len(c.train) == 0:
        raise UserError(f"data.source '{source}' is empty (no tokens to train on); point it at a non-empty "
                        "file or folder")
    return c


def _hold_out_tail(c: Corpus, seq_len: int) -> Corpus:
    """Split train + held-out again by position: the last heldout_fraction, at least one eval window."""
    whole = c.whole if c.whole is not None else np.concatenate([c.train, c.heldout])
    n, need = len(whole), seq_len + 2  # a window is T+1 tokens and its start is drawn from [0, len-T-1)
    held = max(n - int(n * (1 - c.heldout_fraction)), need)
    if n - held < need:
        unit = "bytes" if whole.dtype == np.uint8 else "tokens"
        raise UserError(f"data.source '{c.source}' has {n} {unit}, too few for model.seq_len={seq_len} to both train "
                        f"and hold out an eval part ({need} {unit} each); use at least {2 * need} {unit} of data, "
                        "a shorter model.seq_len, or train.eval_every=0")
    return dataclasses.replace(c, train=whole[:n - held], heldout=whole[n - held:], whole=whole)


def documents(doc_starts: np.ndarray, window_starts: np.ndarray, T: int):
    """(loss_weight, segment_ids, positions) of windows of T+1 tokens starting at `window_starts`, for
    documents starting at `doc_starts` (the total last): segments numbered 1, 2, ... in each row, each
    token's offset inside its document (a document cut by the window's start keeps its true offsets), and
    weight 0 for a target of another document than its input's."""
    idx = window_starts[:, None] + np.arange(T + 1)[None, :]
    doc = np.searchsorted(doc_starts, idx, side="right") - 1  # (B, T+1)
    inputs = doc[:, :-1]
    weight = (doc[:, 1:] == inputs).astype(np.float32)
    segments = (inputs - inputs[:, :1] + 1).astype(np.int32)
    positions = (idx[:, :-1] - doc_starts[inputs]).astype(np.int32)
    return weight, segments, positions


class Batches:
    """The global batch of any step, and this process's rows of it."""

    def __init__(self, corpus: Corpus, seed: int, batch_size: int, seq_len: int, vocab_size: int,
                 process_index: int = 0, process_count: int = 1, evaluates: bool = True,
                 document_mask: bool = False):
        self.seed, self.B, self.T, self.V = seed, batch_size, seq_len, vocab_size
        self.starts = None  # with document_mask: every document's start in corpus.whole, the total last
        if batch_size % process_count:
            raise UserError(f"train.batch_size={batch_size} is not divisible by the {process_count} processes; "
                            f"use a multiple of {process_count}")
        rows = batch_size // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)
        self.note = None  # what the run prints about its data (packing)
        self.ref = None  # preference pairs: the reference's log-probability of each token (trainer/run/reference.py)
        self.packed = self.packed_eval = None  # with a loss mask: conversations packed whole (trainer/data/packing.py)
        if not corpus.synthetic:
            if corpus.vocab > vocab_size and corpus.prepared:
                raise UserError(f"the tokenizer of data.source '{corpus.source}' has {corpus.vocab} tokens but "
                                f"model.vocab_size={vocab_size}; set model.vocab_size >= {corpus.vocab}, or leave "
                                "it unset to take the vocabulary from the data's sidecar")
            if corpus.vocab > vocab_size:
                raise UserError(f"the data has token ids up to {corpus.vocab - 1} but model.vocab_size={vocab_size}; "
                                f"set model.vocab_size >= {corpus.vocab}")
        if corpus.loss_mask is not None:
            self._pack(corpus, document_mask, evaluates)
            return
        if not corpus.synthetic:
            if evaluates and len(corpus.heldout) <= seq_len + 1:
                corpus = _hold_out_tail(corpus, seq_len)
            if len(corpus.train) <= seq_len + 1:
                raise UserError(f"the training data has {len(corpus.train)} tokens, too few for "
                                f"model.seq_len={seq_len}; use more data or a shorter seq_len")
        self.c = corpus
        if document_mask:
            self.starts = corpus.documents()
            if self.starts is None:
                raise no_documents("synthetic" if corpus.synthetic else corpus.source)

    def _pack(self, corpus: Corpus, document_mask: bool, evaluates: bool):
        from trainer.data.packing import pack
        if not document_mask:
            raise needs_documents(corpus.source)
        self.c, starts, cut, self._epochs = corpus, corpus.documents(), len(corpus.train), {}
        if corpus.pairs:  # one preference pair per row (trainer/data/pairs.py)
            self.packed, self.packed_eval, self.note = packed_pairs(corpus, starts, cut, self.T, evaluates)
            return
        self.packed = pack(starts[starts <= cut], self.T)
        if self.packed.rows == 0:
            raise UserError(f"data.source '{corpus.source}' has no training document with a target; prepare it "
                            "from more records")
        p = self.packed
        self.note = (f"packed {p.documents:,} training conversations into {p.rows:,} rows of {self.T} "
                     f"({100 * p.filled(self.T):.1f}% of the slots filled); {p.split:,} longer than a row were split, "
                     "none dropped")
        if evaluates:
            self.packed_eval = pack(starts[starts >= cut], self.T)
            if self.packed_eval.rows == 0:
                raise UserError(f"data.source '{corpus.source}' has no held-out documents to evaluate on (prepared "
                                "with --heldout 0); prepare it with --heldout > 0 or set train.eval_every=0")

    def _packed_rows(self, eval_batch: int | None, step: int, everyone: bool = False) -> dict:
        from trainer.data.packing import fields, rows_of
        if eval_batch is None:
            rows, p = rows_of(self.packed, self.seed, step * self.B, self.B, self._epochs), self.packed
        else:
            p = self.packed_eval
            g = eval_batch * self.B + np.arange(self.B)
            rows = np.where(g < p.rows, g, -1)  # each held-out row once over the eval batches, then padding
        rows = rows if everyone else rows[self.rows]
        return fields(p, rows, self.c.whole, self.c.loss_mask, self.T, self.ref)

    def rows_of(self, tokens: np.ndarray, seed_words: list[int], n: int, keep: np.ndarray) -> dict:
        """The rows `keep` (indices into them) of n windows drawn with seed_words (a mixture's share of a step)."""
        return self._rows(tokens, seed_words, n, keep)

    def _rows(self, tokens: np.ndarray, seed_words: list[int], n: int, keep=None) -> dict:
        windows, at = self._windows(tokens, seed_words, n, keep)
        if self.starts is None:
            return from_windows(windows)
        # where each window's tokens lie in corpus.whole (held-out tokens follow the training ones there)
        base = 0 if tokens is self.c.train else len(self.c.train)
        return from_windows(windows, *documents(self.starts, base + at, self.T))

    def _windows(self, tokens: np.ndarray, seed_words: list[int], n: int, keep=None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
        """This process's windows (rows, T+1) of consecutive tokens, and where each starts in `tokens` (keep: which
        of the n drawn; default this process's rows of a whole batch, else all)."""
        rng = np.random.default_rng(seed_words)
        keep = keep if keep is not None else self.rows if n == self.B else slice(None)
        if self.c.synthetic:
            return rng.integers(0, self.V, size=(n, self.T + 1), dtype=np.int32)[keep], None
        if isinstance(tokens, Concat):  # a manifest's shards: no window crosses one
            starts = tokens.window_starts(rng, n, self.T)
        else:
            starts = rng.integers(0, len(tokens) - self.T - 1, size=n)
        starts = starts[keep]
        idx = starts[:, None] + np.arange(self.T + 1)[None, :]
        return np.asarray(tokens[idx], dtype=np.int32), starts

    def train(self, step: int) -> dict:
        """This process's rows of step `step`'s global batch: each field (B/P, T)."""
        if self.packed is not None:
            return self._packed_rows(None, step)
        return self._rows(self.c.train, [self.seed, step, _TRAIN], self.B)

    def global_train(self, step: int) -> dict:
        """The whole global batch of a step (tests and single-process tools)."""
        if self.packed is not None:
            return self._packed_rows(None, step, everyone=True)
        saved, self.rows = self.rows, slice(None)
        try:
            return self._rows(self.c.train, [self.seed, step, _TRAIN], self.B)
        finally:
            self.rows = saved

    def eval(self, i: int) -> dict:
        """This process's rows of eval batch i, drawn from the held-out tokens only."""
        if self.packed is not None:
            if self.packed_eval is None:
                raise ValueError("no held-out part to evaluate on: build Batches with evaluates=True")
            return self._packed_rows(i, 0)
        if not self.c.synthetic and len(self.c.heldout) <= self.T + 1:
            raise ValueError("no held-out part to evaluate on: build Batches with evaluates=True")
        return self._rows(self.c.heldout, [self.seed, i, _EVAL], self.B)

    def iterate(self, start: int, stop: int, prefetch: int = 4, offset: int = 0):
        """Yield (step, rows) for steps [start, stop), produced ahead in a grain worker thread; step s
        trains on the batch at position s + offset (moved on by a rollback, trainer/guard.py)."""
        return prefetched(self.train, start, stop, prefetch, offset)
