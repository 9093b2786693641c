"""Checkpoints of a training run: asynchronous Orbax saves of the train state, and the restore of the
newest valid one onto any mesh (the layout and the validated reads: trainer/ckpt/store.py).

Orbax writes each save into a temporary directory and renames it into place when complete,
so a killed save never shows up as a step. A damaged checkpoint is reported and the previous one
used, moved aside once an older one restores; any other failure stops the run and moves nothing.
Restoring never initialises: a run with nothing to restore starts from trainer/ckpt/initial.py.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import jax
import orbax.checkpoint as ocp

from meshes import DATA, recorded
from trainer.ckpt import base_ref
from trainer.ckpt.objects import path_of
from trainer.ckpt.store import (FORMAT, SUBDIR, abstract, check_shapes, choose, config_dict, describe_leaves,
                                manager, meta_of, restore, verify)
from trainer.config import Config
from trainer.errors import UserError

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves one run's train state asynchronously and restores the newest valid checkpoint."""

    def __init__(self, s, run_dir, log: Callable[[str], None] | None = None):
        # checkpoint.* keys were range-checked by the config loader (trainer/config/sections.py)
        self.s, self.log = s, log or logging.getLogger(__name__).info
        self.dir = path_of(run_dir) / SUBDIR  # a URL's: trainer/ckpt/objects.py
        self._mngr = None
        self._open = True
        self._base = None  # a LoRA run's base as its checkpoints record it (trainer/ckpt/base_ref.py)

    @property
    def mngr(self) -> ocp.CheckpointManager:
        """Orbax's manager, made at its first use: it creates its directory, which a start that fails (or finds
        nothing to restore) must not leave behind."""
        if self._mngr is None:
            self._mngr = manager(self.dir, self.s.cfg)
        return self._mngr

    def due(self, step: int) -> bool:
        every = self.s.cfg.checkpoint.every
        return every > 0 and step % every == 0

    def save(self, step: int, state: dict):
        """Start an asynchronous save of `state` as `step` (returns once the arrays are copied off)."""
        if step in self.mngr.all_steps():
            return
        s = self.s
        offset = int(jax.device_get(state["guard"]["offset"]))  # rollbacks moved the data this far ahead
        if base_ref.by_reference(s.cfg, s.model):  # a LoRA run's base: by reference to model.init_from
            self._base = self._base or base_ref.record(s.cfg, s.model, state["params"])
            state = base_ref.without_base(s.model, state)
        meta = {"format": FORMAT, "step": step, "saved_at": time.time(),
                "config": config_dict(s.cfg),
                "mesh": dict(s.mesh.shape), "zero_stage": s.cfg.train.zero_stage, "devices": s.mesh.size,
                "processes": jax.process_count(), "platform": s.mesh.devices.flat[0].platform,
                "rng": {"seed": s.cfg.train.seed, "data_step": step + offset, "data_offset": offset},
                "leaves": describe_leaves(state), **({base_ref.KEY: self._base} if self._base else {})}
        self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
                       force=True)

    def restore(self) -> tuple[dict, int] | None:
        """(state, step) of the newest valid checkpoint; None when there is none to restore (the caller
        initialises, trainer/ckpt/initial.py). Checkpoints that exist but are all damaged stop the run
        unless checkpoint.on_unreadable=fresh, which moves them aside and returns None."""
        s, where = self.s, f"run.dir checkpoints {self.dir}"
        if not self.dir.is_dir():  # nothing saved yet; looking creates nothing
            return None
        target = abstract(s.shapes, s.shardings)

        def read(step):
            meta = meta_of(self.mngr, step)
            _same_replicas(meta, s, self.dir / str(step))
            saved = target
            if base_ref.KEY in meta:  # a LoRA run's base: its folder there before the shapes are compared
                base_ref.there(meta[base_ref.KEY], s.cfg.model.init_from, f"checkpoint {self.dir / str(step)}")
                saved = base_ref.without_base(s.model, target)
            check_shapes(meta["leaves"], saved, f"checkpoint {self.dir / str(step)}")
            return restore(self.mngr, step, saved), meta

        def check(step, got):
            verify(got[0], got[1]["leaves"])
            return got

        step, found, damaged = choose(self.mngr, where, read, check, None, self._quarantine)
        if found is not None:
            state, meta = found
            if base_ref.KEY in meta:  # the base read again from its folder, checked leaf by leaf
                state, self._base = base_ref.resumed(s, state, meta[base_ref.KEY], f"checkpoint {self.dir / str(step)}")
            if step >= s.cfg.train.steps:  # the caller compiles and writes nothing (trainer/run/context.py)
                self.log(f"run.dir {self.dir.parent} holds step {step} >= train.steps={s.cfg.train.steps}: nothing "
                         f"to train, nothing written; raise train.steps above {step} to continue")
            else:  # an axis the metadata lacks (saved before the axis existed) reads as 1
                saved = recorded(meta["mesh"], s.mesh.axis_names)
                self.log(f"resumed from {self.dir / str(step)} (saved on mesh {saved.describe()} "
                         f"ZeRO-{meta['zero_stage']}){_changes(meta['config'], s.cfg)}")
            return state, step
        if damaged:
            listing = "; ".join(f"{self.dir / str(st)}: {why}" for st, why in damaged)
            if s.cfg.checkpoint.on_unreadable != "fresh":
                raise UserError(f"{where}: none of its {len(damaged)} checkpoint(s) can be restored ({listing}); "
                                "all are left in place: restore them from a copy, move them away, or set "
                                "checkpoint.on_unreadable=fresh to start again from step 0")
            for st, _ in damaged:
                self._quarantine(st)
            log.warning(f"{where}: none of its checkpoints can be restored ({listing}); checkpoint.on_unreadable="
                        "fresh: they were moved aside (<step>.corrupt-<time>) and the run starts again from step 0")
        return None

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
        if self._open and self._mngr is not None:
            self._open = False
            # Orbax cleans up old temporary directories in a thread started with the manager and awaits it
            # only in a save: a run that stops before its first one (bad input) must wait for it too, or
            # the thread raises at interpreter exit, a traceback after the one-line error
            pending = getattr(self.mngr, "_cleanup_tmp_directory_future", None)
            if pending is not None:
                pending.result()
            self.mngr.wait_until_finished()
            self.mngr.close()


def _same_replicas(meta: dict, s, where: Path):
    """One line where a checkpoint's state is laid out for other replicas than this run's: another
    train.sync, or local SGD / DiLoCo with another replica count (mesh.data)."""
    saved, now = meta["config"]["train"].get("sync", "every_step"), s.cfg.train.sync
    start = f"or start a new run from its parameters with model.init_from={where.parent.parent}"
    if saved != now:
        raise UserError(f"checkpoint {where} was saved with train.sync={saved} and this run has train.sync={now}, "
                        f"whose train state is laid out otherwise (replicas); resume with train.sync={saved}, {start}")
    n = recorded(meta["mesh"], s.mesh.axis_names)[DATA]
    if now != "every_step" and n != s.mesh.shape[DATA]:
        raise UserError(f"checkpoint {where} holds {n} {now} replicas and this run has {s.mesh.shape[DATA]} "
                        f"(mesh.data); resume with mesh.data={n}, {start} (one set: "
                        + ("the replicas' average)" if now == "local_sgd" else "the synced outer parameters)"))


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
