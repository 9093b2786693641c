"""Training on a folder of shards (`data.source=DIR` holding `manifest.json`, trainer/data/shards.py).

The shards read as one corpus: every shard's training tokens in shard order, then every shard's held-out tokens,
each part a memory map (`Concat`: a process reads only the pages of the windows it builds). Windows never cross a
shard: a window's start is drawn among all shards' valid starts at once (each shard has len - T - 1 of them, so its
share of windows follows its tokens), which for one shard is today's draw exactly. Documents and loss masks come from
each shard's own index and mask, moved to where the shard's tokens lie in the whole.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainer.data import remote
from trainer.errors import UserError

MANIFEST = "manifest.json"


class Concat:
    """1-D arrays read as one: integer-array indexing (any shape) and slices, which stay views of the parts."""

    def __init__(self, parts: list, dtype):
        self.parts, self.dtype = [p for p in parts if len(p)], np.dtype(dtype)
        self.starts = np.cumsum([0] + [len(p) for p in self.parts]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate([np.asarray(p) for p in self.parts]) if self.parts else np.zeros(0, self.dtype)
        return out.astype(dtype) if dtype is not None else out

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            a, b, step = idx.indices(len(self))
            if step != 1:
                raise IndexError("a strided slice of a Concat")
            b = max(a, b)
            parts = [p[max(a - s, 0):min(b - s, len(p))] for p, s in zip(self.parts, self.starts)
                     if s < b and s + len(p) > a]
            return parts[0] if len(parts) == 1 else Concat(parts, self.dtype)
        idx = np.asarray(idx, np.int64)
        k = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty(idx.shape, self.dtype)
        for part in np.unique(k).tolist():
            sel = k == part
            out[sel] = self.parts[part][idx[sel] - self.starts[part]]
        return out

    def window_starts(self, rng, n: int, T: int) -> np.ndarray:
        """n window starts drawn as rng.integers(0, len - T - 1) over the parts' valid starts together: a window of
        T + 1 tokens lies inside one part."""
        lens = np.diff(self.starts)
        valid = np.maximum(lens - T - 1, 0)
        u = rng.integers(0, int(valid.sum()), size=n)
        ends = np.cumsum(valid)
        k = np.searchsorted(ends, u, side="right")
        return self.starts[k] + u - (ends[k] - valid[k])


class Where:
    """A folder on local disk or in object storage (trainer/data/remote.py): its files' sizes, bytes and arrays."""

    def __init__(self, folder):
        self.r, self.url = remote, remote.is_url(folder)
        self.folder = str(folder).rstrip("/") if self.url else Path(folder)

    def at(self, name: str):
        return self.r.join(self.folder, name) if self.url else self.folder / name

    def size(self, name: str) -> int | None:
        """Bytes of a file, None where it is missing."""
        if not self.url:
            p = self.folder / name
            return p.stat().st_size if p.is_file() else None
        return self.r.size(self.at(name))

    def json(self, name: str) -> dict:
        return self.r.read_json(self.at(name)) if self.url else json.loads((self.folder / name).read_text())

    def array(self, name: str, dtype):
        if self.url:
            return self.r.Remote(self.at(name), dtype)
        p = self.folder / name
        return np.memmap(p, dtype=dtype, mode="r") if p.stat().st_size else np.zeros(0, dtype)

    def small(self, name: str, dtype) -> np.ndarray:
        if self.url:
            return np.frombuffer(self.r.read_bytes(self.at(name)), dtype)
        return np.fromfile(self.folder / name, dtype=dtype)


def is_manifest(path) -> bool:
    if remote.is_url(path):
        return remote.exists(remote.join(str(path), MANIFEST))
    path = Path(path)
    return path.is_dir() and (path / MANIFEST).is_file()


def read_manifest(folder) -> dict:
    where = Where(folder)
    try:
        m = where.json(MANIFEST)
        m["shards"][0]["path"], m["vocab_size"]  # noqa: B018 (the keys used below)
        return m
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise UserError(f"'{where.at(MANIFEST)}' is not a readable manifest ({type(e).__name__}: {e}); run meshtrain "
                        "prepare --out FOLDER again") from None


def load(folder, source: str) -> dict:
    """The fields of the Corpus (trainer/data/batches.py) of a manifest's shards, on local disk or in object
    storage."""
    return _load(Where(folder), read_manifest(folder), source)


