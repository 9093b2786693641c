"""Weighted mixtures of sources (`data.mixture`, `data.mixture_schedule`): the batch of step s still a pure function
of (seed, s).

data.mixture lists [NAME:]SOURCE=WEIGHT entries (any data.source: a prepared .bin, a folder of shards, ...); a source
is named by its entry's NAME, or else by its file or folder name without suffix (eval_loss/NAME).
data.mixture_schedule lists STEP:NAME=WEIGHT entries: from step STEP on, NAME's weight is WEIGHT (the others keep
theirs).

Rows: step s's B rows go to the sources by systematic sampling, one uniform draw r of (seed, s) and row i at
(i + r) / B on the weights' cumulative distribution: each source gets its weight's share of the rows, rounded up or
down, every step (the rows of a source are consecutive). Each source draws its rows' windows with its own words
(seed, s, source index): a resume or another mesh reads the same batch; a process builds only its own rows. One
source of weight 1 draws exactly as that source alone. The sources' tokens are memory maps, read where a row needs
them, in the one loader thread of every run: threads and host memory do not grow with the sources.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from trainer.config.mixture_entries import check_schedule, parse_entries, parse_schedule
from trainer.data.batches import _TRAIN, Batches, load_corpus
from trainer.data.checks import data_tokenizer, same_tokenizer
from trainer.data.feed import prefetched
from trainer.data.remote import is_url
from trainer.errors import UserError

_MIX = 0x313  # the words of a step's row assignment: (seed, step, _MIX)


def weights_at(w0: np.ndarray, schedule: list[tuple[int, int, float]], step: int) -> np.ndarray:
    """The weights a step draws with (step is 0-based, a schedule's STEP counts from 1 as train.steps does: the
    change takes effect at the STEP-th step, step index STEP - 1)."""
    w = w0.copy()
    for at, j, weight in schedule:
        if at - 1 <= step:
            w[j] = weight
    return w


def assignment(seed: int, step: int, B: int, w: np.ndarray) -> np.ndarray:
    """The source of each of the B rows of a step: systematic sampling on the weights."""
    r = np.random.default_rng([seed, step, _MIX]).random()
    cum = np.cumsum(w) / w.sum()
    return np.minimum(np.searchsorted(cum, (np.arange(B) + r) / B, side="right"), len(w) - 1)


class Mixture:
    """The batches of a mixture: Batches' interface (train, global_train, iterate, rows, note; eval_of(j, i) for
    source j's eval batches), each source a Batches of its own."""

    def __init__(self, cfg_data, seed: int, batch_size: int, seq_len: int, vocab_size: int, process_index: int = 0,
                 process_count: int = 1, evaluates: bool = True, document_mask: bool = False):
        self.sources, self.names, self.w0 = parse_entries(cfg_data.mixture)
        self.schedule = parse_schedule(cfg_data.mixture_schedule, self.names)
        check_schedule(self.w0, self.schedule)
        corpora = [_load(e, s, cfg_data) for e, s in zip(cfg_data.mixture, self.sources)]
        same_tokenizer(self.names, [data_tokenizer(s) for s in self.sources])  # as train and plan check first
        for c, name in zip(corpora, self.names):
            if c.loss_mask is not None:
                raise UserError(f"data.mixture source '{name}' has a loss mask (conversations), which a mixture does "
                                "not pack yet; mix token sources, or train on it alone with data.source")
        self.parts = [Batches(c, seed, batch_size, seq_len, vocab_size, process_index, process_count, evaluates,
                              document_mask) for c in corpora]
        self.seed, self.B, self.rows = seed, batch_size, self.parts[0].rows
        self.c = SimpleNamespace(bytes_per_token=None)  # the mixture's bytes per token: per source (eval_bpb/NAME)
        mix = ", ".join(f"{n} {w:g}" for n, w in zip(self.names, self.w0))
        self.note = f"mixing {len(self.names)} sources: {mix}" + (
            f"; {len(self.schedule)} weight changes from step {self.schedule[0][0]}" if self.schedule else "")

    def weights(self, step: int) -> np.ndarray:
        return weights_at(self.w0, self.schedule, step)

    def _build(self, step: int, rows: slice) -> dict:
        src = self.sources_of(step)
        mine = np.arange(self.B)[rows]
        out = None
        for j, b in enumerate(self.parts):
            at = np.flatnonzero(src == j)  # the global rows source j fills
            if not len(at):
                continue
            keep = np.flatnonzero((at >= mine[0]) & (at <= mine[-1])) if len(mine) else at[:0]
            words = [self.seed, step, _TRAIN] if len(self.parts) == 1 else [self.seed, step, _TRAIN, j]
            got = b.rows_of(b.c.train, words, len(at), keep)
            if out is None:
                out = {k: np.zeros((len(mine),) + v.shape[1:], v.dtype) for k, v in got.items()}
            for k, v in got.items():
                out[k][at[keep] - (mine[0] if len(mine) else 0)] = v
        return out

    def train(self, step: int) -> dict:
        return self._build(step, self.rows)

    def global_train(self, step: int) -> dict:
        return self._build(step, slice(None))

    def sources_of(self, step: int) -> np.ndarray:
        """Each global row's source index at a step."""
        return assignment(self.seed, step, self.B, self.weights(step))

    def eval_of(self, j: int, i: int) -> dict:
        return self.parts[j].eval(i)

    def iterate(self, start: int, stop: int, prefetch: int = 4, offset: int = 0):
        return prefetched(self.train, start, stop, prefetch, offset)


def _load(entry: str, source: str, cfg_data):
    """One source's corpus; its errors name the data.mixture entry (they say data.source of a source alone)."""
    if not is_url(source) and source not in ("builtin", "synthetic") and not Path(source).exists():
        raise UserError(f"data.mixture entry '{entry}' names source '{source}', which does not exist; give an "
                        f"existing file or folder (meshtrain prepare ... --out {source})")
    try:
        return load_corpus(source, cfg_data.heldout_fraction, cfg_data.bin_dtype)
    except UserError as e:
        raise UserError(str(e).replace(f"data.source '{source}'", f"data.mixture entry '{entry}': source "
                                       f"'{source}'")) from None
