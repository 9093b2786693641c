"""`meshtrain inspect` (what a run's checkpoints hold) and `meshtrain export` (parameters only)."""
from __future__ import annotations

import datetime
import json
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
    path = path_of(run_dir)
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
    return "\n".join(lines)


def export(run_dir, out, step: int | None = None, dtype: str | None = None) -> Path:
    """Write the parameters of a checkpoint (newest by default) to `out`, optionally cast to `dtype`."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise UserError(f"--dtype {dtype} is not supported; choose one of {', '.join(EXPORT_DTYPES)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty; choose a new directory")
    params, cfg, step = load_params_at(run_dir, step)  # split over the local devices, never whole on one
    if dtype is not None:
        params = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), t))(params)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out} cannot be created ({e.strerror}); choose another directory") from None
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
    return out
