"""A training run's context: what the loop and its plug-ins share between steps.

`Run(cfg)` sets the run up (config resolved from shapes alone, mesh, the step compiled from abstract inputs and
its memory checked, then the data and the state restored or initialised) and writes nothing: `begin()` makes the
first writes once the plug-ins are made too, so that a start that fails, or finds run.dir at train.steps already
(`nothing_left`), leaves run.dir as it was. The loop then moves `state`, `metrics` and `done` on, and applies a
plug-in's Rollback through `rewind`, the one place that moves a run back.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console

from meshes import DATA, STAGE
from models import family, param_count
from trainer.ckpt.checkpoint import Checkpointer
from trainer.ckpt.objects import RunFiles
from trainer.ckpt.hf import keep_origin
from trainer.ckpt.initial import initial_state
from trainer.ckpt.store import kind_of
from trainer.config import Config, to_yaml
from trainer.data import remote
from trainer.data.batches import Batches, load_corpus
from trainer.data.checks import check_data
from trainer.data.feed import Feed
from trainer.errors import UserError
from trainer.observe.goodput import Goodput
from trainer.observe.metrics import MetricsWriter
from trainer.optim import warn_if_no_decay
from trainer.parallel.schedules import describe as describe_pipeline
from trainer.plan.verify import Footprint, abstract_inputs
from trainer.run import distributed, reference
from trainer.run.reference import Reference
from trainer.run.memory_check import (check_compiled, check_fits, device_limit, is_out_of_memory, out_of_memory,
                                      reference_bytes)
from trainer.ckpt.sources import resolve
from trainer.state import Setup, make_setup
from trainer.step import jit_eval_step, jit_train_step, uses_manual_sync


@dataclasses.dataclass
class Result:
    setup: Setup
    state: dict
    history: list  # the metric records written
    eval_loss: float | None
    start_step: int = 0  # the step it resumed from (0: a fresh run)
    preempted: bool = False  # stopped early by SIGTERM/SIGINT, after saving a checkpoint
    goodput: dict | None = None  # seconds per part of the run (trainer/observe/goodput.py)


def _not_writable(path: str, why: str) -> UserError:
    return UserError(f"run.dir '{path}' is not writable ({why}); choose another run.dir")


def check_run_dir(path: str) -> Path:
    """run.dir checked writable without creating or touching anything (a start that fails leaves it as it was):
    the directory itself or, where it does not exist yet, its nearest existing parent. A URL: its bucket exists."""
    if remote.is_url(path):
        bucket = path.split("://", 1)[1].split("/", 1)[0]
        if not remote.exists(path.split("://", 1)[0] + "://" + bucket):
            raise UserError(f"run.dir '{path}': bucket '{bucket}' does not exist (or cannot be reached at the "
                            "endpoint); create it or give another run.dir")
        return Path(path)
    d = Path(path)
    near = next(p for p in (d, *d.absolute().parents) if p.exists())
    if not near.is_dir():
        raise _not_writable(path, "not a directory" if near == d else f"{near} is a file")
    if not os.access(near, os.W_OK | os.X_OK):
        raise _not_writable(path, f"{near}: permission denied")
    return d


def _newest_step(ckpt_dir) -> int:
    """The newest step among the checkpoint folders' names (-1: none), listed without opening any of them."""
    names = [p.name for p in ckpt_dir.iterdir()] if ckpt_dir.is_dir() else []
    return max((int(n) for n in names if n.isdigit()), default=-1)


def to_global(s: Setup, rows: dict) -> dict:
    """This process's rows of every batch field -> the global batch, each field sharded over `data` (and each
    row's tokens over `context`: a process whose devices hold part of each row passes that part)."""
    def field(x: np.ndarray) -> jax.Array:
        shape = (s.cfg.train.batch_size,) + x.shape[1:]
        own = distributed.process_tokens(s.batch_sharding(), shape)
        return jax.make_array_from_process_local_data(s.batch_sharding(), x[:, own], shape)
    return jax.tree.map(field, rows)


