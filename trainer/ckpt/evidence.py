"""What counts as evidence that a checkpoint is damaged, as opposed to a failure to read it.

Damage: bytes that do not decode (metadata JSON, an OCDBT manifest or node), or a file that the
checkpoint's own index says exists with a byte range and that is missing or shorter; checksums are
checked by the caller. Everything else (out of memory, an OSError such as EIO, ENOSPC, EACCES, an
unrecognised exception) is not evidence: the checkpoint must then be left as it is.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

from trainer.data.remote import is_url

MISSING = (FileNotFoundError, NotADirectoryError)  # OSErrors that can be evidence (of a missing file)


class Layout(NamedTuple):
    """Where a directory keeps its metadata JSON and its Orbax array tree."""
    meta: str
    arrays: str


CHECKPOINT = Layout("meta/metadata", "state")  # run.dir/checkpoints/<step>/
EXPORT = Layout("meta.json", "params")  # a `meshtrain export` directory


class _Undecodable(Exception):
    """An OCDBT manifest or node whose bytes were read but do not decode."""


# tensorstore's texts for bytes that were read and do not decode: the status codes of a short or garbled
# record, a zstd frame (an array chunk; an OCDBT node, which tensorstore reports as FAILED_PRECONDITION), a manifest
_UNDECODABLE = re.compile(r"^(DATA_LOSS|OUT_OF_RANGE)|ZSTD_decompress\w*\(\) failed|Error decoding (b-tree node|manifest)")


def undecodable(e: BaseException) -> str | None:
    """'"<key>": <why>' where `e` (or what it was raised from) is tensorstore saying that bytes it read do
    not decode; None for anything else."""
    for x in _chain(e):
        text = str(x)
        m = _UNDECODABLE.search(text)
        if m:
            key = re.search(r'Error reading "([^"]+)"', text)
            why = re.search(r"(ZSTD_decompress\w*\(\) failed: [^;\[]*)", text)
            return (f'"{key.group(1)}" ' if key else "") + f"does not decode ({(why.group(1) if why else m.group(0)).strip()})"
    return None


def short(e: BaseException) -> str:
    """'Type: first line' of the innermost cause (the exception it was raised from)."""
    while e.__cause__ is not None:  # a wrapper's own text (Orbax: "Encountered error ...") says less
        e = e.__cause__
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _chain(e: BaseException | None) -> list[BaseException]:
    """e and everything it was raised from or while handling."""
    out = []
    while e is not None and len(out) < 32:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def evidence(e: Exception, step_dir: Path, layout: Layout = CHECKPOINT) -> str | None:
    """What shows that `step_dir` (a checkpoint, or an export with layout=EXPORT) is damaged, given that
    reading it raised `e`; None where nothing does (out of memory, I/O, disk, permissions, anything
    unrecognised): then it must stay as it is."""
    chain = _chain(e)
    if any(isinstance(x, MemoryError) or isinstance(x, OSError) and not isinstance(x, MISSING) for x in chain):
        return None
    try:
        found = damage(step_dir, layout)  # names the file, where it can
    except Exception:  # noqa: BLE001 - a directory that cannot be inspected proves nothing about its bytes
        found = None
    bad_json = next((x for x in chain if isinstance(x, (json.JSONDecodeError, UnicodeDecodeError))), None)
    return found or (f"undecodable metadata ({short(bad_json)})" if bad_json is not None else undecodable(e))


def damage(step_dir: Path, layout: Layout = CHECKPOINT) -> str | None:
    """A missing, empty, short or undecodable file of a checkpoint (or export) directory, found by
    reading its files (not by restoring it); None if every file the restore needs is there and whole."""
    if is_url(step_dir):  # object storage: damage shows as a checksum mismatch or undecodable JSON only
        return None
    d, meta, arrays = Path(step_dir), layout.meta, layout.arrays
    if not d.is_dir():  # gone altogether: a mount or a person, not damage of its bytes
        return None
    for rel in (meta, f"{arrays}/_METADATA", f"{arrays}/manifest.ocdbt"):
        if not (d / rel).is_file() or not (d / rel).stat().st_size:
            return f"{rel} is {'empty' if (d / rel).is_file() else 'missing'}"
    for f in [d / meta, d / arrays / "_METADATA", *sorted((d / arrays / "array_metadatas").glob("*"))]:
        try:
            json.loads(f.read_bytes())
        except ValueError as e:
            return f"{f.relative_to(d)} is not valid JSON ({short(e)})"
    return _ocdbt_damage(d / arrays, d)


def _ocdbt_damage(root: Path, d: Path) -> str | None:
    """A file that the state's OCDBT tree (manifest, B+tree nodes, values) refers to and that is
    missing or shorter than the byte range it should hold, or a node whose bytes do not decode."""
    import tensorstore as ts
    kv = ts.KvStore.open({"driver": "file", "path": f"{root.absolute()}/"}).result()

    def dump(loc=None):
        try:
            return ts.ocdbt.dump(kv, loc).result()
        except ValueError as e:
            if undecodable(e):
                where = (root / "manifest.ocdbt").relative_to(d) if loc is None else loc
                raise _Undecodable(f"{where} does not decode ({short(e)})") from None
            raise

    try:
        versions = dump()["versions"]
        todo = [versions[-1]["root"].get("location")] if versions else []
        while todo:
            loc = todo.pop()
            if loc is None:
                continue
            kind, rest = loc.split(":", 1)
            head, offset, length = rest.rsplit(":", 2)
            base, rel = head.rsplit(":", 1)
            f = root / base / rel
            if not f.is_file():
                return f"{f.relative_to(d)} is missing"
            if f.stat().st_size < int(offset) + int(length):
                return f"{f.relative_to(d)} has {f.stat().st_size} bytes, {int(offset) + int(length)} expected"
            if kind == "btreenode":
                todo += [v for e in dump(loc)["entries"] for v in e.values()
                         if isinstance(v, str) and v.startswith(("btreenode:", "value:"))]
    except _Undecodable as e:
        return str(e)
    return None
