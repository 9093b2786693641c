"""`meshtrain prepare SOURCES --out DIR/`: the documents in shards, each a prepared .bin (trainer/data/prepare.py's
formats: tokens, document index, loss mask, sidecar), and DIR/manifest.json naming them, written last.

Shards are cut from the documents in the order `collect` lists them (sources as given, files sorted; the training
files, then the held-out ones): text files fill a shard until it holds --shard-mb of input, a record file (JSONL,
Parquet) is a shard of its own, and a JSONL file on local disk of more than --shard-mb is cut at line ends into
pieces of about --shard-mb, each a shard (so the workers share it). The rule knows nothing of the workers, and a shard's bytes depend only on its
documents and the tokenizer, so 1 worker, N workers and a Ray cluster write the same bytes (no timings in a shard's
sidecar or the manifest). A tokenizer is trained once, before sharding, on every training document. Each shard is
written under temporary names and renamed into place (prepare's own `_finish`), and skipped when it is up to date: a
prepare killed at any point and run again redoes only the shards that were not finished; a finished one run again
writes nothing.

Workers: --workers N local processes (spawned; each tokenizer single-threaded, TOKENIZERS_PARALLELISM=false), or
with --ray ADDRESS|auto the same units as Ray tasks. One progress bar in this process, advanced as shards finish.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

from trainer.data import remote
from trainer.data.batches import sidecar_path
from trainer.data.chat import load_template, parse_date
from trainer.data.manifest import MANIFEST, Where
from trainer.data.prepare import (VERSION, Doc, _check_args, _given, _Job, _trained, _up_to_date, _write, collect,
                                  inputs_hash, none_held, sha256_file)
from trainer.data.records import Encoder
from trainer.errors import UserError

FORMAT = "meshtrain-manifest"


@dataclasses.dataclass(frozen=True)
class Unit:
    """One shard's work: its text documents by split and its record files."""
    index: int
    train: tuple[Doc, ...]
    held: tuple[Doc, ...]
    records: tuple[Doc, ...]

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}.bin"

    @property
    def size(self) -> int:
        return sum(d.size for d in self.train + self.held + self.records)


def units(train: list[Doc], held: list[Doc], records: list[Doc], shard_bytes: int) -> list[Unit]:
    """The shards' documents: the training text files, then the held-out ones, in collect's order (one shard holds
    what one .bin would, in its order), cut when a shard reaches shard_bytes of input; then each record file alone,
    or each of its pieces (`pieces`)."""
    split = {id(d) for d in train}
    out, cur, size = [], [], 0
    for d in train + held:
        cur.append(d)
        size += d.size
        if size >= shard_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    made = [Unit(i, tuple(d for d in ds if id(d) in split), tuple(d for d in ds if id(d) not in split), ())
            for i, ds in enumerate(out)]
    cut = [p for r in records for p in pieces(r, shard_bytes)]
    return made + [Unit(len(made) + i, (), (), (r,)) for i, r in enumerate(cut)]


def pieces(doc: Doc, shard_bytes: int) -> list[Doc]:
    """A JSONL file on local disk of more than shard_bytes as pieces of about shard_bytes, each ending at a line's
    end (a record is never cut) and knowing the line it starts at (error messages name the file's own lines); any
    other record file whole."""
    if doc.size <= shard_bytes or doc.path.suffix != ".jsonl" or not isinstance(doc.path, Path):
        return [doc]
    cuts, lines = [0], [1]
    with open(doc.path, "rb") as f:
        while cuts[-1] + shard_bytes < doc.size:
            f.seek(cuts[-1] + shard_bytes - 1)
            f.readline()  # to the end of the line that byte is in
            if (end := f.tell()) >= doc.size:
                break
            lines.append(lines[-1] + _newlines(f, cuts[-1], end))
            cuts.append(end)
    if len(cuts) == 1:
        return [doc]
    ends = cuts[1:] + [doc.size]
    return [Doc(f"{doc.name}@{a}", doc.path, b - a, a, b, n) for a, b, n in zip(cuts, ends, lines)]