def describe(s: Setup) -> str:
    t, mc = s.cfg.train, s.model
    manual = uses_manual_sync(s)
    sync = t.grad_sync if manual else "auto (compiler all-reduce)"
    if t.grad_sync == "auto" and manual:
        sync = "explicit reduce-scatter (ZeRO-2/3)" if t.zero_stage >= 2 else "explicit all-reduce"
    if s.mesh.shape[STAGE] > 1:  # trainer/parallel/pipeline.py syncs the stage's share after its tick loop
        sync += ", once per step"
    if t.sync != "every_step":
        sync = f"{t.sync}: replicas apart, parameters all-reduced every {t.sync_every} steps"
    return (f"model {param_count(mc) / 1e6:.2f}M params (d={mc.d_model} L={mc.n_layers} H={mc.n_heads} "
            f"KV={mc.n_kv_heads} F={mc.d_ff} V={mc.vocab_size} T={mc.seq_len}, remat={mc.remat}) | "
            f"mesh {' '.join(f'{a}={n}' for a, n in s.mesh.shape.items())} | {_experts(s)}"
            f"ZeRO-{t.zero_stage} | sync {sync} | {s.dtype.name} compute | batch {t.batch_size} x "
            f"{t.microbatches} microbatch(es)"
            + (f" | {describe_pipeline(s.mesh.shape[STAGE], t.microbatches, t.pipeline_repeats, t.pipeline_schedule)}"
               if s.mesh.shape[STAGE] > 1 else ""))


def _experts(s: Setup) -> str:
    """'experts 8 over expert=4 (2 per expert rank) | ' for an MoE (its experts split over the mesh axis the run's
    rules map them to: `expert`, or `data` by train.expert_parallel), 'experts 8 replicated over data=4 | ' where they
    are not; '' for a dense model."""
    over = s.layout.rules["experts"]
    return family(s.model.family).experts_line(s.model, s.mesh.shape[over or DATA], over)


