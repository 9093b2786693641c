"""Checkpoints: asynchronous Orbax saves of the train state, validated restores onto any mesh.

A run keeps `run.dir/checkpoints/<step>/` with two Orbax items:
  state  the train state {step, params, opt_state, guard}, every array written shard by shard;
  meta   JSON: the resolved config, the mesh and ZeRO stage it was saved from, the RNG
         (the seed: batches are a pure function of (seed, step), so the step is the data
         position), and every leaf's shape, dtype, sharding and a checksum of its bits.
Orbax writes each save into a temporary directory and renames it into place when complete,
so a killed save never shows up as a step. Restores read each device's shards straight into
the target shardings (any mesh, ZeRO stage or device count) and check every leaf against its
checksum; a checkpoint that fails is reported, moved aside and the previous one is used.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from omegaconf import OmegaConf

from trainer import guard
from trainer.config import Config, load_config
from trainer.errors import UserError
from trainer.preempt import any_process

FORMAT = 1
SUBDIR = "checkpoints"


class CorruptCheckpoint(Exception):
    """A checkpoint that cannot be read back as it was written."""


def _warn(msg: str):
    print(f"meshtrain: warning: {msg}", file=sys.stderr, flush=True)


def leaf_names(tree) -> list[str]:
    """Dotted names of a pytree's leaves, in flattening order: 'params.layers.wq'."""
    return [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _checksum(x):
    """Order-sensitive uint32 sum of an array's bits. Integer sums are exact in any order, so the
    value does not depend on the sharding; every weight is odd, so any single flipped bit shows."""
    bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize])
    bits = bits.astype(jnp.uint32)
    idx = jnp.zeros(bits.shape, jnp.uint32)  # row-major flat index, mod 2**32 (no overflow for huge leaves)
    for d in range(bits.ndim):
        stride = math.prod(bits.shape[d + 1:]) % 2 ** 32
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * jnp.uint32(stride)
    return jnp.sum(bits * (idx * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(0x9E3779B1), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: jax.tree.map(_checksum, tree))


def checksums(tree) -> dict[str, int]:
    return dict(zip(leaf_names(tree), (int(c) for c in jax.device_get(jax.tree.leaves(_checksums(tree))))))


def describe_leaves(tree) -> dict[str, dict]:
    """Shape, dtype, sharding spec and checksum of every leaf (what `meta` records)."""
    sums = checksums(tree)
    out = {}
    for name, x in zip(leaf_names(tree), jax.tree.leaves(tree)):
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        out[name] = {"shape": list(x.shape), "dtype": str(x.dtype), "spec": str(spec) if spec is not None else None,
                     "checksum": sums[name]}
    return out


def verify(tree, leaves: dict):
    """Raise CorruptCheckpoint unless every leaf matches the checksum recorded at save time."""
    for name, got in checksums(tree).items():
        if name not in leaves or leaves[name]["checksum"] != got:
            raise CorruptCheckpoint(f"'{name}' does not match its checksum")


def check_shapes(leaves: dict, target, where: str, prefix: str = ""):
    """UserError naming the first leaf of `target` (named `prefix` + its path) whose saved shape
    differs or that is missing."""
    pairs = sorted(zip([prefix + n for n in leaf_names(target)], jax.tree.leaves(target)),
                   key=lambda p: not p[0].startswith("params."))  # name a parameter first
    for full, x in pairs:
        what = f"parameter '{full.removeprefix('params.')}'" if full.startswith("params.") else f"state '{full}'"
        if full not in leaves:
            raise UserError(f"{where} has no {what}; use the model settings it was saved with "
                            "(meshtrain inspect shows them) or a new run.dir")
        saved = tuple(leaves[full]["shape"])
        if saved != tuple(x.shape):
            raise UserError(f"{where}: {what} has shape {saved} there but {tuple(x.shape)} in this config; "
                            "use the model settings it was saved with (meshtrain inspect shows them) or a new run.dir")


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"


def _manager(ckpt_dir: Path, cfg: Config | None = None) -> ocp.CheckpointManager:
    """A writing manager for a training run (cfg given), else one that only reads."""
    if cfg is None:  # not read_only=True: that logs a warning per manager; this one never saves anyway
        opts = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    else:
        c = cfg.checkpoint
        opts = ocp.CheckpointManagerOptions(max_to_keep=c.keep or None, keep_period=c.keep_every or None,
                                            cleanup_tmp_directories=True, enable_async_checkpointing=True)
    # No zstd: float32 weights and moments shrink by ~8% for ~4x the background write's CPU time,
    # which on a CPU host slows the training steps it overlaps (scripts/ckpt_stall.py).
    handlers = {"state": ocp.PyTreeCheckpointHandler(use_compression=False), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(ckpt_dir.absolute(), options=opts, item_handlers=handlers)


def list_steps(run_dir) -> list[int]:
    """Steps of the run's complete (finalized) checkpoints, oldest first."""
    d = Path(run_dir) / SUBDIR
    return sorted(_manager(d).all_steps()) if d.is_dir() else []


def _read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 - any failure to read means the checkpoint is unusable
        raise CorruptCheckpoint(f"its metadata cannot be read ({_short(e)})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "leaves" not in meta:
        raise CorruptCheckpoint("its metadata is not a meshtrain checkpoint's")
    return meta


def read_meta(run_dir, step: int) -> dict:
    """The metadata JSON of one checkpoint (config, mesh, ZeRO stage, leaves)."""
    return _read_meta(_manager(Path(run_dir) / SUBDIR), step)


def config_of(meta: dict) -> Config:
    return load_config(base=meta["config"])


def config_dict(cfg: Config) -> dict:
    """The config as plain data, model keys resolved from the preset (so that a later change to a
    preset cannot change what a checkpoint's config describes)."""
    from trainer.config import model_config
    d = OmegaConf.to_container(OmegaConf.structured(cfg))
    resolved = dataclasses.asdict(model_config(cfg))
    d["model"].update({k: resolved[k] for k in d["model"] if k in resolved})
    return d


def _abstract(shapes, shardings):
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)


def _restore(mngr, step: int, target, partial: bool = False):
    """Read `target`'s leaves (ShapeDtypeStructs with shardings) of a checkpoint's state."""
    item = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=partial)
    try:
        return mngr.restore(step, args=ocp.args.Composite(state=item))["state"]
    except Exception as e:  # noqa: BLE001 - unreadable data means a partial or corrupt checkpoint
        raise CorruptCheckpoint(f"its arrays cannot be read ({_short(e)})") from None


def _choose(mngr: ocp.CheckpointManager, where: str, attempt: Callable, step: int | None,
            on_corrupt: Callable | None = None):
    """attempt(step) on `step`, or on the newest checkpoint that passes, falling back with a warning."""
    steps = sorted(mngr.all_steps(), reverse=True)
    if step is not None:
        if step not in steps:
            have = ", ".join(map(str, sorted(steps))) or "none"
            raise UserError(f"{where} has no checkpoint at step {step}; existing steps: {have}")
        try:
            return step, attempt(step)
        except CorruptCheckpoint as e:
            raise UserError(f"checkpoint {Path(mngr.directory) / str(step)} is incomplete or corrupt ({e}); "
                            "choose another --step") from None
    for i, st in enumerate(steps):
        error = None
        try:
            result = attempt(st)
        except CorruptCheckpoint as e:
            error = e
        if not any_process(error is not None):  # all processes take the same checkpoint
            return st, result
        nxt = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "no earlier checkpoint is left"
        _warn(f"checkpoint {Path(mngr.directory) / str(st)} is incomplete or corrupt "
              f"({error or 'on another process'}); {nxt}")
        if on_corrupt:
            on_corrupt(st)
    return None, None


class Checkpointer:
    """Saves one run's train state asynchronously and restores the newest valid checkpoint."""

    def __init__(self, s, run_dir, log: Callable[[str], None] | None = None):
        c = s.cfg.checkpoint
        if c.every < 0 or c.keep < 0 or c.keep_every < 0:
            raise UserError(f"checkpoint.every={c.every}, keep={c.keep}, keep_every={c.keep_every} must be >= 0; "
                            "fix the negative value")
        self.s, self.log = s, log or (lambda m: print(m, file=sys.stderr))
        self.dir = Path(run_dir) / SUBDIR
        self.mngr = _manager(self.dir, s.cfg)
        self._open = True

    def due(self, step: int) -> bool:
        every = self.s.cfg.checkpoint.every
        return every > 0 and step % every == 0

    def save(self, step: int, state: dict):
        """Start an asynchronous save of `state` as `step` (returns once the arrays are copied off)."""
        if step in self.mngr.all_steps():
            return
        s = self.s
        meta = {"format": FORMAT, "step": step, "saved_at": time.time(),
                "config": config_dict(s.cfg),
                "mesh": dict(s.mesh.shape), "zero_stage": s.cfg.train.zero_stage, "devices": s.mesh.size,
                "processes": jax.process_count(), "platform": s.mesh.devices.flat[0].platform,
                "rng": {"seed": s.cfg.train.seed, "data_step": step},
                "leaves": describe_leaves(state)}
        self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
                       force=True)

    def restore_or_init(self, init: Callable[[], dict]) -> tuple[dict, int]:
        """The state of the newest valid checkpoint, else from `model.init_from`, else init(); and its step."""
        s, where = self.s, f"run.dir checkpoints {self.dir}"
        target = _abstract(s.shapes, s.shardings)

        def attempt(step):
            meta = _read_meta(self.mngr, step)
            check_shapes(meta["leaves"], target, f"checkpoint {self.dir / str(step)}")
            state = _restore(self.mngr, step, target)
            verify(state, meta["leaves"])
            return state, meta

        step, found = _choose(self.mngr, where, attempt, None, self._quarantine)
        if found is not None:
            state, meta = found
            left = "" if step < s.cfg.train.steps else \
                f"; train.steps={s.cfg.train.steps}: nothing left to train, raise train.steps to continue"
            self.log(f"resumed from {self.dir / str(step)} (saved on mesh {_mesh_str(meta['mesh'])} "
                     f"ZeRO-{meta['zero_stage']}){_changes(meta['config'], s.cfg)}{left}")
            return state, step
        if s.cfg.model.init_from:
            params = init_params(s, s.cfg.model.init_from)
            self.log(f"parameters from {s.cfg.model.init_from}")
            return state_from_params(s, params), 0
        return init(), 0

    def _quarantine(self, step: int):
        """Move a bad checkpoint aside so that it is kept for inspection but never listed or re-saved over."""
        if jax.process_index() == 0:
            src = self.dir / str(step)
            if src.exists():
                src.rename(self.dir / f"{step}.corrupt-{int(time.time())}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("meshtrain-quarantine")
        self.mngr.reload()

    def close(self):
        """Wait for the save in flight, then release the manager."""
        if self._open:
            self._open = False
            self.mngr.wait_until_finished()
            self.mngr.close()


def _mesh_str(mesh: dict) -> str:
    return "x".join(str(mesh[a]) for a in ("data", "stage", "model"))


def _changes(saved: dict, cfg: Config) -> str:
    """'; changed: train.steps 20 -> 40, ...' for keys that differ from the checkpoint's config."""
    now = config_dict(cfg)
    diff = []
    for sec, vals in now.items():
        if sec == "dist":  # where this launch's processes meet, not what they train
            continue
        for k, v in vals.items():
            old = saved.get(sec, {}).get(k, v)
            if old != v:
                diff.append(f"{sec}.{k} {old} -> {v}")
    return f"; changed: {', '.join(diff)}" if diff else ""


def state_from_params(s, params) -> dict:
    """A step-0 train state around given (sharded) parameters: fresh optimizer state, same shardings."""
    def make(p):
        return {"step": jnp.zeros((), jnp.int32), "params": p, "opt_state": s.tx.init(p),
                "guard": guard.init(s.cfg.train)}
    with jax.set_mesh(s.mesh):
        return jax.jit(make, out_shardings=s.shardings)(params)


# ----------------------------------------------------------------------------- parameters only

EXPORT_META = "meta.json"


def is_export(path) -> bool:
    return (Path(path) / EXPORT_META).is_file() and (Path(path) / "params").is_dir()


def _shape_tree(cfg: Config):
    from trainer.config import model_config
    from trainer.state import abstract_model
    return abstract_model(model_config(cfg))


def param_shardings(cfg: Config, shardings=None, devices=None):
    """`shardings` as a tree for cfg's parameters: a tree as is, one Sharding for every leaf, or None:
    split over all local devices, each weight over one dimension where it divides (FSDP-style)."""
    shapes, logical = _shape_tree(cfg)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda _: shardings, shapes)
    if shardings is not None:
        return shardings
    from meshes import Layout, build_mesh
    return Layout(build_mesh(-1, 1, 1, devices=devices), 3).tree("param", shapes, logical)


