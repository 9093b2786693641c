"""The training loop: `train(cfg)` is the Python API; the CLI is a thin layer over it."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from models import flops_per_token, hardware_flops_per_token, param_count
from trainer.ckpt.checkpoint import Checkpointer
from trainer.ckpt.initial import initial_state
from trainer.ckpt.preempt import StopRequest
from trainer.config import Config, to_yaml
from trainer.data.batches import Batches, bits_per_byte, load_corpus
from trainer.data.feed import Feed
from trainer.errors import UserError
from trainer.observe.goodput import Goodput, summary
from trainer.observe.metrics import MetricsWriter, device_peak, peak_devices
from trainer.observe.profiling import StepProfiler
from trainer.parallel.schedules import describe as describe_pipeline
from trainer.sources import resolve
from trainer.run import distributed
from trainer.run.guard import Guard
from trainer.run.memory_check import check_fits, is_out_of_memory, out_of_memory
from trainer.run.watchdog import StepWatchdog
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


def prepare_run_dir(path: str) -> Path:
    d = Path(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write_test.{jax.process_index()}"  # processes sharing run.dir probe at once
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(f"run.dir '{path}' is not writable ({e.strerror}); choose another run.dir") from None
    return d


def to_global(s: Setup, rows: np.ndarray) -> jax.Array:
    """This process's rows -> the global batch array, sharded over `data`."""
    global_shape = (s.cfg.train.batch_size,) + rows.shape[1:]
    return jax.make_array_from_process_local_data(s.batch_sharding(), rows, global_shape)


def evaluate(s: Setup, eval_fn, params, batches: Batches) -> float:
    losses = [eval_fn(params, to_global(s, batches.eval(i))) for i in range(s.cfg.train.eval_batches)]
    return float(np.mean(jax.device_get(losses)))


def describe(s: Setup) -> str:
    t, mc = s.cfg.train, s.model
    manual = uses_manual_sync(s)
    sync = t.grad_sync if manual else "auto (compiler all-reduce)"
    if t.grad_sync == "auto" and manual:
        sync = "explicit reduce-scatter (ZeRO-2/3)" if t.zero_stage >= 2 else "explicit all-reduce"
    if s.mesh.shape["stage"] > 1:  # trainer/parallel/pipeline.py syncs the stage's share after its tick loop
        sync += ", once per step"
    if t.sync != "every_step":
        sync = f"{t.sync}: replicas apart, parameters all-reduced every {t.sync_every} steps"
    return (f"model {param_count(mc) / 1e6:.2f}M params (d={mc.d_model} L={mc.n_layers} H={mc.n_heads} "
            f"KV={mc.n_kv_heads} F={mc.d_ff} V={mc.vocab_size} T={mc.seq_len}, remat={mc.remat}) | "
            f"mesh data={s.mesh.shape['data']} stage={s.mesh.shape['stage']} model={s.mesh.shape['model']} | "
            f"ZeRO-{t.zero_stage} | sync {sync} | {s.dtype.name} compute | batch {t.batch_size} x "
            f"{t.microbatches} microbatch(es)"
            + (f" | {describe_pipeline(s.mesh.shape['stage'], t.microbatches, t.pipeline_repeats, t.pipeline_schedule)}"
               if s.mesh.shape["stage"] > 1 else ""))


