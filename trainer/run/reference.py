"""The frozen reference of train.objective=dpo: its log-probability of every answer token (models/objectives/dpo.py reads them
as the batch field ref_logp).

dpo.reference (default: model.init_from) is read into the run's parameter shardings like model.init_from (an
export, a run's checkpoint, a Hugging Face folder). Before anything compiles it is checked (`check`): it exists, it is
the policy's architecture (its saved config or config.json), and on a resume it is the reference the checkpoints were
trained against (dropping dpo.reference is refused; naming another one warns that the objective changes there).
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
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshes import STAGE
from models.objectives.cross_entropy import head_cross_entropy
from models.objectives.objective import hidden
from trainer.data.checks import no_pairs
from trainer.errors import UserError

log = logging.getLogger(__name__)


def logp_fn(s):
    """jit: (params, batch without ref_logp) -> each target's log-probability (B, T) under params, no gradient."""
    def logp(params, batch):
        c = s.model
        x, _ = hidden(c, params, batch, dtype=s.dtype, constrain=s.layout.constrainer(), placement=s.placement)
        ce = head_cross_entropy(c, params, x, batch["targets"], jnp.ones_like(batch["loss_weight"]),
                                s.layout.constrainer(), per_token=True)
        return jax.lax.stop_gradient(-ce)
    fields = {k: v for k, v in s.abstract_batch().items() if k != "ref_logp"}
    return jax.jit(logp, in_shardings=(s.shardings["params"], {k: v.sharding for k, v in fields.items()}),
                   out_shardings=s.batch_sharding())


def named(cfg) -> tuple[str | None, str]:
    """(the reference's path, how lines name it): dpo.reference, else model.init_from (the model training starts
    from)."""
    if cfg.dpo.reference:
        return cfg.dpo.reference, f"dpo.reference '{cfg.dpo.reference}'"
    return cfg.model.init_from, f"model.init_from '{cfg.model.init_from}' (the reference: dpo.reference is unset)"


def check(s) -> None:
    """One line, before anything compiles, for a reference this run cannot use: one that is missing or none of the
    kinds, of another architecture than the policy, another than its checkpoints were trained against (a resume),
    or online under a pipeline."""
    if s.model.dpo is None:
        return
    stage = s.mesh.shape[STAGE]
    if s.model.dpo.online and stage > 1:
        raise UserError(f"dpo.reference_mode=online runs the reference's forward outside the pipeline every step, and "
                        f"under mesh.stage={stage} every layer's weights would cross the stages on each call (not "
                        "supported); set dpo.reference_mode=precompute (one forward of every pair before training) or "
                        "mesh.stage=1")
    path, key = named(s.cfg)
    if path is None:  # the config's validation refuses it first
        return
    _same_architecture(s.model, path, key, _kind(path, key), s.cfg.model.init_from)
    _same_as_trained(s)


def _kind(path: str, key: str) -> str:
    """What the reference is (export, run, hf); one line where it is missing or none of those."""
    from trainer.ckpt.objects import path_of
    from trainer.ckpt.store import kind_of, list_steps
    kind = kind_of(path)
    if kind == "run" and list_steps(path):
        return kind
    if kind in ("export", "hf"):
        return kind
    what = ("is a run.dir without a complete checkpoint" if kind == "run" else
            "does not exist" if not path_of(path).exists() else "is none of the models a reference can be")
    raise UserError(f"{key} {what}; give the frozen reference of train.objective=dpo as an export (meshtrain export "
                    "--out), a run.dir with checkpoints or a Hugging Face model folder (config.json), of this model's "
                    "architecture")


# How the run computes, not what the model is: the reference's forward runs with the policy's settings of these
RUN_TIME = frozenset({"seq_len", "remat", "scan_layers", "attention", "attention_block", "kernels", "loss_chunk",
                      "init_std", "documents", "dpo", "capacity_factor", "router_aux_loss", "router_z_loss"})


