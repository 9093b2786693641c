"""The frozen reference of train.objective=dpo: its log-probability of every answer token (models/dpo.py reads them
as the batch field ref_logp).

dpo.reference (default: model.init_from) is read into the run's parameter shardings like model.init_from (an
export, a run's checkpoint, a Hugging Face folder), and checked against the policy's shapes and vocabulary.
  precompute  before training, every pair (train and held-out) once through a forward of the reference, B rows at
              a time on the run's mesh; the log-probabilities (one float32 per token) are written beside the data,
              `DATA.bin.ref-<hash>.f32` (the hash: of the reference's parameters, the data's sidecar and the compute
              dtype), atomically, and read again by a run with the same hash; the reference is then dropped. The
              processes decide together (the precompute is collective): they read their copies only where every
              process holds one and all are the same bytes (sha256s gathered); else they compute once together and
              each writes the result where its own folder lacks it or holds other bytes.
  online      the reference stays in memory (as many bytes as the parameters: the planner counts them) and each
              step's batch gets its log-probabilities from a forward of it first, without gradient.
A pair's row is the same in both (its two sequences, nothing else), so both give the same log-probabilities.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.loss import head_token_losses, hidden
from trainer.errors import UserError


def logp_fn(s):
    """jit: (params, batch without ref_logp) -> each target's log-probability (B, T) under params, no gradient."""
    def logp(params, batch):
        c = s.model
        x, _ = hidden(c, params, batch, dtype=s.dtype, constrain=s.layout.constrainer(), placement=s.placement)
        ce = head_token_losses(c, params, x, batch["targets"], jnp.ones_like(batch["loss_weight"]),
                               s.layout.constrainer())
        return jax.lax.stop_gradient(-ce)
    fields = {k: v for k, v in s.abstract_batch().items() if k != "ref_logp"}
    return jax.jit(logp, in_shardings=(s.shardings["params"], {k: v.sharding for k, v in fields.items()}),
                   out_shardings=s.batch_sharding())


def check(s) -> None:
    """One line, before anything compiles, for a reference this layout does not run: online under a pipeline."""
    stage = s.mesh.shape["stage"]
    if s.model.dpo is not None and s.model.dpo.online and stage > 1:
        raise UserError(f"dpo.reference_mode=online runs the reference's forward outside the pipeline every step, and "
                        f"under mesh.stage={stage} every layer's weights would cross the stages on each call (not "
                        "supported); set dpo.reference_mode=precompute (one forward of every pair before training) or "
                        "mesh.stage=1")


def load(s, say) -> dict:
    """The reference's parameters in the run's parameter shardings; one line where it does not fit the policy."""
    from trainer.ckpt.params import init_params
    path = s.cfg.dpo.reference or s.cfg.model.init_from  # one of them: the config's validation sees to it
    try:
        params = init_params(s, path)
    except UserError as e:
        raise UserError(f"dpo.reference '{path}' does not fit this model: {e}") from None
    say(f"reference model from {path} ({s.cfg.dpo.reference_mode})")
    return params


def stored_at(source, digest: str) -> Path:
    """Where the log-probabilities of a reference (its hash) on data.source live: beside a .bin on disk; for one in
    object storage, in this host's cache ($MESHTRAIN_CACHE/dpo/, the URL's path below it)."""
    from trainer.data import remote
    name = f"{source}.ref-{digest}.f32"
    return remote.cache_root() / "dpo" / name.replace("://", "/", 1) if remote.is_url(source) else Path(name)


def _read(path: Path, n: int) -> np.ndarray | None:
    """The log-probabilities at `path`, None where it is missing or not n float32s."""
    return np.fromfile(path, np.float32) if path.is_file() and path.stat().st_size == 4 * n else None


def _digest(a: np.ndarray | None) -> bytes:
    return hashlib.sha256(a.tobytes()).digest() if a is not None else bytes(32)


def _same_everywhere(held: np.ndarray | None) -> bool:
    """Whether every process holds a copy and all copies are the same bytes (their sha256s gathered): the one
    decision every process takes together, since the precompute is collective."""
    if jax.process_count() == 1:
        return held is not None
    from jax.experimental import multihost_utils
    mine = np.frombuffer(bytes([held is not None]) + _digest(held), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))
    return bool(np.all(every[:, 0] == 1) and np.all(every == every[0]))


