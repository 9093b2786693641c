"""Packing whole documents (conversations) into rows of T tokens, once, and the rows of any step.

A document of n tokens has n - 1 targets; it takes n - 1 slots of a row (inputs t0..t(n-2), targets
t1..t(n-1)). One longer than a row is split into pieces of at most T slots, each keeping its true positions
(never dropped; the count is logged). The pieces are packed best-fit decreasing (each, longest first, into the
row whose room left is the smallest that holds it), which leaves little padding whatever the lengths; padding
has segment 0 and weight 0. The packing depends on T and the documents only.

Rows are visited in epochs: global row g of the run (step s, row j: g = s x B + j) is row perm_e[g mod R] of
epoch e = g // R, perm_e a permutation drawn from (seed, e). So the batch of a step is a pure function of
(seed, step, process), as for random windows: resume, resharding and multi-host loading stay exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.batch import ALL_DTYPES, FIELDS

_EPOCH = 0x9AC


@dataclass
class Packing:
    row_ptr: np.ndarray  # (R + 1,): row r holds pieces row_ptr[r]:row_ptr[r + 1]
    start: np.ndarray  # each piece's first input token, in the token array
    length: np.ndarray  # each piece's slots (targets), at most T
    offset: np.ndarray  # each piece's first position: its offset inside its document
    documents: int
    split: int  # documents longer than a row, split into pieces

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1

    def filled(self, T: int) -> float:
        return float(self.length.sum()) / max(self.rows * T, 1)


def pieces(doc_starts: np.ndarray, T: int):
    """(start, length, offset) of every piece of the documents starting at doc_starts (the end last)."""
    a, b = doc_starts[:-1].astype(np.int64), doc_starts[1:].astype(np.int64)
    slots = np.maximum(b - a - 1, 0)
    keep = slots > 0  # a one-token document has no target
    a, slots = a[keep], slots[keep]
    per = -(-slots // T)
    doc = np.repeat(np.arange(len(a)), per)
    k = np.arange(len(doc)) - np.repeat(np.cumsum(per) - per, per)  # the piece's number inside its document
    offset = k * T
    return a[doc] + offset, np.minimum(slots[doc] - offset, T), offset, int((per > 1).sum()), len(a)


def pack(doc_starts: np.ndarray, T: int) -> Packing:
    start, length, offset, split, n_docs = pieces(doc_starts, T)
    order = np.argsort(-length, kind="stable")
    row_of = np.empty(len(order), np.int64)  # each piece's row
    size = 1 << int(T).bit_length()  # a tree over room left 0..T: tree[node] counts the rows below it
    tree = [0] * (2 * size)
    bucket: list[list[int]] = [[] for _ in range(T + 1)]  # the rows with each room left
    n_rows = 0

    def change(room: int, d: int):
        i = room + size
        while i:
            tree[i] += d
            i >>= 1

    def smallest_at_least(need: int) -> int:
        i = need + size
        if tree[i]:
            return need
        while i > 1:
            if not i & 1 and tree[i + 1]:
                i += 1
                break
            i >>= 1
        else:
            return -1
        while i < size:
            i = 2 * i if tree[2 * i] else 2 * i + 1
        return i - size

    for p in order.tolist():
        need = int(length[p])
        room = smallest_at_least(need) if need < T else -1
        if room < 0:  # a new row
            r, room = n_rows, T
            n_rows += 1
        else:
            r = bucket[room].pop()
            change(room, -1)
        row_of[p] = r
        if room - need > 0:
            bucket[room - need].append(r)
            change(room - need, 1)
    by_row = np.lexsort((np.arange(len(order)), row_of))  # pieces row by row, each row in document order
    counts = np.bincount(row_of, minlength=n_rows)
    return Packing(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), start[by_row], length[by_row],
                   offset[by_row], n_docs, split)


def rows_of(p: Packing, seed: int, first: int, n: int, cache: dict) -> np.ndarray:
    """The packed rows at global row indices first .. first + n - 1, epoch by epoch in a seeded order."""
    g = np.arange(first, first + n, dtype=np.int64)
    epoch, at = g // p.rows, g % p.rows
    out = np.empty(n, np.int64)
    for e in np.unique(epoch).tolist():
        if e not in cache:
            if len(cache) > 2:
                cache.clear()
            cache[e] = np.random.default_rng([seed, e, _EPOCH]).permutation(p.rows)
        sel = epoch == e
        out[sel] = cache[e][at[sel]]
    return out


def fields(p: Packing, rows, tokens: np.ndarray, mask: np.ndarray, T: int, ref: np.ndarray | None = None) -> dict:
    """The batch fields of packed rows (-1: a padding row): segment k for its k-th piece, each piece's true
    positions, and the loss mask's weight for each target; the rest padding (segment 0, weight 0). With `ref` (a
    value per token: preference pairs' reference log-probabilities) the field ref_logp holds each target's."""
    B = len(rows)
    out = {f: np.zeros((B, T), ALL_DTYPES[f]) for f in FIELDS + (("ref_logp",) if ref is not None else ())}
    for i, k, seg, at, s, n in _pieces_of(p, rows):
        out["tokens"][i, at:at + n] = tokens[s:s + n]
        out["targets"][i, at:at + n] = tokens[s + 1:s + n + 1]  # the next token of its document
        out["loss_weight"][i, at:at + n] = mask[s + 1:s + n + 1]
        out["segment_ids"][i, at:at + n] = seg
        out["positions"][i, at:at + n] = p.offset[k] + np.arange(n)
        if ref is not None:
            out["ref_logp"][i, at:at + n] = ref[s + 1:s + n + 1]
    return out


def _pieces_of(p: Packing, rows):
    """(row's index in rows, piece, its segment (1, 2, ... in the row), its first slot in the row, its first token,
    its slots) of each piece of rows (-1: a padding row, none)."""
    for i, r in enumerate(rows):
        at = 0
        for k in range(int(p.row_ptr[r]), int(p.row_ptr[r + 1])) if r >= 0 else ():
            yield i, k, k - int(p.row_ptr[r]) + 1, at, int(p.start[k]), int(p.length[k])
            at += int(p.length[k])


def scatter(p: Packing, rows, values_BT: np.ndarray, out: np.ndarray):
    """The inverse of `fields` for one value per slot: each target's value put at its token in `out`."""
    for i, _, _, at, s, n in _pieces_of(p, rows):
        out[s + 1:s + n + 1] = values_BT[i, at:at + n]
