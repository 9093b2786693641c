"""The checkpoint store: what every writer and reader of checkpoints and exports shares.

Layout: a run keeps `run.dir/checkpoints/<step>/` with two Orbax items,
  state  the train state {step, params, opt_state, guard}, every array written shard by shard;
  meta   JSON: the resolved config, the mesh and ZeRO stage it was saved from, the RNG
         (batches are a pure function of (seed, position) and step s reads position
         s + the guard's data offset: rng.data_step is the next batch's position), and every
         leaf's shape, dtype, sharding and a checksum of its bits;
an export (`meshtrain export`) is a directory with `meta.json` (the same leaf records) and `params/`.
`kind_of` tells which of these (or a Hugging Face folder) a path is, for every reader.

Restores read each device's shards straight into the target shardings (any mesh, ZeRO stage or
device count) and check every leaf against its checksum. Only evidence of damage (a checksum
mismatch; a missing, short or undecodable file: trainer/ckpt/evidence.py) makes a checkpoint
corrupt; any other failure (memory, I/O, permissions, anything unrecognised) is reported as it is
and moves nothing. With several processes every stage of a restore ends in an agreement, so that
all take the same decision and none waits in a collective the others left.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from omegaconf import OmegaConf

from trainer.ckpt.evidence import evidence, short
from trainer.ckpt.objects import absolute, manager_options, path_of
from trainer.ckpt.preempt import any_process
from trainer.config import Config, load_config, model_config
from trainer.errors import CheckpointUnreadable, UserError

FORMAT = 1
SUBDIR = "checkpoints"  # run.dir/checkpoints/<step>/
EXPORT_META = "meta.json"  # an export's metadata, beside its params/
log = logging.getLogger(__name__)


def kind_of(path) -> str | None:
    """What a path given as a source of parameters is: 'export' (meta.json and params/), 'run' (a
    run.dir with checkpoints/), 'hf' (a Hugging Face folder: config.json), or None (none of these)."""
    p = path_of(path)
    if (p / EXPORT_META).is_file() and (p / "params").is_dir():
        return "export"
    if (p / SUBDIR).is_dir():
        return "run"
    if (p / "config.json").is_file():
        return "hf"
    return None


def is_export(path) -> bool:
    return kind_of(path) == "export"


class CorruptCheckpoint(Exception):
    """Evidence that a checkpoint is damaged: it cannot be read back as it was written."""


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


RESUME_FIX = "use the model settings it was saved with (meshtrain inspect shows them) or a new run.dir"


def check_shapes(leaves: dict, target, where: str, prefix: str = "", fix: str = RESUME_FIX):
    """UserError naming the first leaf of `target` (named `prefix` + its path) whose saved shape
    differs or that is missing, and `fix`."""
    pairs = sorted(zip([prefix + n for n in leaf_names(target)], jax.tree.leaves(target)),
                   key=lambda p: not p[0].startswith("params."))  # name a parameter first
    for full, x in pairs:
        what = f"parameter '{full.removeprefix('params.')}'" if full.startswith("params.") else f"state '{full}'"
        if full not in leaves:
            raise UserError(f"{where} has no {what}; {fix}")
        saved = tuple(leaves[full]["shape"])
        if saved != tuple(x.shape):
            raise UserError(f"{where}: {what} has shape {saved} there but {tuple(x.shape)} in this config; {fix}")


def classified(d: Path, fn: Callable, step: int):
    """fn(step), a failure turned into CorruptCheckpoint where the directory shows damage, else into
    CheckpointUnreadable (a UserError: one line, nothing moved)."""
    try:
        return fn(step)
    except (CorruptCheckpoint, UserError):
        raise
    except Exception as e:  # noqa: BLE001 - classified below: damage, or a failure to report as it is
        ev = evidence(e, d / str(step))
        if ev is not None:
            raise CorruptCheckpoint(ev) from None
        raise CheckpointUnreadable(
            f"checkpoint {d / str(step)} could not be restored ({short(e)}); that is no evidence of damage, "
            "so no checkpoint was moved or skipped: fix the cause (memory, disk space, permissions, storage) "
            "and run again") from None


class _Failed:
    """A handler's exception, returned from its restore rather than raised (see _returning)."""

    def __init__(self, error: Exception):
        self.error = error