def _check_cut(plan: list[Unit], entries: list[dict], heldout: float):
    """A file cut into pieces holds out some of its records as a whole (one piece alone need not; a whole record
    file's shard checks its own), before the manifest names any shard."""
    held: dict[str, int] = {}
    for u, e in zip(plan, entries):
        for d in u.records:
            if d.stop is not None:
                held[str(d.path)] = held.get(str(d.path), 0) + e["documents"]["heldout"]
    if heldout > 0 and (none := [p for p, n in held.items() if n == 0]):
        raise none_held(heldout, f"the records of {none[0]}")


def _newlines(f, start: int, stop: int) -> int:
    """The line ends in the bytes [start, stop) of f (leaving f at stop)."""
    f.seek(start)
    n, left = 0, stop - start
    while left > 0 and (b := f.read(min(left, 1 << 24))):
        n += b.count(b"\n")
        left -= len(b)
    return n


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every shard's worker needs besides its documents (plain values: they travel to other processes)."""
    folder: str
    sources: tuple[str, ...]
    tokenizer: str
    heldout: float
    field: str
    chat_template: str | None
    date: str | None
    loss_on: str
    require_counted: bool
    hashed: tuple  # the settings each shard's inputs hash covers (json-able pairs)
    upload: str | None = None  # --out in object storage: `folder` stages each shard, uploaded once written


def run_unit(unit: Unit, s: Settings) -> dict:
    """Write one shard (or find it up to date): its entry in the manifest."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    out = Path(s.folder) / unit.name
    day = parse_date(s.date)
    tk = _given(s.tokenizer)
    job = _Job(out, list(s.sources), s.heldout, s.loss_on, day, load_template(tk.path, s.chat_template, day),
               list(unit.train), list(unit.held), list(unit.records), timed=False)
    job.digest = inputs_hash(job.train, job.held + job.records, {**dict(s.hashed), "shard": unit.name})
    if s.upload and (meta := remote.remote_shard(s.upload, unit.name, job.digest)):
        return _entry(unit, meta)
    if not _up_to_date(out, job.digest, s.require_counted):
        enc = Encoder(tk.tok, tk.eot, job.template, s.loss_on, s.field, s.require_counted)
        enc.specials = tk.specials
        _write(job, tk, enc, 0.0, False)
    meta = json.loads(sidecar_path(out).read_text())
    if s.upload:
        remote.upload_shard(out, meta, s.upload)
    return _entry(unit, meta)


def _entry(unit: Unit, meta: dict) -> dict:
    return {"path": unit.name, "tokens": meta["tokens"], "documents": meta["documents"],
            "inputs_sha256": meta["inputs_sha256"], "loss_mask": "loss_mask" in meta, "input_bytes": unit.size,
            **({"prompts": True} if "prompts" in meta else {})}


def prepare_folder(sources: list[str], out: str, tokenizer: str | None, train_vocab: int | None, heldout: float,
                   log=print, show_progress: bool = True, field: str = "text", chat_template: str | None = None,
                   date: str | None = None, loss_on: str = "assistant", require_counted: bool = False,
                   workers: int | None = None, ray: str | None = None, shard_mb: float = 256.0,
                   upload: str | None = None) -> dict:
    """Tokenize the sources into shards in the folder `out` and write its manifest; returns the manifest
    (`skipped`: it was up to date). `out` a URL (s3://, gs://): the shards are written in a local staging folder
    and uploaded as each is finished (its sidecar last), the tokenizer first and the manifest last; what is there
    already, whole and of the same inputs, is not written again."""
    _check_args(sources, out, tokenizer, train_vocab, heldout, loss_on, folder=True)
    if remote.is_url(out):
        stage = Path(tempfile.mkdtemp(prefix="meshtrain-prepare-"))
        try:
            return prepare_folder(sources, str(stage), tokenizer, train_vocab, heldout, log, show_progress, field,
                                  chat_template, date, loss_on, require_counted, workers, ray, shard_mb, upload=out)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    folder = _folder_args(out, workers, shard_mb)
    ray_module = _ray() if ray else None
    train, held, records = collect(sources, heldout)
    plan = units(train, held, records, int(shard_mb * 2**20))
    _idle_workers(workers, len(plan), shard_mb, log)
    settings = {"version": VERSION, "sources": sources, "heldout": heldout, "train_vocab": train_vocab,
                "tokenizer_sha256": tokenizer and sha256_file(_given(tokenizer).path), "shard_mb": shard_mb,
                "field": field, "loss_on": loss_on, "date": parse_date(date).isoformat(),
                "chat_template": chat_template and sha256_file(chat_template)}
    digest = inputs_hash(train, held + records, settings)
    def whole(e: dict) -> bool:  # a shard the manifest names: there whole, of its inputs
        if upload:
            return remote.remote_shard(upload, e["path"], e["inputs_sha256"]) is not None
        return _up_to_date(folder / e["path"], e["inputs_sha256"], require_counted)
    done = _finished(upload or folder, digest, whole)
    if done is not None:
        log(f"skipped: {upload or out} is up to date (same inputs and settings as its {MANIFEST})")
        return {**done, "skipped": True}
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok_path = Path(tokenizer) if tokenizer else _train_once(folder, sources, heldout, train_vocab, train, held,
                                                            records, field, chat_template, date, loss_on, log)
    if upload:  # the bucket's copy is the one its manifest names
        tok_path = _tokenizer_to_bucket(tok_path, folder, upload)
    tk = _given(str(tok_path))
    hashed = {**settings, "tokenizer_sha256": sha256_file(tk.path)}
    s = Settings(str(folder), tuple(sources), str(tk.path), heldout, field, chat_template, date, loss_on,
                 require_counted, tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in hashed.items())), upload)
    n = workers or os.cpu_count() or 1
    t1 = time.perf_counter()
    entries = _run(plan, s, n, ray_module, ray, show_progress)
    _check_cut(plan, entries, heldout)
    took = time.perf_counter() - t1
    manifest = _manifest(entries, tk, digest, sources, heldout, folder)
    _write_manifest(manifest, folder, upload)
    n = min(n, len(plan))
    where = f"on the Ray cluster at {ray}" if ray else f"with {n} worker{'s' * (n > 1)}"
    log(f"wrote {remote.join(upload, MANIFEST) if upload else folder / MANIFEST}: {_counts(manifest, entries)} "
        f"{where} in {took:.1f}s ({manifest['tokens']['total'] / max(took, 1e-9):,.0f} tokens/s; "
        f"{time.perf_counter() - t0:.1f}s in all)")
    return {**manifest, "seconds": round(took, 3)}


def _counts(manifest: dict, entries: list) -> str:
    """'4 shards, 1,234 tokens (1,100 train, 134 held-out) from 12 documents' of a written manifest."""
    t, docs = manifest["tokens"], sum(sum(e["documents"].values()) for e in entries)
    return (f"{len(entries)} shards, {t['total']:,} tokens ({t['train']:,} train, {t['heldout']:,} held-out) from "
            f"{docs:,} documents")


def _folder_args(out: str, workers: int | None, shard_mb: float) -> Path:
    """The shards' folder, once --out, --workers and --shard-mb are checked (one line each)."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out '{out}' is a file; give a folder for shards (or a .bin for one token file)")
    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers} must be at least 1")
    if shard_mb <= 0:
        raise UserError(f"--shard-mb {shard_mb} must be positive; e.g. 256")
    return folder


