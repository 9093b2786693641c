"""Parameters only: `meshtrain export` directories and a run's checkpoints read as parameters
(`load_params`, `model.init_from`), straight into the shardings asked for.

A run's one set of parameters: its `params`; with train.sync=local_sgd (params stacked, one per replica)
the replicas' average; with train.sync=diloco the outer parameters its replicas last synced to."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from models import abstract_model
from trainer.ckpt import base_ref
from trainer.ckpt.evidence import EXPORT, evidence, short as _short
from trainer.ckpt.objects import absolute, path_of
from trainer.ckpt.store import (EXPORT_META, SUBDIR, CorruptCheckpoint, check_shapes, choose, config_dict, config_of,
                                kind_of, leaf_names, list_steps, manager, meta_of, read_meta, restore, verify)
from trainer.config import Config, model_config
from trainer.errors import CheckpointUnreadable, UserError


def _shape_tree(cfg: Config):
    return abstract_model(model_config(cfg))[:2]


def param_shardings(cfg: Config, shardings=None, devices=None):
    """`shardings` as a tree for cfg's parameters: a tree as is, one Sharding for every leaf, or None:
    split over all local devices, each weight over one dimension where it divides (FSDP-style)."""
    shapes, logical = _shape_tree(cfg)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda _: shardings, shapes)
    if shardings is not None:
        return shardings
    from meshes import DATA, RULES, Layout, build_mesh
    from trainer.state import rules_by_data
    mesh = build_mesh(devices=devices)
    return Layout(mesh, 3, (rules_by_data(cfg)(mesh.shape[DATA]) or [RULES])[0]).tree("param", shapes, logical)


def one_set(meta: dict) -> tuple[str, dict]:
    """(where a checkpoint keeps its one set of parameters, their leaves as `params.*` at the model's shapes)."""
    sync = meta["config"]["train"].get("sync", "every_step")
    prefix = "outer.params." if sync == "diloco" else "params."
    leaves = {**meta["leaves"], **meta.get(base_ref.KEY, {}).get("leaves", {})}  # a LoRA run's base by reference
    out = {"params." + n.removeprefix(prefix): v for n, v in leaves.items() if n.startswith(prefix)}
    if sync == "local_sgd":  # (replicas, ...): their average has the model's shapes
        out = {n: {**v, "shape": v["shape"][1:]} for n, v in out.items()}
    return prefix, out


def _stacked(sh: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """A sharding for the same array with a leading replica axis, not split."""
    if isinstance(sh, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(None, *sh.spec))
    return sh


def _params_target(leaves: dict, shardings, prefix: str = "params."):
    """Abstract parameter tree with the saved shapes and dtypes of the leaves `prefix`*, placed on `shardings`."""
    is_sh = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    names = [prefix + n for n in leaf_names(jax.tree.map(lambda _: 0, shardings, is_leaf=is_sh))]
    for n in names:
        if n not in leaves:
            raise UserError(f"the checkpoint has no parameter '{n.removeprefix('params.')}'; pass shardings "
                            "for the parameters it holds (meshtrain inspect lists them)")
    flat = [jax.ShapeDtypeStruct(tuple(leaves[n]["shape"]), jnp.dtype(leaves[n]["dtype"]), sharding=sh)
            for n, sh in zip(names, jax.tree.leaves(shardings, is_leaf=is_sh))]
    return jax.tree.unflatten(jax.tree.structure(shardings, is_leaf=is_sh), flat)


def _export_failed(path: Path, e: Exception) -> UserError:
    """Reading an export raised e: damage (export it again) where the directory shows it, as run
    checkpoints are judged (trainer/ckpt/evidence.py); else the failure as it is (memory, I/O,
    permissions), with the export left as it is."""
    ev = str(e) if isinstance(e, CorruptCheckpoint) else evidence(e, path, EXPORT)
    if ev is not None:
        return UserError(f"exported parameters {path} are incomplete or corrupt ({ev}); export them again")
    return CheckpointUnreadable(f"exported parameters {path} could not be read ({_short(e)}); that is no evidence "
                                "of damage, so the export was left as it is: fix the cause (memory, disk space, "
                                "permissions, storage) and run again")


def _read_export(path: Path) -> dict:
    try:
        return json.loads((path / EXPORT_META).read_text())
    except Exception as e:  # noqa: BLE001 - classified: damage, or a failure to report as it is
        raise _export_failed(path, e) from None


def _load_export(path: Path, shardings, target=None, target_cfg: Config | None = None):
    """(params, Config, step) of an export; its shapes checked against `target` (of `target_cfg`) when given."""
    meta = _read_export(path)
    cfg = config_of(meta)
    if target is not None:
        check_shapes(meta["leaves"], target, f"model.init_from export {path}", "params.",
                     init_fix(meta["config"], target_cfg, path))
    item = _params_target(meta["leaves"], param_shardings(cfg, shardings))
    try:
        params = ocp.StandardCheckpointer().restore(absolute(path / "params"), item)  # a URL stays one
        verify({"params": params}, meta["leaves"])
    except Exception as e:  # noqa: BLE001 - classified: damage, or a failure to report as it is
        raise _export_failed(path, e) from None
    return params, cfg, meta["step"]


def load_params(run_dir, step: int | None = None, shardings=None, mtp_present: bool = False):
    """(params, Config) of a run's checkpoint (the newest valid one by default) or of an export, read
    straight into `shardings` (a tree, one Sharding for every leaf, or None: split over local devices).
    `mtp_present`: an HF folder's multi-token-prediction layers are read, as many as it holds."""
    return load_params_at(run_dir, step, shardings, mtp_present)[:2]


def load_params_at(run_dir, step: int | None = None, shardings=None, mtp_present: bool = False):
    """load_params, plus the step the parameters come from."""
    path = path_of(run_dir)
    kind = kind_of(path)
    if kind == "export":
        return _load_export(path, shardings)
    if kind == "hf":
        return _load_hf(path, shardings, mtp_present)
    if kind is None:
        raise UserError(f"'{run_dir}' holds no checkpoints ({path / SUBDIR} is missing) and is not an export; "
                        "give the run.dir of a run that saved checkpoints")
    mngr = manager(path / SUBDIR)

    def read(st):
        meta = meta_of(mngr, st)
        cfg, (prefix, _) = config_of(meta), one_set(meta)
        sh = param_shardings(cfg, shardings)
        if base_ref.KEY in meta:  # the base is read from its folder after the checkpoint (check)
            sh = base_ref.split(model_config(cfg), sh, base=False)
        target = _params_target(meta["leaves"], jax.tree.map(_stacked, sh) if cfg.train.sync == "local_sgd" else sh,
                                prefix)
        for key in reversed(prefix.strip(".").split(".")):  # {"params": ...} or {"outer": {"params": ...}}
            target = {key: target}
        return restore(mngr, st, target, partial=True), meta, cfg, sh

    def check(st, got):
        tree, meta, cfg, sh = got
        verify(tree, meta["leaves"])
        params = tree["outer"]["params"] if "outer" in tree else tree["params"]
        if cfg.train.sync == "local_sgd":  # the replicas' average
            params = jax.jit(lambda t: jax.tree.map(lambda x: x.mean(0), t), out_shardings=sh)(params)
        return params, cfg

    def with_base(st, found):
        params, cfg = found
        meta = meta_of(mngr, st)
        if base_ref.KEY not in meta:
            return found
        whole = param_shardings(cfg, shardings)
        target = _params_target(one_set(meta)[1], whole)
        return base_ref.attach(model_config(cfg), params, meta[base_ref.KEY], target, whole, None,
                               f"run '{run_dir}' step {st}"), cfg

    step, found, damaged = choose(mngr, f"run '{run_dir}'", read, check, step)
    if damaged:
        raise UserError(f"run '{run_dir}': none of its checkpoints can be read ("
                        + "; ".join(f"step {st}: {why}" for st, why in damaged) + ")")
    if found is None:
        raise UserError(f"run '{run_dir}' has no complete checkpoint; train it to write one")
    return with_base(step, found) + (step,)


def _load_hf(path: Path, shardings, mtp_present: bool = False):
    """(params, Config, 0) of a Hugging Face model folder; its tokenizer.json, when there, is the config's
    data.tokenizer (so that `meshtrain generate` encodes and decodes with it); with `mtp_present`, its
    multi-token-prediction layers too (model.mtp_depth: as many as it holds)."""
    from trainer.ckpt import hf
    from trainer.config import load_config, replace
    from trainer.ckpt.sources import resolve
    cfg = load_config([f"model.init_from={path}"])
    context = hf.context_of(path)  # a folder of fewer positions than the preset's seq_len is read at its own
    if context and context < model_config(cfg).seq_len:
        cfg = replace(cfg, model={"seq_len": context})
    cfg = resolve(cfg)
    if mtp_present:
        cfg = replace(cfg, model={"mtp_depth": hf.mtp_layers(path, model_config(cfg))})
    if (path / "tokenizer.json").is_file():
        cfg = replace(cfg, data={"tokenizer": str(path / "tokenizer.json")})
    shapes = _shape_tree(cfg)[0]
    return hf.load(path, model_config(cfg), shapes, param_shardings(cfg, shardings)), cfg, 0


SHAPE_KEYS = ("family", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size",
              "tie_embeddings")  # the model keys that decide the parameters' shapes


def init_fix(saved: dict, cfg: Config, path) -> str:
    """What to do when `model.init_from` (saved with config `saved`) has other shapes than cfg's model: the
    shape keys it was saved with, each named with its value."""
    mine, theirs = config_dict(cfg)["model"], saved.get("model", {})
    keys = [f"model.{k}={str(theirs[k]).lower() if isinstance(theirs[k], bool) else theirs[k]}"
            for k in SHAPE_KEYS if k in theirs and theirs[k] != mine.get(k)]
    use = (f"set {' '.join(keys)} as it was saved" if keys else
           f"use the model settings it was saved with (meshtrain inspect --run {path} shows them)")
    return f"{use}, or give a model.init_from of this config's shapes"


def init_params(s, path) -> dict:
    """Parameters for `model.init_from`: an export, a run's checkpoint or an HF folder read into the run's
    parameter shardings and cast to the train state's dtype."""
    from trainer.parallel import localsgd
    p, (target, shardings) = path_of(path), localsgd.one_replica(s)  # local SGD: every replica starts from them
    kind = kind_of(p)
    if kind == "export":
        params = _load_export(p, shardings, target, s.cfg)[0]
    elif kind == "hf":
        from trainer.ckpt.hf import load as load_hf
        params = load_hf(p, model_config(s.cfg), target, shardings)  # already in target's dtypes
        if s.model.lora is None:
            return params
        from trainer.ckpt.peft import with_adapters
        return with_adapters(s, params)  # the base from the folder, the adapters fresh or from model.lora.init_from
    elif kind == "run" and list_steps(p):
        step = list_steps(p)[-1]
        meta = read_meta(p, step)
        check_shapes(one_set(meta)[1], target, f"model.init_from checkpoint {p / SUBDIR / str(step)}", "params.",
                     init_fix(meta["config"], s.cfg, p))
        params, _ = load_params(p, None, shardings)
    else:
        raise UserError(f"model.init_from='{path}' is neither an export (meshtrain export --out) nor a run.dir "
                        "with checkpoints nor a Hugging Face model folder (config.json); give one of those")
    cast = jax.jit(lambda t: jax.tree.map(lambda x, d: x.astype(d.dtype), t, target), out_shardings=shardings)
    with jax.set_mesh(s.mesh):
        return cast(params)