def _returning(handler):
    """handler, its restore returning its exception as _Failed: raised there, it would skip the collective
    barrier that ends Orbax's restore on this process and leave the other processes waiting in it."""
    def restore(*args, **kwargs):
        try:
            return type(handler).restore(handler, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - raised again by _item once past the barrier
            return _Failed(e)
    handler.restore = restore  # on the instance: Orbax finds a handler's arguments by its class
    return handler


def _item(restored, name: str):
    """An item of Orbax's restore result, its handler's exception raised again."""
    got = restored[name]
    if isinstance(got, _Failed):
        raise got.error
    return got


def manager(ckpt_dir: Path, cfg: Config | None = None) -> ocp.CheckpointManager:
    """A writing manager for a training run (cfg given), else one that only reads."""
    if cfg is None:  # not read_only=True: that logs a warning per manager; this one never saves anyway
        opts = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False,
                                            **manager_options(ckpt_dir))
    else:
        c = cfg.checkpoint
        opts = ocp.CheckpointManagerOptions(max_to_keep=c.keep or None, keep_period=c.keep_every or None,
                                            cleanup_tmp_directories=True, enable_async_checkpointing=True,
                                            **manager_options(ckpt_dir))
    # No zstd: float32 weights and moments shrink by ~8% for ~4x the background write's CPU time,
    # which on a CPU host slows the training steps it overlaps (scripts/bench/ckpt_stall.py).
    handlers = {"state": _returning(ocp.PyTreeCheckpointHandler(use_compression=False)),
                "meta": _returning(ocp.JsonCheckpointHandler())}
    return ocp.CheckpointManager(absolute(ckpt_dir), options=opts, item_handlers=handlers)


def list_steps(run_dir) -> list[int]:
    """Steps of the run's complete (finalized) checkpoints, oldest first."""
    d = path_of(run_dir) / SUBDIR
    return sorted(manager(d).all_steps()) if d.is_dir() else []


def meta_of(mngr: ocp.CheckpointManager, step: int) -> dict:
    meta = _item(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())), "meta")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "leaves" not in meta:
        raise CorruptCheckpoint("its metadata is not a meshtrain checkpoint's")
    return meta


def read_meta(run_dir, step: int) -> dict:
    """The metadata JSON of one checkpoint (config, mesh, ZeRO stage, leaves)."""
    d = path_of(run_dir) / SUBDIR
    return classified(d, lambda st: meta_of(manager(d), st), step)


def config_of(meta: dict) -> Config:
    return load_config(base=meta["config"])


def config_dict(cfg: Config) -> dict:
    """The config as plain data, model keys resolved from the preset (so that a later change to a
    preset cannot change what a checkpoint's config describes)."""
    d = OmegaConf.to_container(OmegaConf.structured(cfg))
    resolved = dataclasses.asdict(model_config(cfg))
    d["model"].update({k: resolved[k] for k in d["model"] if k in resolved and k != "lora"})  # lora: its section's
    return d


def abstract(shapes, shardings):
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)


def restore(mngr, step: int, target, partial: bool = False):
    """Read `target`'s leaves (ShapeDtypeStructs with shardings) of a checkpoint's state."""
    item = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=partial)
    return _item(mngr.restore(step, args=ocp.args.Composite(state=item)), "state")


def agreed(d: Path, step: int, fn: Callable):
    """(fn(step), None) where it works on every process, else (None, CorruptCheckpoint) on every process
    if any found damage; CheckpointUnreadable on every process if any failed otherwise. Every process
    runs each stage and agrees before the next: a checksum is a collective, which a process that
    left early would leave the others waiting in."""
    result = error = None
    try:
        result = classified(d, fn, step)
    except (CorruptCheckpoint, CheckpointUnreadable) as e:
        error = e
    if any_process(isinstance(error, CheckpointUnreadable)):
        raise error if isinstance(error, CheckpointUnreadable) else CheckpointUnreadable(
            f"checkpoint {d / str(step)} could not be restored on another process (its log says why); "
            "no checkpoint was moved or skipped")
    if any_process(error is not None):
        return None, error or CorruptCheckpoint("damaged on another process")
    return result, None


def choose(mngr: ocp.CheckpointManager, where: str, read: Callable, check: Callable, step: int | None,
            on_corrupt: Callable | None = None):
    """(step, check(step, read(step)), []) on `step`, or on the newest checkpoint that is not damaged,
    falling back past damaged ones with a warning (on_corrupt(step) for each once one passes);
    (None, None, [(step, why), ...]) if none passes. Any other failure raises at once on every process
    and leaves every checkpoint in place."""
    d, steps = path_of(mngr.directory), sorted(mngr.all_steps(), reverse=True)
    if step is not None:
        if step not in steps:
            have = ", ".join(map(str, sorted(steps))) or "none"
            raise UserError(f"{where} has no checkpoint at step {step}; existing steps: {have}")
        got, error = agreed(d, step, read)  # each stage ends in the processes' agreement, as below
        if error is None:
            result, error = agreed(d, step, lambda st: check(st, got))
        if error is not None:
            raise UserError(f"checkpoint {d / str(step)} is incomplete or corrupt ({error}); choose another --step")
        return step, result, []
    damaged = []
    for i, st in enumerate(steps):
        got, error = agreed(d, st, read)
        if error is None:
            result, error = agreed(d, st, lambda st_: check(st_, got))
        if error is None:
            for bad, _ in damaged if on_corrupt else ():
                on_corrupt(bad)
            return st, result, []
        nxt = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "no earlier checkpoint is left"
        log.warning(f"checkpoint {d / str(st)} is incomplete or corrupt ({error}); {nxt}")
        damaged.append((st, str(error)))
    return None, None, damaged