def _model_of(path: str, kind: str):
    """The model the reference describes (its saved config, or its config.json's keys); None where that cannot be
    read without its weights (damage is reported as the weights are read)."""
    import dataclasses

    from trainer.ckpt.objects import path_of
    from trainer.ckpt.store import EXPORT_META, CorruptCheckpoint, config_of, list_steps, read_meta
    from trainer.config import load_config, model_config, replace
    from trainer.data import remote
    try:
        if kind == "export":
            return model_config(config_of(json.loads((path_of(path) / EXPORT_META).read_text())))
        if kind == "run":
            return model_config(config_of(read_meta(path, list_steps(path)[-1])))
    except (OSError, ValueError, KeyError, CorruptCheckpoint):
        return None
    if remote.is_url(path):  # an HF folder in object storage: its tensors are checked as they are read
        return None
    from trainer.ckpt.hf import model_keys, read_config
    keys = {k: v for k, (v, _) in model_keys(read_config(path), Path(path) / "config.json").items()}
    base = load_config()
    return model_config(replace(base, model={k: v for k, v in keys.items()
                                             if k in {f.name for f in dataclasses.fields(base.model)}}))


def _same_architecture(mc, path: str, key: str, kind: str, init_from) -> None:
    """One line naming each model fact (family, widths, depth, vocabulary, RoPE, norm) where the reference differs
    from the policy: DPO compares their log-probabilities of the same tokens, and the reference's forward runs with
    the policy's model. The policy's own model.init_from is checked as the policy starts."""
    if path == init_from:
        return
    try:
        ref = _model_of(path, kind)
    except UserError as e:
        raise UserError(f"{key}: {e}") from None
    if ref is None:
        return
    facts = lambda m: {k: v for k, v in vars(m).items() if k not in RUN_TIME}  # noqa: E731
    theirs, mine = facts(ref), facts(mc)
    diff = [f"{k} {theirs.get(k)} vs {mine.get(k)}" for k in {**theirs, **mine} if theirs.get(k) != mine.get(k)]
    if diff:
        raise UserError(f"{key} is a model of another architecture than this run's (reference vs policy: "
                        f"{', '.join(diff)}); DPO compares the two models' log-probabilities of the same tokens, so "
                        "give a reference of the policy's architecture (usually the model training starts from, "
                        "model.init_from)")


def _same_as_trained(s) -> None:
    """On a resume of a DPO run, the reference its checkpoints were trained against: dropping dpo.reference (the
    default, model.init_from, then another) is one line; naming another one explicitly changes the objective from
    the resumed step on, with a warning that says so."""
    from trainer.ckpt.store import CorruptCheckpoint, list_steps, read_meta
    try:
        steps = list_steps(s.cfg.run.dir)
        saved = read_meta(s.cfg.run.dir, steps[-1])["config"] if steps else None
    except (UserError, CorruptCheckpoint, OSError, ValueError):
        return  # the restore reports it (or takes an older checkpoint)
    if not saved or saved.get("train", {}).get("objective") != "dpo":
        return
    was = saved.get("dpo", {}).get("reference") or saved.get("model", {}).get("init_from")
    now = named(s.cfg)[0]
    if was is None or _same_path(was, now):
        return
    step = steps[-1]
    if not s.cfg.dpo.reference:
        raise UserError(f"run.dir {s.cfg.run.dir} was trained to step {step} against the DPO reference '{was}', and "
                        f"this config leaves dpo.reference unset, which would make model.init_from '{now}' the "
                        "reference from here and change the objective mid-run; set dpo.reference="
                        f"{was} to resume as trained, or dpo.reference={now} to change the reference knowingly")
    log.warning(f"dpo.reference changed on resume: the steps to {step} were trained against '{was}', and from step "
                f"{step + 1} the reference is '{now}': the DPO objective changes there (its loss and rewards are "
                "measured against the new reference)")


def _same_path(a: str, b: str | None) -> bool:
    """Whether two paths name one reference (as written, or one local folder)."""
    if b is None:
        return False
    if a == b or os.path.normpath(a) == os.path.normpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # a URL, or a path that is gone
        return False


def load(s, say) -> dict:
    """The reference's parameters in the run's parameter shardings; one line where it does not fit the policy."""
    from trainer.ckpt.params import init_params
    path, key = named(s.cfg)  # one of them: the config's validation sees to it
    try:
        params = init_params(s, path)
    except UserError as e:
        raise UserError(f"{key} does not fit this model: {e}") from None
    say(f"reference model from {path} ({'dpo.reference' if s.cfg.dpo.reference else 'model.init_from'}, "
        f"{s.cfg.dpo.reference_mode})")
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
            raise no_pairs(s.cfg.data.source)  # trainer/data/checks.py says it first, before anything compiles
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
