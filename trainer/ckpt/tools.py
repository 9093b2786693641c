"""`meshtrain inspect` (what a run's checkpoints hold) and `meshtrain export` (parameters only)."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from meshes import AXES, recorded
from trainer.ckpt.objects import absolute, path_of
from trainer.ckpt.params import load_params_at
from trainer.ckpt.store import (EXPORT_META, FORMAT, SUBDIR, CorruptCheckpoint, config_dict, describe_leaves, is_export,
                                list_steps, read_meta)
from trainer.config import to_yaml
from trainer.config.paths import check
from trainer.data import remote
from trainer.errors import UserError

EXPORT_DTYPES = ("float32", "bfloat16")


def _size(path) -> int:
    if remote.is_url(path):  # one listing, not a request per object
        fs, key = remote.filesystem(str(path))
        return int(fs.du(key))
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def _leaf_table(leaves: dict, prefix: str) -> list[str]:
    rows = [(n.removeprefix(prefix), str(tuple(v["shape"])), v["dtype"], v["spec"] or "-")
            for n, v in leaves.items() if n.startswith(prefix)]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return [f"  {a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}" for a, b, c, d in rows]


def inspect_run(run_dir) -> str:
    """A run's checkpoints (step, size, time, mesh, ZeRO stage) and the newest one's parameters."""
    path = path_of(check(run_dir, "--run"))
    if is_export(path):
        meta = json.loads((path / EXPORT_META).read_text())
        return "\n".join([f"export {path}: parameters of step {meta['step']} as {meta['dtype']} "
                          f"({_human(_size(path))}), from {meta['source']}", "parameters (shape, dtype):"]
                         + _leaf_table(meta["leaves"], "params."))
    steps = list_steps(path)
    if not steps:
        raise UserError(f"'{run_dir}' has no complete checkpoints in {path / SUBDIR}; give the run.dir of a "
                        "run that saved checkpoints")
    lines = [f"run {path}: {len(steps)} checkpoint(s)",
             f"  {'step':>8}  {'size':>9}  {'saved':19}  {'mesh ' + ' x '.join(a.name[0] for a in AXES):14}  ZeRO  "
             "devices"]
    newest = None
    for step in steps:
        try:
            meta = read_meta(path, step)
        except CorruptCheckpoint as e:
            lines.append(f"  {step:>8}  unreadable: {e}")
            continue
        newest = meta
        mesh = str(recorded(meta["mesh"]))
        when = datetime.datetime.fromtimestamp(meta["saved_at"]).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"  {step:>8}  {_human(_size(path / SUBDIR / str(step))):>9}  {when}  {mesh:14}  "
                     f"{meta['zero_stage']:>4}  {meta['devices']:>7}")
    aside = sorted(p.name for p in (path / SUBDIR).iterdir() if p.is_dir() and not p.name.isdigit())
    if aside:
        lines.append("not loadable (partial saves or checkpoints moved aside as corrupt): " + ", ".join(aside))
    if newest is not None:
        lines += [f"parameters at step {newest['step']} (shape, dtype, sharding over "
                  f"({', '.join(a.name for a in AXES)})):"]
        lines += _leaf_table(newest["leaves"], "params.")
        base = newest.get("base")  # a LoRA run's frozen base, by reference (trainer/ckpt/base_ref.py)
        if base:
            lines += [f"the frozen base, not saved: {len(base['leaves'])} parameters read from model.init_from="
                      f"{base['init_from']} and checked against their recorded checksums:"]
            lines += _leaf_table(base["leaves"], "params.")
    return "\n".join(lines)


def _sync(name: str):
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _unused_out(out: str) -> tuple[Path | None, Path]:
    """(the folder `out` will be, None for a URL; the first of it and its parents that exists, or a local staging
    root for a URL): one line where `out` is not a new or empty directory, or a mistyped URL."""
    check(out, "--out")
    if remote.is_url(out):
        if jax.process_count() > 1:
            raise UserError(f"--out {out}: an export to object storage is written by one process; export to a local "
                            "folder on a shared disk and copy it, or run the export as one process")
        bucket = out.split("://", 1)[0] + "://" + out.split("://", 1)[1].split("/", 1)[0]
        if not remote.exists(bucket):
            raise UserError(f"--out {out}: bucket '{bucket}' does not exist (or cannot be reached at the endpoint); "
                            "create it or give another --out")
        fs, key = remote.filesystem(out)
        fs.invalidate_cache(key)
        if fs.find(key):
            raise UserError(f"--out {out} exists and is not empty; choose a new directory")
        return None, Path(tempfile.gettempdir())
    p = Path(out)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise UserError(f"--out {out} exists and is not empty; choose a new directory")
    near = next(a for a in (p, *p.absolute().parents) if a.exists())
    if not near.is_dir() or not os.access(near, os.W_OK | os.X_OK):
        raise UserError(f"--out {out} cannot be created ({near} is not a writable directory); choose another "
                        "directory")
    return p, near


def _upload(local: Path, url: str, last: tuple[str, ...] = ()):
    """Every file under the local folder uploaded under `url` (one PUT each), the names in `last` after the rest
    (what marks the folder whole to a reader); a failed upload removes what it uploaded and is one line."""
    fs, path = remote.filesystem(url)
    names = sorted((f.relative_to(local).as_posix() for f in local.rglob("*") if f.is_file()),
                   key=lambda n: (n in last, n))
    sent = []
    try:
        for name in names:
            key = f"{path.rstrip('/')}/{name}"
            remote._retried(url, lambda name=name, key=key: fs.put_file(str(local / name), key))
            sent.append(key)
    except (UserError, OSError) as e:
        if sent:
            fs.rm(sent)
        raise UserError(f"uploading to '{url}' failed ({e}); nothing was left there: check the bucket, the endpoint "
                        "and the credentials") from None


@contextlib.contextmanager
def staged(out, last: tuple[str, ...]):
    """A folder to write an export into, `out` only once it is whole: a hidden folder beside a local `out`, renamed
    to it at the end (named by `out`: every process writes into the same one, and a rerun after a killed export
    replaces what that left); for a URL a local temporary folder, uploaded at the end with `last` after the rest. A
    failure leaves no trace: neither `out` nor a folder made for it, nor an object in the bucket."""
    out = str(out)
    local, near = _unused_out(out)
    stage = near / f"meshtrain-export-{os.getpid()}" if local is None else \
        local.absolute().parent / f".{local.name}.partial"
    top = next((a for a in reversed(stage.parents) if not a.exists()), stage)  # what this export creates
    if jax.process_index() == 0:
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
    _sync("export staged")
    done = False
    try:
        yield stage
        _sync("export written")
        if jax.process_index() == 0:
            _upload(stage, out, last) if local is None else os.replace(stage, local)
        done = True
    finally:
        if jax.process_index() == 0:
            shutil.rmtree(stage if done else top, ignore_errors=True)


def export(run_dir, out, step: int | None = None, dtype: str | None = None) -> Path | str:
    """Write the parameters of a checkpoint (newest by default) to `out` (a new folder, or a URL), optionally cast
    to `dtype`; a failure writes nothing."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise UserError(f"--dtype {dtype} is not supported; choose one of {', '.join(EXPORT_DTYPES)}")
    _unused_out(str(out))  # before the parameters are read
    params, cfg, step = load_params_at(check(run_dir, "--run"), step)  # split over the local devices, never whole on one
    if dtype is not None:
        params = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), t))(params)
    with staged(out, last=(EXPORT_META,)) as stage:
        _write_export(params, cfg, step, run_dir, dtype, stage)
    return out if remote.is_url(str(out)) else Path(out)


def _write_export(params, cfg, step: int, run_dir, dtype: str | None, out: Path):
    ckptr = ocp.StandardCheckpointer()
    ckptr.save((out / "params").absolute(), params)
    ckptr.wait_until_finished()
    meta = {"format": FORMAT, "kind": "params", "step": step, "source": str(absolute(run_dir)),
            "dtype": dtype or str(jax.tree.leaves(params)[0].dtype), "config": config_dict(cfg),
            "leaves": describe_leaves({"params": params})}
    for leaf in meta["leaves"].values():
        leaf["spec"] = None  # the export's layout is wherever the reader puts it
    if jax.process_index() == 0:
        (out / "config.yaml").write_text(to_yaml(cfg))
        (out / EXPORT_META).write_text(json.dumps(meta, indent=1))
