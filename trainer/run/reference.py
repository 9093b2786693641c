"""The frozen reference of train.objective=dpo: its log-probability of every answer token (models/dpo.py reads them
as the batch field ref_logp).

dpo.reference (default: model.init_from) is read into the run's parameter shardings like model.init_from (an
export, a run's checkpoint, a Hugging Face folder), and checked against the policy's shapes and vocabulary.
  precompute  before training, every pair (train and held-out) once through a forward of the reference, B rows at
              a time on the run's mesh; the log-probabilities (one float32 per token) are written beside the data,
              `DATA.bin.ref-<hash>.f32` (the hash: of the reference's parameters, the data's sidecar and the compute
              dtype), atomically, and read again by a run with the same hash; the reference is then dropped.
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
        path = Path(str(s.cfg.data.source) + f".ref-{self._hash(params)}.f32")
        if path.is_file() and path.stat().st_size == 4 * len(batches.c.whole):
            batches.ref = np.fromfile(path, np.float32)
            say(f"reference log-probabilities read from {path}")
            return
        batches.ref = self._precompute(params, batches, rows, to_global)
        if jax.process_index() == 0:
            try:
                tmp = path.with_name(path.name + f".tmp{os.getpid()}")
                batches.ref.tofile(tmp)
                os.replace(tmp, path)
                say(f"reference log-probabilities of {len(batches.c.whole):,} tokens written to {path}")
            except OSError as e:  # a read-only folder or a bucket: kept in memory for this run only
                say(f"reference log-probabilities kept in memory: {path} could not be written ({e.strerror or e})")

    def _hash(self, params) -> str:
        from trainer.ckpt.store import checksums
        from trainer.data.batches import sidecar_path
        h = hashlib.sha256(json.dumps(checksums(params), sort_keys=True).encode())
        h.update(sidecar_path(self.s.cfg.data.source).read_bytes())
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
