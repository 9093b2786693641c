"""Each loop plug-in on its own (trainer/run/): when it is due and what it does, against a stand-in run.

The loop's tests through `train` (test_observe, test_reliability, test_checkpoint, test_watchdog) check them
together; these check each decision alone, without compiling a model.
"""
import contextlib
import io
import signal
import time
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

from trainer.config import load_config
from trainer.run.checkpointing import Checkpointing
from trainer.run.evaluator import Eval
from trainer.run.goodput_record import GoodputRecord
from trainer.run.logger import Report
from trainer.run.plugin import Plugin, Stop, extra
from trainer.run.preemption import Preemption
from trainer.run.watchdog import EXIT_CODE, StepWatchdog

ROOT = Path(__file__).resolve().parents[1]


class _Ckpt:
    def __init__(self, every):
        self.every, self.saved, self.closed = every, [], 0

    def due(self, step):
        return self.every > 0 and step % self.every == 0

    def save(self, step, state):
        self.saved.append(step)

    def close(self):
        self.closed += 1


class _Writer:
    def __init__(self):
        self.lines, self.goodput = [], []

    def write(self, rec):
        self.lines.append(dict(rec))

    def write_goodput(self, rec):
        self.goodput.append(rec)


def _run(*overrides, start=0):
    cfg = load_config(["train.steps=10", "run.progress=false", *overrides])
    uploads = []  # a run.dir URL's files uploaded after each save (trainer/ckpt/objects.py)
    return types.SimpleNamespace(uploads=uploads, upload=lambda: uploads.append(1), cfg=cfg, start=start, done=start, state={"params": "P"}, metrics=None, host=None,
                                 record={}, history=[], offset=0,
                                 ckpt=_Ckpt(cfg.checkpoint.every), writer=_Writer(),
                                 s=types.SimpleNamespace(model=types.SimpleNamespace(dpo=None)),  # not DPO
                                 console=Console(file=io.StringIO(), width=200), preempted=False,
                                 goodput=types.SimpleNamespace(record=lambda: {"goodput": 0.5}),
                                 logging=lambda step: step % cfg.run.log_every == 0 or step == cfg.train.steps)


def test_eval_is_due_every_eval_every_and_at_the_last_step():
    run, seen = _run("train.eval_every=4", "train.eval_batches=2"), []
    run.batches = types.SimpleNamespace(c=types.SimpleNamespace(bytes_per_token=2.0), eval=lambda i: i)
    run.batch = lambda rows: rows
    # (loss sum, counted tokens) per batch: 10 tokens at 1.0 nats, 30 at 2.0; one mean over all 40, 1.75
    # (a mean of the two batches' means would be 1.5)
    run.eval_fn = lambda params, batch: seen.append((params, batch)) or (jnp.float32((1 + batch) * (10 + 20 * batch)),
                                                                         jnp.float32(10 + 20 * batch))
    ev = Eval(run)
    for step in range(1, 11):
        run.record = {}
        ev.at_sync(run, step)
        if step in (4, 8, 10):
            assert run.record == {"step": step, "eval_loss": 1.75, "eval_bpb": pytest.approx(1.75 / np.log(2) / 2),
                                  "eval_counted_tokens": 40}
        else:
            assert run.record == {}
    assert seen == [("P", 0), ("P", 1)] * 3


def test_checkpointing_saves_when_due_and_at_the_end_unless_a_streak_is_unacted():
    run = _run("checkpoint.every=3", start=2)
    guard = types.SimpleNamespace(may_save=lambda metrics: metrics != "bad")
    ck = Checkpointing(run, guard)
    for step in range(3, 8):
        ck.at_sync(run, step)
    assert run.ckpt.saved == [3, 6] and len(run.uploads) == 2
    run.done = 7
    ck.on_exit(run, None)
    assert run.ckpt.saved == [3, 6, 7] and run.ckpt.closed == 1
    run.metrics = "bad"  # the guard has a streak to act on: that state is not saved
    ck.on_exit(run, None)
    assert run.ckpt.saved == [3, 6, 7] and run.ckpt.closed == 2
    run.metrics = None
    ck.on_exit(run, RuntimeError("a failed step"))  # an error: closed, nothing saved
    assert run.ckpt.saved == [3, 6, 7] and run.ckpt.closed == 3
    run.done = run.start = 7
    ck.on_exit(run, None)  # nothing trained since the restore
    assert run.ckpt.saved == [3, 6, 7]