def _params_target(leaves: dict, shardings):
    """Abstract parameter tree with the saved shapes and dtypes, placed on `shardings`."""
    is_sh = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    names = ["params." + n for n in leaf_names(jax.tree.map(lambda _: 0, shardings, is_leaf=is_sh))]
    for n in names:
        if n not in leaves:
            raise UserError(f"the checkpoint has no parameter '{n.removeprefix('params.')}'; pass shardings "
                            "for the parameters it holds (meshtrain inspect lists them)")
    flat = [jax.ShapeDtypeStruct(tuple(leaves[n]["shape"]), jnp.dtype(leaves[n]["dtype"]), sharding=sh)
            for n, sh in zip(names, jax.tree.leaves(shardings, is_leaf=is_sh))]
    return jax.tree.unflatten(jax.tree.structure(shardings, is_leaf=is_sh), flat)


def _read_export(path: Path) -> dict:
    import json
    try:
        return json.loads((path / EXPORT_META).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"export {path} has an unreadable {EXPORT_META} ({_short(e)}); export it again") from None


def _load_export(path: Path, shardings, target=None):
    """(params, Config, step) of an export."""
    meta = _read_export(path)
    cfg = config_of(meta)
    if target is not None:
        check_shapes(meta["leaves"], target, f"exported parameters {path}", "params.")
    item = _params_target(meta["leaves"], param_shardings(cfg, shardings))
    try:
        params = ocp.StandardCheckpointer().restore((path / "params").absolute(), item)
        verify({"params": params}, meta["leaves"])
    except Exception as e:  # noqa: BLE001 - unreadable or failing its checksums
        raise UserError(f"exported parameters {path} are incomplete or corrupt ({_short(e)}); "
                        "export them again") from None
    return params, cfg, meta["step"]