def _idle_workers(workers: int | None, shards: int, shard_mb: float, log) -> None:
    """One line where --workers asks for more workers than there are shards to write."""
    if workers and workers > shards:
        log(f"--workers {workers}: {shards} shard{'s' * (shards > 1)} to write, so {workers - shards} "
            f"worker{'s' * (workers - shards > 1)} idle; shards hold --shard-mb {shard_mb:g} of text files or of "
            "a JSONL file on local disk (a Parquet file or an object in storage is one shard): a smaller --shard-mb "
            "makes more")


def _tokenizer_to_bucket(tok_path: Path, folder: Path, upload: str) -> Path:
    """The tokenizer copied into the staging folder and uploaded beside the shards (unless the bucket holds it
    already, byte for byte); its staged path."""
    if tok_path.resolve() != (folder / "tokenizer.json").resolve():
        tok_path = Path(shutil.copy(_given(str(tok_path)).path, folder / "tokenizer.json"))
    there = remote.join(upload, "tokenizer.json")
    if remote.size(there) is None or hashlib.sha256(remote.read_bytes(there)).hexdigest() != sha256_file(tok_path):
        remote.put(tok_path, there)
    return tok_path


def _write_manifest(manifest: dict, folder: Path, upload: str | None) -> None:
    """The manifest, last: to the bucket, or atomically into the folder (a temporary file renamed)."""
    if upload:
        remote.write_bytes(remote.join(upload, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())
    else:
        tmp = folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, folder / MANIFEST)


