"""Data in object storage: `s3://` and `gs://` (any fsspec URL) for a prepared .bin or a folder of shards.

A URL is read through fsspec (`s3fs`, `gcsfs`: the s3 and gcs extras; a scheme without its package is one line
saying what to install; the endpoint and credentials are the library's own: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).
Token files and loss masks are never downloaded whole: `Remote` reads the byte ranges a batch's windows need, rounded
out to blocks of `BLOCK` bytes, through one `Blocks` cache per process: an LRU of blocks in this process's memory,
at most `CACHE` bytes (nothing is written to local disk). Small files (the manifest, sidecars, document indexes) are
read whole. A failed read is retried `TRIES` times with exponential backoff, then stops the run with one line naming
the object. An object's blocks are cached under its version (`version`: S3's ETag, GCS's generation) as read when it
was opened; each fetch of blocks is followed by a look at the object's version, so an object rewritten while a run
reads it stops the run with one line rather than mixing the bytes of two versions.
"""
from __future__ import annotations

import collections
import functools
import json
import threading
import time

import numpy as np

from trainer.config.paths import is_url  # noqa: F401 - the one rule of what a URL is (a mistyped one: check())
from trainer.errors import UserError

BLOCK = 1 << 12  # bytes per cached block: a window of 8,192 uint16 tokens (16 KiB) is fetched as 5 or 6 of them
CACHE = 256 << 20  # bytes of blocks kept per process
TRIES = 5
EXTRAS = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}


def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def filesystem(url: str):
    """(fsspec filesystem, path inside it) of a URL; one line where its scheme's package is missing."""
    import fsspec
    scheme = url.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError:
        pkg, extra = EXTRAS.get(scheme, (f"the fsspec backend for {scheme}://", scheme))
        raise UserError(f"'{url}': {scheme}:// paths need {pkg}, which is not installed; pip install "
                        f"'meshtrain[{extra}]' (or pip install {pkg})") from None
    except ValueError as e:
        raise UserError(f"'{url}' is not a URL fsspec knows ({e}); give s3://BUCKET/PATH or gs://BUCKET/PATH") from None
    if scheme == "s3" and not (getattr(fs, "anon", False) or getattr(fs, "key", None)):
        _check_credentials(url)
    return fs, path


# where botocore finds credentials (https://docs.aws.amazon.com/cli/latest/userguide/cli-configure-envvars.html)
CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                   "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                   "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_EC2_METADATA_DISABLED")


def _check_credentials(url: str):
    """One line naming what is missing where botocore's chain (the variables, ~/.aws, the instance's role) finds no
    credentials: else every later request ends in NoCredentialsError, or an existence check says 'no bucket'."""
    import os
    if not _credentials_found(tuple(os.environ.get(k) for k in CREDENTIAL_VARS), os.path.expanduser("~")):
        unset = " and ".join(k for k in CREDENTIAL_VARS[:2] if not os.environ.get(k)) or "no variable"
        raise UserError(f"'{url}': no AWS credentials found ({unset} unset, and no AWS_PROFILE, ~/.aws/credentials "
                        "or instance role gives any); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with "
                        "AWS_ENDPOINT_URL for a store other than AWS S3)")


@functools.lru_cache(maxsize=8)
def _credentials_found(env: tuple, home: str) -> bool:  # keyed by what the chain reads: asked once per setting
    import botocore.session
    return botocore.session.get_session().get_credentials() is not None


def _retried(what: str, fn):
    """fn() with TRIES tries and backoff on a failed read; a missing object or bucket at once, one line."""
    for k in range(TRIES):
        try:
            return fn()
        except FileNotFoundError as e:
            raise UserError(f"'{what}' does not exist ({e}); check the bucket and the path") from None
        except (OSError, TimeoutError, RuntimeError) as e:
            if k == TRIES - 1:
                raise UserError(f"reading '{what}' failed {TRIES} times ({type(e).__name__}: {e}); check the "
                                "endpoint, the credentials and the object") from None
            time.sleep(0.1 * 2 ** k)


# The fields of fsspec's info() that name an object's version, in order of preference: a versioned bucket's version,
# GCS's generation, the content's ETag or hash, then the time it was written (one-second resolution on S3)
VERSIONS = ("VersionId", "generation", "ETag", "etag", "md5Hash", "LastModified", "updated", "mtime", "created")


def version(info: dict) -> str:
    """An object's version as its store's listing or info() gives it ('' where it gives none)."""
    for k in VERSIONS:
        if info.get(k) not in (None, "", "null"):
            return f"{k}={info[k]}"
    return ""