def test_preemption_stops_after_the_step_a_signal_arrives_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    run = _run()
    pre = Preemption(run)
    assert pre.at_sync(run, 1) is None and signal.getsignal(signal.SIGTERM) != before
    pre.request._handle(signal.SIGTERM, None)  # what the handler does when SIGTERM arrives
    assert isinstance(pre.at_sync(run, 2), Stop) and run.preempted
    pre.on_exit(run, None)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_during_the_last_step_leaves_a_finished_run():
    """The run reached train.steps: it is not 'stopped early' (exit 0, so that a scheduler does not requeue it)."""
    run = _run()
    pre = Preemption(run)
    pre.request._handle(signal.SIGTERM, None)
    assert pre.at_sync(run, run.cfg.train.steps) is None and not run.preempted
    pre.on_exit(run, None)


def test_report_writes_records_with_more_than_the_step_and_prints_metrics_lines():
    run = _run()
    rep = Report(run)
    run.record = {}
    rep.at_sync(run, 1)
    run.record = {"step": 2, "eval_loss": 3.0}
    rep.at_sync(run, 2)
    run.record = {"step": 3, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1000.0, "mfu": 0.25}
    rep.at_sync(run, 3)
    rep.on_exit(run, None)
    assert [r["step"] for r in run.writer.lines] == [2, 3] and [r["step"] for r in run.history] == [2, 3]
    assert "step 3/10 | loss 2.500 | grad norm 1.000 | lr 1.00e-03 | 1,000 tok/s | MFU 25.0%" in \
        run.console.file.getvalue()


def test_goodput_record_is_written_at_a_normal_end_only():
    run = _run()
    run.done, run.goodput_record = 4, None
    GoodputRecord(run).on_exit(run, RuntimeError("failed"))
    assert run.writer.goodput == [] and run.goodput_record is None
    GoodputRecord(run).on_exit(run, None)
    assert run.writer.goodput == [{"step": 4, "goodput": 0.5}] and run.goodput_record == {"goodput": 0.5}


def test_watchdog_ends_a_phase_that_waits_past_the_limit_and_not_one_that_returns():
    fired = []
    wd = StepWatchdog(0.3, poll_s=0.05, exit=lambda code: fired.append(code))
    with wd.phase("eval (its loss is a mean over the devices)"):
        time.sleep(0.1)  # within the limit
    time.sleep(0.4)
    assert fired == []
    with wd.phase("a checkpoint save"):
        deadline = time.monotonic() + 10
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
    wd.close()
    assert fired[:1] == [EXIT_CODE]
    with wd.phase(None):  # a plug-in that waits on nothing is not watched
        pass


def test_extra_plugins_are_named_module_class_and_a_bad_name_is_one_line():
    got = extra(types.SimpleNamespace(), ["trainer.run.plugin:Plugin"])
    assert len(got) == 1 and isinstance(got[0], Plugin)
    with pytest.raises(Exception, match="run.plugins entry 'nowhere:Thing' cannot be loaded"):
        extra(types.SimpleNamespace(), ["nowhere:Thing"])