def _write(path: Path, ref: np.ndarray, held: np.ndarray | None, say) -> None:
    """`ref` written atomically where this process's copy is missing or differs: process 0 first, then each other
    process whose folder still lacks it (a folder the processes share is written once)."""
    first = jax.process_index() == 0
    if first:
        _write_one(path, ref, held, say)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("meshtrain: DPO reference log-probabilities written")
        if not first:
            _write_one(path, ref, _read(path, len(ref)), say)


def _write_one(path: Path, ref: np.ndarray, held: np.ndarray | None, say) -> None:
    if held is not None and _digest(held) == _digest(ref):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # a cache folder (data in object storage)
        tmp = path.with_name(path.name + f".tmp{jax.process_index()}-{os.getpid()}")
        ref.tofile(tmp)
        os.replace(tmp, path)
        say(f"reference log-probabilities of {len(ref):,} tokens written to {path}")
    except OSError as e:  # a read-only folder or a bucket: kept in memory for this run only
        say(f"reference log-probabilities kept in memory: {path} could not be written ({e.strerror or e})")


class Reference:
    """What a DPO run keeps of its reference: its log-probabilities per token (precompute) or its parameters and
    forward (online)."""

    def __init__(self, s, batches, rows, to_global, say):
        self.s, self.mode = s, s.cfg.dpo.reference_mode
        if not batches.c.pairs:
            raise UserError(f"train.objective=dpo trains on preference pairs, and data.source '{s.cfg.data.source}' "
                            "has none; prepare {prompt, chosen, rejected} records with meshtrain prepare, or set "
                            "train.objective=lm")
        self.fn = logp_fn(s)
        params = load(s, say)
        if self.mode == "online":
            self.params = params
            return
        self.params = None
        path = stored_at(s.cfg.data.source, self._hash(params))
        held = _read(path, len(batches.c.whole))  # this process's copy; each process may have a folder of its own
        if _same_everywhere(held):
            batches.ref = held
            say(f"reference log-probabilities read from {path}")
            return
        why = f"no copy at {path}" if held is None else f"another process's copy of {path} is missing or differs"
        say(f"reference log-probabilities of every pair computed: {why}")
        batches.ref = self._precompute(params, batches, rows, to_global)
        _write(path, batches.ref, held, say)

    def _hash(self, params) -> str:
        from trainer.ckpt.store import checksums
        from trainer.data import remote
        from trainer.data.batches import sidecar_path
        source = str(self.s.cfg.data.source)
        h = hashlib.sha256(json.dumps(checksums(params), sort_keys=True).encode())
        h.update(remote.read_bytes(source + ".json") if remote.is_url(source) else sidecar_path(source).read_bytes())
        h.update(str(self.s.dtype).encode())
        return h.hexdigest()[:16]

    def _precompute(self, params, batches, rows, to_global) -> np.ndarray:
        """Every pair's row, B at a time, through the reference; each target's log-probability at its token."""
        from jax.experimental import multihost_utils
        from trainer.data.packing import fields, scatter
        out, B, T = np.zeros(len(batches.c.whole), np.float32), batches.B, batches.T
        for p in (batches.packed, batches.packed_eval):
            for first in range(0, p.rows if p is not None else 0, B):
                g = first + np.arange(B)
                rows_g = np.where(g < p.rows, g, -1)
                local = fields(p, rows_g[rows], batches.c.whole, batches.c.loss_mask, T)
                with jax.set_mesh(self.s.mesh):
                    got = self.fn(params, to_global(local))
                scatter(p, rows_g, np.asarray(multihost_utils.process_allgather(got, tiled=True)), out)
        return out

    def add(self, batch: dict) -> dict:
        """The batch with ref_logp: online, from a forward of the reference; precompute, already in it."""
        if self.mode != "online":
            return batch
        with jax.set_mesh(self.s.mesh):
            return {**batch, "ref_logp": self.fn(self.params, batch)}