def train(cfg: Config, devices=None, console: Console | None = None) -> Result:
    """Train according to cfg; returns the final state and the logged metrics."""
    gp = Goodput()
    console = console or Console(stderr=True, soft_wrap=True)
    distributed.initialize(cfg.dist)  # a no-op once joined (the CLI joins first)
    main = jax.process_index() == 0
    cfg = resolve(cfg)  # an HF init_from folder's shapes; a prepared .bin's sidecar: tokenizer, dtype, vocab_size
    run_dir = prepare_run_dir(cfg.run.dir)
    s = make_setup(cfg, devices)
    check_fits(s)  # the plan against the device's memory, before anything compiles (train.memory_check)
    t = cfg.train
    corpus = load_corpus(cfg.data.source, cfg.data.heldout_fraction, cfg.data.bin_dtype)
    batches = Batches(corpus, t.seed, t.batch_size, s.model.seq_len, s.model.vocab_size,
                      *distributed.process_rows(s.batch_sharding(), t.batch_size), evaluates=t.eval_every > 0)
    bpt = batches.c.bytes_per_token
    console.print(f"[bold]meshtrain[/] {describe(s)}")
    if jax.process_count() > 1:
        console.print(distributed.describe(s.mesh, batches.rows, t.batch_size))

    t0 = time.perf_counter()
    ckpt = Checkpointer(s, run_dir, log=console.print)

    def initial():
        return initial_state(s, console.print)
    try:
        state, start = ckpt.restore() or (initial(), 0)
        guard = Guard(s, ckpt, state, initial)
        feed = Feed(batches, start, t.steps, guard.offset)
        if main:  # only now: a command that fails on its input leaves run.dir as it was
            (run_dir / "config.yaml").write_text(to_yaml(cfg))
        step_fn, eval_fn = jit_train_step(s), jit_eval_step(s)
        with jax.set_mesh(s.mesh):
            compiled = step_fn.lower(state, to_global(s, batches.train(start))).compile()
    except BaseException as e:  # e.g. a model.init_from that is none of its kinds: one line, and Orbax's
        ckpt.close()  # background clean-up joined first (left running, it raised at interpreter exit)
        if is_out_of_memory(e):
            raise out_of_memory(e, "compiling the train step") from None
        raise
    compile_s = time.perf_counter() - t0
    gp.add("compile", compile_s)
    peak, peak_src = device_peak(s.dtype)
    n_peak = peak_devices(s.mesh)
    tokens_per_step = t.batch_size * s.model.seq_len
    fpt, hfpt = flops_per_token(s.model), hardware_flops_per_token(s.model)
    console.print(f"init+compile {compile_s:.1f}s | peak {peak and peak / 1e12:.3g} TFLOP/s x {n_peak} "
                  f"({peak_src}) | {fpt / 1e6:.1f} MFLOP/token")

    writer = MetricsWriter(run_dir, enabled=main, resume_step=start)
    history, eval_loss, preempted, done = [], None, False, start
    profiler = StepProfiler(t.profile_steps, run_dir / "tensorboard")  # TensorBoard's profile tab reads it there
    watchdog = StepWatchdog(t.step_timeout_s)
    progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn(),
                        TextColumn("{task.fields[info]}"), console=console, disable=not cfg.run.progress)
    try:
        with progress, jax.set_mesh(s.mesh), StopRequest() as stop:
            task = progress.add_task("train", total=t.steps, completed=start, info="")
            last_t, last_step = time.perf_counter(), start
            for step, rows in gp.timed("data", feed):
                with gp.span("data"):
                    batch = to_global(s, rows)
                done = step + 1
                profiler.before(done)
                watchdog.begin(done)  # before dispatch: on CPU the call itself may run the step
                with gp.span("compute"):
                    with profiler.annotate(done):
                        state, metrics = compiled(state, batch)
                    watchdog.watch(done, metrics)  # a waiter thread blocks on it, not this one
                    profiler.after(done, (state, metrics))
                logging = done % cfg.run.log_every == 0 or done == t.steps
                evaluating = t.eval_every > 0 and (done % t.eval_every == 0 or done == t.steps)
                if logging:
                    with gp.span("compute"):
                        m = jax.device_get(metrics)  # the only host sync in the loop
                    now = time.perf_counter()
                    dt = (now - last_t) / (done - last_step)
                    last_t, last_step = now, done
                    tps = tokens_per_step / dt
                    mfu = fpt * tps / (peak * n_peak) if peak else None
                    rec = {"step": done, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                           "lr": float(m["lr"]), "tokens_per_sec": tps, "step_time_s": dt, "mfu": mfu,
                           "hfu": hfpt * tps / (peak * n_peak) if peak else None, **guard.fields(m)}
                    if evaluating:
                        with gp.span("eval"):
                            eval_loss = evaluate(s, eval_fn, state["params"], batches)
                        rec["eval_loss"] = eval_loss
                        if bpt:
                            rec["eval_bpb"] = bits_per_byte(eval_loss, bpt)
                        last_t = time.perf_counter()  # eval time is not step time
                    writer.write(rec)
                    history.append(rec)
                    info = (f"loss {rec['loss']:.3f} | grad norm {rec['grad_norm']:.3f} | lr {rec['lr']:.2e} | "
                            f"{tps:,.0f} tok/s | MFU "
                            f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
                            + (f" | eval {eval_loss:.3f}" if evaluating else ""))
                    progress.update(task, completed=done, info=info)
                    console.print(f"step {done}/{t.steps} | {info}")
                elif evaluating:
                    with gp.span("eval"):
                        eval_loss = evaluate(s, eval_fn, state["params"], batches)
                    rec = {"step": done, "eval_loss": eval_loss}
                    if bpt:
                        rec["eval_bpb"] = bits_per_byte(eval_loss, bpt)
                    writer.write(rec)
                    history.append(rec)
                if (logging or ckpt.due(done)) and (trip := guard.tripped(m if logging else metrics)):
                    state, done = guard.act(trip)  # on_nan=rollback (stop raises): back to a checkpoint
                    writer.close()
                    writer = MetricsWriter(run_dir, enabled=main, resume_step=done)
                    feed.restart(done, guard.offset)
                    history = [r for r in history if r["step"] <= done]
                    last_t, last_step = time.perf_counter(), done
                    progress.update(task, completed=done)
                    continue
                if ckpt.due(done):
                    with gp.span("checkpoint"):
                        ckpt.save(done, state)
                if stop.agreed(can_sync=logging):
                    preempted = True
                    break
            profiler.stop(state)
            with gp.span("checkpoint"):
                if done > start and guard.may_save(metrics):
                    ckpt.save(done, state)
                ckpt.close()  # waits for the save in flight, still inside the signal handlers
            goodput = gp.record()
            writer.write_goodput({"step": done, **goodput})
    except (jax.errors.JaxRuntimeError, MemoryError) as e:
        if is_out_of_memory(e):
            raise out_of_memory(e, f"running the train steps (reported at step {done})") from None
        raise
    finally:
        watchdog.close(sys.exc_info()[1])  # an error with peers gone must not hang the exit
        profiler.stop()
        writer.close()
        ckpt.close()
    total = time.perf_counter() - t0
    if preempted:
        console.print(f"stopped after step {done}; checkpoint saved, rerun the same command to resume")
    console.print(f"done: {done - start} steps in {total:.1f}s"
                  + (f", eval loss {eval_loss:.4f} nats/token" if eval_loss is not None else "")
                  + (f" ({bits_per_byte(eval_loss, bpt):.4f} bits/byte)" if eval_loss is not None and bpt else ""))
    console.print(summary(goodput))
    return Result(s, state, history, eval_loss, start, preempted, goodput)