def test_a_plugin_module_written_against_moved_module_names_still_loads(monkeypatch):
    """tests/plugins/old_names.py imports trainer.run.goodput, trainer.run.guard and models.moe, as 6e003ec named them; and
    run.plugins may name a plug-in by its old module."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    mine, old = extra(types.SimpleNamespace(), ["old_names:LastWords", "trainer.run.goodput:GoodputRecord"])
    assert isinstance(mine, GoodputRecord) and type(old) is GoodputRecord and mine.limit == 3
    from models.families.moe import MoEConfig
    assert mine.reads is MoEConfig  # the one module, under its old name and its new


def test_profiler_traces_inside_each_step_and_stops_at_the_end(monkeypatch):
    from trainer.run import profiler as P
    calls = []

    class Recorder:
        def __init__(self, spec, log_dir):
            calls.append(("new", spec))

        def before(self, step):
            calls.append(("before", step))

        def annotate(self, step):
            return contextlib.nullcontext(calls.append(("annotate", step)))

        def after(self, step, outputs):
            calls.append(("after", step))

        def stop(self, outputs=None):
            calls.append(("stop", outputs is not None))
    monkeypatch.setattr(P, "StepProfiler", Recorder)
    run = _run("train.profile_steps=2:3")
    run.dir = __import__("pathlib").Path("/nonexistent")
    prof = P.Profiler(run)
    prof.before_step(run, 2)
    prof.after_step(run, 2)
    prof.on_exit(run, None)
    prof.on_exit(run, RuntimeError("x"))
    assert calls == [("new", "2:3"), ("before", 2), ("annotate", 2), ("after", 2), ("stop", True), ("stop", False)]


@pytest.fixture(scope="module")
def tiny_run():
    """A real tiny setup and state (one device) in a stand-in run: what the guard and step metrics read."""
    import jax
    from trainer.state import init_state, make_setup
    s = make_setup(load_config(["model.preset=tiny", "train.steps=10", "run.log_every=2", "mesh.data=1",
                                "train.on_nan=rollback", "train.max_bad_steps=2"]), jax.devices()[:1])
    return s, init_state(s)


def test_step_metrics_fetch_on_log_steps_and_time_steps_from_the_last_sync(tiny_run, capsys):
    from trainer.run.logger import StepMetrics
    s, state = tiny_run
    run = _run("run.log_every=2")
    run.s, run.compile_s, run.synced_at, run.rewound_at = s, 1.0, time.perf_counter(), None
    sm = StepMetrics(run)
    run.metrics = {"loss": jnp.float32(2.0), "grad_norm": jnp.float32(0.5), "lr": jnp.float32(1e-3),
                   "skipped": jnp.int32(1), "bad_streak": jnp.int32(0), "counted_tokens": jnp.float32(960)}
    sm.before_step(run, 1)
    run.record = {}
    sm.at_sync(run, 1)
    assert run.host is None and run.record == {}  # not a log step: nothing fetched
    time.sleep(0.05)
    sm.before_step(run, 2)
    sm.at_sync(run, 2)
    rec = run.record
    assert run.host is not None and rec["step"] == 2 and rec["loss"] == 2.0 and rec["skipped"] == 1
    assert rec["counted_tokens"] == 960 and isinstance(rec["counted_tokens"], int)
    assert rec["step_time_s"] >= 0.05 / 2 and rec["tokens_per_sec"] == pytest.approx(32 * 32 / rec["step_time_s"])
    run.rewound_at, run.synced_at = (time.perf_counter(), 1), time.perf_counter()  # a rollback to step 1
    sm.before_step(run, 2)
    assert sm.from_step == 1 and sm.t_from == run.synced_at


def test_guard_returns_the_rollback_the_loop_applies(tiny_run):
    from trainer.run.on_nan import Guard
    from trainer.run.plugin import Rollback
    s, state = tiny_run
    run = _run("run.log_every=2")
    run.s, run.cfg, run.state, run.initial = s, s.cfg, state, lambda: pytest.fail("there is a checkpoint")
    run.ckpt = types.SimpleNamespace(due=lambda step: False, restore=lambda: (state, 4),
                                     mngr=types.SimpleNamespace(wait_until_finished=lambda: None))
    g = Guard(run)
    run.host, run.metrics = None, {"trip": jnp.int32(7)}
    assert g.at_sync(run, 7) is None  # neither a log step nor a save: the trip waits for a sync point
    run.host = {"trip": np.int32(7)}
    back = g.at_sync(run, 7)
    assert isinstance(back, Rollback) and back.step == 4 and back.offset == 3  # steps 5..7's batches skipped
    assert int(back.state["guard"]["offset"]) == 3 and int(back.state["guard"]["trip"]) == 0
    run.host = {"trip": np.int32(0)}  # the next step runs on the restored state, its trip cleared
    assert g.at_sync(run, 5) is None