class Run:
    """One run between its steps: setup, data, checkpointer, state, the last step's metrics, the records."""

    def __init__(self, cfg: Config, devices=None, console: Console | None = None):
        self.goodput = Goodput()  # from the start: set-up and compile count as compile
        self.console = console or Console(stderr=True, soft_wrap=True)
        distributed.initialize(cfg.dist)  # a no-op once joined (the CLI joins first)
        self.main = jax.process_index() == 0
        # shapes only: an HF init_from folder's config.json, a .bin's sidecar (tokenizer, dtype, vocab); its weights,
        # the tokens and the checkpoints are read once the step has compiled and fits (train.memory_check)
        cfg = self.cfg = resolve(cfg, tensors=False)
        check_data(cfg)  # what the data decides (its tokenizer against the model's, pairs, documents): one line
        self.dir = check_run_dir(cfg.run.dir)  # nothing is written before begin()
        # a URL's checkpoints go there, its other files to a local folder uploaded after each save and at the end
        self.files = RunFiles(cfg.run.dir) if remote.is_url(cfg.run.dir) else None
        if self.files is not None:
            self.dir = self.files.local
        s = self.s = make_setup(cfg, devices)
        t = cfg.train
        self.t0 = time.perf_counter()
        self.ckpt = Checkpointer(s, cfg.run.dir, log=self.console.print)
        self.history, self.eval_loss, self.preempted, self.goodput_record = [], None, False, None
        self.writer = None  # begin() opens it
        self.reference = None  # train.objective=dpo: the frozen reference (trainer/run/reference.py)
        try:
            # a finished run's rerun reads its data and checkpoint first: nothing compiles when that holds train.steps
            early, restored, self.nothing_left = _newest_step(self.ckpt.dir) >= t.steps, None, False
            if early:
                self.batches, restored = self._batches(), self.ckpt.restore()
                self.nothing_left = restored is not None and restored[1] >= t.steps
            if not self.nothing_left:
                reference.check(s)  # train.objective=dpo: a reference mode this layout does not run is one line
                self.limit = device_limit(cfg)  # train.memory_check: what the plan and the compiled step must fit
                check_fits(s, self.limit)  # the plan, before anything compiles
                warn_if_no_decay(t)
                self.step_fn = self._compile()
                if not early:
                    self.batches, restored = self._batches(), self.ckpt.restore()
                self.state, self.start = restored or (self.initial(), 0)
                self.reference = Reference(s, self.batches, self.batches.rows, lambda r: to_global(s, r),
                                           self.console.print) if s.model.dpo is not None else None
                self._announce()
            else:
                self.state, self.start = restored
        except BaseException as e:  # e.g. a model.init_from that is none of its kinds: one line, and Orbax's
            self.ckpt.close()  # background clean-up joined first (left running, it raised at interpreter exit)
            if is_out_of_memory(e):
                raise out_of_memory(e, "compiling the train step") from None
            raise
        self.done, self.metrics, self.host, self.record = self.start, None, None, {}
        if self.nothing_left:
            self.ckpt.close()
            return
        self.compile_s = time.perf_counter() - self.t0
        self.goodput.add("compile", self.compile_s)
        self.offset = int(jax.device_get(self.state["guard"]["offset"]))  # rollbacks moved the data this far
        self.feed = Feed(self.batches, self.start, t.steps, self.offset)
        self.rewound_at = None  # (time, step) of the last rewind
        self.synced_at = time.perf_counter()  # when the last step's sync point ended
        self.phase = lambda what: contextlib.nullcontext()  # a waiting phase, watched once the watchdog is in

    def _announce(self):
        """The start-up lines, once every source (HF folder, data, checkpoint or model.init_from) is read: they
        describe the model that trains."""
        self.console.print(f"[bold]meshtrain[/] {describe(self.s)}")
        if self.batches.note:
            self.console.print(self.batches.note)
        if jax.process_count() > 1:
            self.console.print(distributed.describe(self.s.mesh, self.batches.rows, self.cfg.train.batch_size))

    def _batches(self) -> Batches:
        """The run's data: the corpus read (its time left out of init+compile) and the batch function made."""
        cfg, s, t, t_data = self.cfg, self.s, self.cfg.train, time.perf_counter()
        rows = distributed.process_rows(s.row_sharding(), t.batch_size)
        if cfg.data.mixture:
            from trainer.data.mixture import Mixture
            batches = Mixture(cfg.data, t.seed, t.batch_size, s.model.seq_len, s.model.vocab_size, *rows,
                              evaluates=t.eval_every > 0, document_mask=cfg.data.document_mask)
        else:
            batches = Batches(load_corpus(cfg.data.source, cfg.data.heldout_fraction, cfg.data.bin_dtype), t.seed,
                              t.batch_size, s.model.seq_len, s.model.vocab_size, *rows, evaluates=t.eval_every > 0,
                              document_mask=cfg.data.document_mask)
        self.t0 += time.perf_counter() - t_data
        return batches

    def _compile(self):
        """The train step compiled from the state's and the batch's shapes, before any token, weight or
        checkpoint is read, and its own figures held against the device's memory (train.memory_check). The run
        steps with this executable."""
        s = self.s
        state, batch = abstract_inputs(s)
        with jax.set_mesh(s.mesh):
            step = jit_train_step(s).lower(state, batch).compile()
        check_compiled(Footprint.of(step), self.limit, reference_bytes(s))  # DPO's online reference beside it
        self.eval_fn = jit_eval_step(s)
        return step

    def begin(self):
        """The run's first writes, once nothing can refuse the start (the plug-ins made too): run.dir created,
        config.yaml, an HF model.init_from's context, metrics.jsonl and TensorBoard."""
        cfg = self.cfg
        if self.main:
            if self.files is not None:
                self.files.pull()  # what the URL holds: metrics.jsonl goes on from the checkpoint's step
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                (self.dir / "config.yaml").write_text(to_yaml(cfg))
                if cfg.model.init_from and kind_of(cfg.model.init_from) == "hf":  # context, special ids, tokenizer
                    keep_origin(cfg.model.init_from, self.dir, self.s.model)
            except OSError as e:
                raise _not_writable(cfg.run.dir, e.strerror) from None
        self.writer = MetricsWriter(self.dir, enabled=self.main, resume_step=self.start)

    def upload(self):
        """A URL run.dir's files uploaded (process 0), those that changed since the last upload."""
        if self.files is not None and self.main and self.writer is not None:
            self.writer.flush()
            self.files.push()

    def initial(self) -> dict:
        """The state of a run with no checkpoint to resume: from model.init_from, else random."""
        return initial_state(self.s, self.console.print)

    def batch(self, rows) -> dict:
        batch = to_global(self.s, rows)
        return self.reference.add(batch) if self.reference is not None else batch  # DPO online: ref_logp

    def logging(self, step: int) -> bool:
        """Whether `step` writes a metrics line (run.log_every, and the last step)."""
        return step % self.cfg.run.log_every == 0 or step == self.cfg.train.steps

    def rewind(self, state: dict, step: int, offset: int):
        """Train on from `state` after `step`, reading the data at `offset`: records past it are dropped."""
        self.state, self.done, self.offset = state, step, offset
        self.feed.restart(step, offset)
        self.writer.close()
        self.writer = MetricsWriter(self.dir, enabled=self.main, resume_step=step)
        self.history = [r for r in self.history if r["step"] <= step]
        self.rewound_at = (time.perf_counter(), step)

    def result(self) -> Result:
        return Result(self.s, self.state, self.history, self.eval_loss, self.start, self.preempted,
                      self.goodput_record)