def stat(url: str) -> tuple[int, str]:
    """(size, version) of an object as the store has it now (not a cached listing)."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    info = _retried(url, lambda: fs.info(path))
    return int(info["size"]), version(info)


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    return _retried(url, lambda: fs.cat_file(path))


def read_json(url: str) -> dict:
    return json.loads(read_bytes(url))


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    try:
        return fs.exists(path)
    except (OSError, ValueError):
        return False


class Blocks:
    """The process's cache of object blocks: an LRU of at most `capacity` bytes; counts the bytes it fetched."""

    def __init__(self, block: int = BLOCK, capacity: int = CACHE):
        self.block, self.capacity, self.fetched = block, capacity, 0
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._held, self._lock = 0, threading.Lock()

    def read(self, obj: "Remote", start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the object, whole blocks fetched (one range request per run of missing ones), each
        fetch checked against the object's version (obj.check)."""
        b, key = self.block, (obj.url, obj.version)
        first, last = start // b, (stop - 1) // b
        got, missing = {}, []
        with self._lock:
            for i in range(first, last + 1):
                if key + (i,) in self._lru:
                    self._lru.move_to_end(key + (i,))
                    got[i] = self._lru[key + (i,)]
                else:
                    missing.append(i)
        for run in _runs(missing):
            lo, hi = run[0] * b, min((run[-1] + 1) * b, obj.size)
            data = _retried(obj.url, lambda lo=lo, hi=hi: obj.fs.cat_file(obj.path, start=lo, end=hi))
            obj.check()  # the bytes are of the version the cache holds, or the run stops here
            with self._lock:
                self.fetched += len(data)
                for i in run:
                    piece = data[(i - run[0]) * b:(i - run[0] + 1) * b]
                    got[i] = piece
                    self._lru[key + (i,)] = piece
                    self._held += len(piece)
                while self._held > self.capacity and self._lru:
                    self._held -= len(self._lru.popitem(last=False)[1])
        whole = b"".join(got[i] for i in range(first, last + 1))
        return whole[start - first * b:stop - first * b]


def _runs(ids: list[int]) -> list[list[int]]:
    out = []
    for i in ids:
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


BLOCKS = Blocks()


class Remote:
    """A 1-D array of `dtype` in an object (from byte `offset`, `n` items): slices and integer-array indexing read
    only the ranges they touch (each contiguous run of indices one read), through BLOCKS."""

    def __init__(self, url: str, dtype, n: int | None = None, offset: int = 0, blocks: Blocks | None = None,
                 seen: tuple[int, str] | None = None):
        self.url, self.dtype, self.offset = url, np.dtype(dtype), offset
        self.fs, self.path = filesystem(url)
        self.size, self.version = seen or stat(url)  # (size, version) when opened; a slice keeps its array's
        self.n = (self.size - offset) // self.dtype.itemsize if n is None else n
        self.blocks = blocks or BLOCKS

    def check(self):
        """One line where the object is no longer the version this array was opened on."""
        size, now = stat(self.url)
        if now != self.version or size != self.size:
            raise UserError(f"'{self.url}' changed while this run read it ({self.version or 'unversioned'}, "
                            f"{self.size} bytes -> {now or 'unversioned'}, {size} bytes): its blocks would mix two "
                            "versions; leave data a run reads as it is (write new data under a new path), then "
                            "start the run again")

    def __len__(self) -> int:
        return self.n

    @property
    def shape(self) -> tuple[int]:
        return (self.n,)

    def _range(self, a: int, b: int) -> np.ndarray:
        if b <= a:
            return np.zeros(0, self.dtype)
        k = self.dtype.itemsize
        raw = self.blocks.read(self, self.offset + a * k, self.offset + b * k)
        return np.frombuffer(raw, self.dtype)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            a, b, step = idx.indices(self.n)
            if step != 1:
                raise IndexError("a strided slice of a remote array")
            return Remote(self.url, self.dtype, max(b - a, 0), self.offset + a * self.dtype.itemsize, self.blocks,
                          (self.size, self.version))
        idx = np.asarray(idx, np.int64)
        flat = np.unique(idx)
        cuts = np.flatnonzero(np.diff(flat) != 1) + 1
        values = np.concatenate([self._range(int(r[0]), int(r[-1]) + 1) for r in np.split(flat, cuts)]) \
            if len(flat) else np.zeros(0, self.dtype)
        return values[np.searchsorted(flat, idx)]

    def __array__(self, dtype=None, copy=None):
        out = self._range(0, self.n)
        return out.astype(dtype) if dtype is not None else out


# ------------------------------------------------------------------- prepare's output (trainer/data/shards.py)

def put(local, url: str):
    fs, path = filesystem(url)
    _retried(url, lambda: fs.put_file(str(local), path))


def write_bytes(url: str, data: bytes):
    """One object written whole (an object store's PUT: readers see the old object or the new one)."""
    fs, path = filesystem(url)
    _retried(url, lambda: fs.pipe_file(path, data))


def size(url: str) -> int | None:
    fs, path = filesystem(url)
    try:
        return fs.size(path)
    except FileNotFoundError:
        return None


def shard_files(bin_path, meta: dict) -> list[str]:
    """A shard's file names beside its .bin: the tokens, index, mask and template its sidecar names; the sidecar
    last (uploaded last: a shard whose sidecar is there is whole)."""
    from pathlib import Path
    names = [Path(bin_path).name, meta["document_index"]["path"]]
    names += [x["path"] for x in (meta.get("loss_mask"), meta.get("chat_template")) if x]
    return names + [Path(bin_path).name + ".json"]


def upload_shard(bin_path, meta: dict, base: str):
    """Upload a shard written under `bin_path`'s folder to the folder URL `base`, sidecar last, then remove it here."""
    from pathlib import Path
    folder = Path(bin_path).parent
    for name in shard_files(bin_path, meta):
        put(folder / name, join(base, name))
    for name in shard_files(bin_path, meta):
        (folder / name).unlink(missing_ok=True)


def remote_shard(base: str, name: str, digest: str) -> dict | None:
    """A shard's sidecar in object storage if the shard is there whole and of these inputs, else None."""
    try:
        meta = read_json(join(base, name + ".json"))
    except (UserError, ValueError):
        return None
    if meta.get("inputs_sha256") != digest:
        return None
    total = meta["tokens"]["total"]
    want = {name: total * np.dtype(meta["dtype"]).itemsize,
            meta["document_index"]["path"]: 8 * meta["document_index"]["entries"]}
    if meta.get("loss_mask"):
        want[meta["loss_mask"]["path"]] = total
    return meta if all(size(join(base, n)) == b for n, b in want.items()) else None


# ----------------------------------------------------------------------------- prepare's sources

class Object:
    """An object in storage as prepare reads a source file: the pathlib.Path calls it makes (name, suffix, size,
    open for reading, relative_to its source's root, ordering); picklable for the workers (the URL, size and
    version as listed)."""

    def __init__(self, url: str, size: int, version: str = ""):
        self.url, self.size, self.version = url, size, version

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Object({self.url!r})"

    def __lt__(self, other) -> bool:  # by path components, as pathlib orders a local folder's files
        return self.url.split("/") < str(other).split("/")

    def __eq__(self, other) -> bool:
        return isinstance(other, Object) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rpartition("/")[2]

    @property
    def suffix(self) -> str:
        stem, dot, ext = self.name.rpartition(".")
        return f".{ext}" if dot and stem else ""

    def relative_to(self, root) -> str:
        return self.url[len(str(root).rstrip("/")) + 1:]

    def stat(self):
        return type("Stat", (), {"st_size": self.size})()

    def open(self, mode: str = "rb"):
        fs, path = filesystem(self.url)
        return _retried(self.url, lambda: fs.open(path, mode))


def open_source(path):
    """A source file or object (Object), for reading bytes."""
    return path.open("rb") if isinstance(path, Object) else open(path, "rb")


def objects(url: str) -> tuple[str, list[Object]]:
    """(the root names are relative to, every object under a URL or the one it names, sorted); one line where there
    is none."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)  # what the store holds now, not this process's earlier listing
    try:
        found = _retried(url, lambda: fs.find(path, detail=True))
    except UserError:
        found = {}
    if not found:
        raise UserError(f"source '{url}' does not exist (no object under it); check the bucket and the path")
    proto = url.split("://", 1)[0]
    files = sorted(Object(f"{proto}://{k}", int(v.get("size") or 0), version(v)) for k, v in found.items()
                   if v.get("type", "file") == "file")
    one = len(files) == 1 and files[0].url == url.rstrip("/")  # a URL naming one object: its folder is the root
    return (files[0].url.rpartition("/")[0] if one else url.rstrip("/")), files


def cache_root():
    """Where objects copied whole are kept: $MESHTRAIN_CACHE, else ~/.cache/meshtrain."""
    import os
    from pathlib import Path
    return Path(os.environ.get("MESHTRAIN_CACHE") or Path.home() / ".cache" / "meshtrain")


def mirror(url: str, only: tuple[str, ...] | None = None):
    """A local copy of every object under `url` (a model.init_from folder: its weights are read whole anyway), in
    cache_root()/objects/<hash of the URL and of every object's name, size and version>/: a folder whose objects
    changed (whatever their sizes) is copied afresh; an object already in the copy is not fetched again. Each object
    is downloaded under a name of its own (two processes on one host copying the same folder never write one file)
    and renamed. `only`: just the objects of these names under the folder. Returns the copy's folder."""
    import hashlib
    import json
    import os
    import tempfile
    root, files = objects(url)
    files = [f for f in files if only is None or f.relative_to(root) in only]
    listing = json.dumps([url.rstrip("/"), [(f.relative_to(root), f.size, f.version) for f in files]])
    here = cache_root() / "objects" / hashlib.sha256(listing.encode()).hexdigest()[:16]
    for f in files:
        dst = here / f.relative_to(root)
        if dst.is_file() and dst.stat().st_size == f.size:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".part")
        os.close(handle)
        fs, path = filesystem(f.url)
        try:
            _retried(f.url, lambda fs=fs, path=path, tmp=tmp: fs.get_file(path, tmp))
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return here

