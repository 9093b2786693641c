"""The training loop: `train(cfg)` is the Python API; the CLI is a thin layer over it.

A short spine: the feed gives each step's rows, the compiled step runs, and the plug-ins
(trainer/run/plugin.py) do everything else, each deciding for itself when it is due; the loop applies
the one action a plug-in may return (a Rollback, a Stop) in one place.
"""
from __future__ import annotations

import contextlib
import time

import jax
from rich.console import Console

from models.objectives.dpo import unit
from trainer.config import Config
from trainer.data.batches import bits_per_byte
from trainer.observe.goodput import summary
from trainer.run.benchmarks import Benchmarks
from trainer.run.checkpointing import Checkpointing
from trainer.run.context import Result, Run, describe  # noqa: F401 - describe: the start-up line, for callers
from trainer.run.evaluator import Eval
from trainer.run.goodput_record import GoodputRecord
from trainer.run.on_nan import Guard
from trainer.run.logger import Report, StepMetrics
from trainer.run.memory_check import is_out_of_memory, out_of_memory
from trainer.run.plugin import Rollback, Stop, extra
from trainer.run.preemption import Preemption
from trainer.run.profiler import Profiler
from trainer.run.watchdog import Watchdog


def plugins(run: Run) -> list:
    """In the order their hooks run: fault injection first; at a sync point metrics, eval, the line, the guard,
    the save, the stop; on exit the same order; the watchdog last (it watches the others' exits too)."""
    guard = Guard(run)
    return [*extra(run, run.cfg.run.plugins), Profiler(run), StepMetrics(run), Eval(run), Benchmarks(run), Report(run), guard,
            Checkpointing(run, guard), Preemption(run), GoodputRecord(run), Watchdog(run)]


@contextlib.contextmanager
def _timed(run: Run, p):
    """A plug-in's hook: its time counted as its goodput part, its wait watched by the watchdog."""
    with (run.goodput.span(p.part) if p.part else contextlib.nullcontext()), run.phase(p.waits):
        yield


def train(cfg: Config, devices=None, console: Console | None = None) -> Result:
    """Train according to cfg; returns the final state and the logged metrics."""
    if cfg.train.objective == "grpo":  # its own loop: a generation of completions every grpo.num_iterations steps
        from trainer.run.grpo import train as train_grpo
        return train_grpo(cfg, devices, console)
    run, ps, error = Run(cfg, devices, console), [], None
    if run.nothing_left:  # nothing to train: nothing compiled, nothing written (CLI exit 0, as a finished run's rerun)
        return run.result()
    try:
        ps = plugins(run)
        run.begin()
        with jax.set_mesh(run.s.mesh):
            for step, rows in run.goodput.timed("data", run.feed):
                with run.goodput.span("data"):
                    batch = run.batch(rows)
                for p in ps:
                    p.before_step(run, step + 1)
                with run.goodput.span("compute"):
                    run.state, run.metrics = run.step_fn(run.state, batch)
                    for p in ps:
                        p.after_step(run, step + 1)
                run.done, run.host, run.record, action = step + 1, None, {}, None
                for p in ps:
                    with _timed(run, p):
                        action = p.at_sync(run, step + 1)
                    if action is not None:
                        break
                run.synced_at = time.perf_counter()
                if isinstance(action, Rollback):
                    run.rewind(action.state, action.step, action.offset)
                elif isinstance(action, Stop):
                    break
    except BaseException as e:
        error = out_of_memory(e, f"running the train steps (reported at step {run.done})") \
            if is_out_of_memory(e) else e
    finally:
        error = _exit(run, ps, error)
    if error is not None:
        raise error
    _goodbye(run)
    return run.result()


def _exit(run: Run, ps: list, error: BaseException | None) -> BaseException | None:
    """Every plug-in's on_exit, each even if an earlier one failed; the first error is the run's."""
    for p in ps:
        try:
            with jax.set_mesh(run.s.mesh), _timed(run, p):
                p.on_exit(run, error)
        except BaseException as e:  # noqa: BLE001 - raised after the others have run
            error = error or e
    if not ps:
        run.ckpt.close()  # a plug-in failed to start: the checkpointer still closes
    if run.writer is not None:
        try:
            run.upload()
        except BaseException as e:  # noqa: BLE001 - the run's own error, if any, comes first
            error = error or e
        run.writer.close()
    return error


def _goodbye(run: Run):
    total = time.perf_counter() - run.t0
    if run.preempted:
        run.console.print(f"stopped after step {run.done}; checkpoint saved, rerun the same command to resume")
    run.console.print(f"done: {run.done - run.start} steps in {total:.1f}s{_eval_words(run)}")
    run.console.print(summary(run.goodput_record))


def _eval_words(run: Run) -> str:
    """', eval loss L nats/token (B bits/byte)', or the held-out pairs' DPO loss in its own unit (models/objectives/dpo.py)."""
    loss, bpt, dpo = run.eval_loss, run.batches.c.bytes_per_token, run.s.model.dpo
    if loss is None:
        return ""
    if dpo is not None:
        return f", eval DPO loss {loss:.4f} {unit(dpo)}"
    return f", eval loss {loss:.4f} nats/token" + (f" ({bits_per_byte(loss, bpt):.4f} bits/byte)" if bpt else "")