def _ray():
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray, which is not installed; pip install 'meshtrain[ray]' (or "
                        "pip install 'ray>=2.30'), or leave out --ray to use local --workers") from None
    return ray


def _finished(folder, digest: str, shard_ok) -> dict | None:
    """The manifest of a folder (on disk or in a bucket), if it is of these inputs, its tokenizer is the one it
    names and every shard passes shard_ok(entry); else None."""
    where = Where(folder)
    try:
        m = where.json(MANIFEST)
        tok = sha256_file(where.at(m["tokenizer"]["path"])) if not where.url else \
            hashlib.sha256(remote.read_bytes(where.at(m["tokenizer"]["path"]))).hexdigest()
        if m.get("inputs_sha256") != digest or tok != m["tokenizer"]["sha256"]:
            return None
        return m if all(shard_ok(e) for e in m["shards"]) else None
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None


def _train_once(folder: Path, sources, heldout, train_vocab, train, held, records, field, chat_template, date,
                loss_on, log) -> Path:
    """The byte-level BPE of --train-tokenizer, trained on every training document before sharding; written only
    where the folder's tokenizer.json differs (a rerun trains again, to the same bytes)."""
    day = parse_date(date)
    job = _Job(folder / "tokens.bin", list(sources), heldout, loss_on, day, load_template(None, chat_template, day),
               train, held, records)
    tk = _trained(job, train_vocab, Encoder(None, -1, job.template, loss_on, field, False), log)
    path = folder / "tokenizer.json"
    tmp = folder / "tokenizer.json.tmp"
    tk.tok.save(str(tmp))
    if path.is_file() and sha256_file(path) == sha256_file(tmp):
        tmp.unlink()
    else:
        os.replace(tmp, path)
    return path


def _run(plan: list[Unit], s: Settings, n: int, ray_module, address: str | None, show_progress: bool) -> list[dict]:
    """Every unit's manifest entry, in shard order: in this process (one worker), spawned processes or Ray tasks."""
    from trainer.data.prepare import _progress
    out = [None] * len(plan)
    with _progress(show_progress) as progress:
        task = progress.add_task("tokenize", total=sum(u.size for u in plan), tokens=0, rate="")
        t0, tokens = time.perf_counter(), 0

        def done(i: int, entry: dict):
            nonlocal tokens
            out[i] = entry
            tokens += entry["tokens"]["total"]
            progress.update(task, advance=plan[i].size, tokens=tokens,
                            rate=f"{tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")
        if ray_module is not None:
            _on_ray(ray_module, address, plan, s, done)
        elif min(n, len(plan)) == 1:  # one shard: no process to spawn
            for i, u in enumerate(plan):
                done(i, run_unit(u, s))
        else:
            ctx = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(min(n, len(plan)), mp_context=ctx) as pool:
                futures = {pool.submit(run_unit, u, s): i for i, u in enumerate(plan)}
                for f in concurrent.futures.as_completed(futures):
                    done(futures[f], f.result())
    return out


def _on_ray(ray, address: str, plan: list[Unit], s: Settings, done):
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        task = ray.remote(num_cpus=1)(run_unit)
        refs = {task.remote(u, s): i for i, u in enumerate(plan)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for r in ready:
                done(refs[r], ray.get(r))
    finally:
        if started:
            ray.shutdown()


def _manifest(entries: list[dict], tk, digest: str, sources, heldout: float, folder: Path) -> dict:
    p, f = Path(tk.path).resolve(), folder.resolve()
    tokens = {k: sum(e["tokens"][k] for e in entries) for k in ("train", "heldout", "total")}
    return {
        "format": FORMAT, "version": 1,
        "tokenizer": {"path": str(p.relative_to(f) if p.is_relative_to(f) else p), "sha256": sha256_file(p)},
        "vocab_size": tk.tok.get_vocab_size(with_added_tokens=True), "eot_id": tk.eot,
        "shards": entries, "tokens": tokens,
        "documents": {k: sum(e["documents"][k] for e in entries) for k in ("train", "heldout")},
        "sources": list(sources), "heldout_fraction": heldout, "inputs_sha256": digest,
    }