def load_url(source: str) -> dict:
    """A data.source in object storage: a folder of shards or a prepared .bin."""
    if is_manifest(source):
        return load(source, source)
    if source.endswith(".bin"):
        return load_bin(source, source)
    raise UserError(f"data.source '{source}' holds no manifest.json (a missing bucket or folder?); give a folder "
                    "written by meshtrain prepare --out URL/ or a prepared .bin")


def load_bin(url: str, source: str) -> dict:
    """A prepared .bin in object storage, read as a manifest of that one shard."""
    parent, _, name = url.rpartition("/")
    side = remote.read_json(url + ".json")
    m = {"shards": [{"path": name, "tokens": side["tokens"]}], "tokens": side["tokens"], "eot_id": side.get("eot_id"),
         "vocab_size": side["vocab_size"], "tokenizer": side["tokenizer"]}
    return _load(Where(parent), m, source)


def _load(where: Where, m: dict, source: str) -> dict:
    trains, helds, t_masks, h_masks, t_docs, h_docs, tb, hb, pairs = [], [], [], [], [], [], 0, 0, []
    n_train = m["tokens"]["train"]
    at_t = at_h = 0
    for e in m["shards"]:
        meta = _shard_meta(where, e, source)
        toks = where.array(e["path"], meta["dtype"])
        cut = int(meta["heldout_range"][0])
        trains.append(toks[:cut])
        helds.append(toks[cut:])
        if "loss_mask" in meta:
            mask = where.array(meta["loss_mask"]["path"], np.uint8)
            t_masks.append(mask[:cut])
            h_masks.append(mask[cut:])
        starts = where.small(meta["document_index"]["path"], np.uint64).astype(np.int64)
        t_docs.append(at_t + starts[starts < cut])
        h_docs.append(n_train + at_h + starts[(starts >= cut) & (starts < len(toks))] - cut)
        at_t, at_h = at_t + cut, at_h + len(toks) - cut
        tb, hb = tb + meta["bytes"]["train"], hb + meta["bytes"]["heldout"]
        pairs.append(bool(meta.get("pairs")))  # preference pairs (trainer/data/pairs.py): a prepared .bin of them
    dtype = np.result_type(*[t.dtype for t in trains])
    whole = Concat(trains + helds, dtype)
    doc_starts = np.concatenate(t_docs + h_docs + [[len(whole)]]).astype(np.int64)
    masks = None
    if t_masks:
        if len(t_masks) != len(trains):
            raise UserError(f"data.source '{source}' mixes shards with a loss mask (conversations) and shards "
                            "without; prepare them as separate sources (a data.mixture) or together again")
        masks = Concat(t_masks + h_masks, np.uint8)
    held_tokens = m["tokens"]["heldout"]
    return dict(train=Concat(trains, dtype), heldout=Concat(helds, dtype), vocab=int(m["vocab_size"]), whole=whole,
                bytes_per_token=None if masks is not None else (hb / held_tokens if held_tokens else
                                                                tb / max(n_train, 1)),
                prepared=True, eot_id=m.get("eot_id"), loss_mask=masks, doc_starts=np.unique(doc_starts),
                pairs=all(pairs))


def _shard_meta(where: Where, entry: dict, source: str) -> dict:
    """A shard's sidecar, checked against the manifest: present, and as many tokens and documents."""
    want, name = entry["tokens"]["total"], entry["path"]
    size = where.size(name)
    if size is None:
        raise UserError(f"data.source '{source}': shard '{name}' named by its {MANIFEST} is missing; run "
                        "meshtrain prepare --out FOLDER again (it redoes only what is missing)")
    try:
        meta = where.json(name + ".json")
        have = size // np.dtype(meta["dtype"]).itemsize
        index = meta["document_index"]
        ok = meta["tokens"]["total"] == want == have and where.size(index["path"]) == 8 * index["entries"]
    except (OSError, ValueError, KeyError, TypeError, UserError):
        meta, have, ok = None, 0, False
    if not ok:
        raise UserError(f"data.source '{source}': shard '{name}' has {max(have, 0):,} tokens where its "
                        f"{MANIFEST} says {want:,} (truncated or rewritten); run meshtrain prepare --out FOLDER again")
    return meta