def load_params(run_dir, step: int | None = None, shardings=None):
    """(params, Config) of a run's checkpoint (the newest valid one by default) or of an export, read
    straight into `shardings` (a tree, one Sharding for every leaf, or None: split over local devices)."""
    return load_params_at(run_dir, step, shardings)[:2]


def load_params_at(run_dir, step: int | None = None, shardings=None):
    """load_params, plus the step the parameters come from."""
    path = Path(run_dir)
    if is_export(path):
        return _load_export(path, shardings)
    if not (path / SUBDIR).is_dir():
        raise UserError(f"'{run_dir}' holds no checkpoints ({path / SUBDIR} is missing) and is not an export; "
                        "give the run.dir of a run that saved checkpoints")
    mngr = _manager(path / SUBDIR)

    def attempt(st):
        meta = _read_meta(mngr, st)
        cfg = config_of(meta)
        item = {"params": _params_target(meta["leaves"], param_shardings(cfg, shardings))}
        got = _restore(mngr, st, item, partial=True)
        verify(got, meta["leaves"])
        return got["params"], cfg

    step, found = _choose(mngr, f"run '{run_dir}'", attempt, step)
    if found is None:
        raise UserError(f"run '{run_dir}' has no complete checkpoint; train it to write one")
    return found + (step,)


def init_params(s, path) -> dict:
    """Parameters for `model.init_from`: an export (or a run's checkpoint) read into the run's
    parameter shardings and cast to the train state's dtype."""
    p, target = Path(path), s.shapes["params"]
    if is_export(p):
        params = _load_export(p, s.shardings["params"], target)[0]
    elif list_steps(p):
        step = list_steps(p)[-1]
        check_shapes(read_meta(p, step)["leaves"], target, f"model.init_from checkpoint {p / SUBDIR / str(step)}",
                     "params.")
        params, _ = load_params(p, None, s.shardings["params"])
    else:
        raise UserError(f"model.init_from='{path}' is neither an export (meshtrain export --out) nor a run.dir "
                        "with checkpoints; give one of those")
    cast = jax.jit(lambda t: jax.tree.map(lambda x, d: x.astype(d.dtype), t, target),
                   out_shardings=s.shardings["params"])
    with jax.set_mesh(s.mesh):
        return cast(params)
