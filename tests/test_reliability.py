"""Reliability: NaN/spike guard, rollback, stop, a 3-kill chaos drill, and loading that never runs code."""
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TINY, corpus, fresh_state
from models.batch import from_windows

from trainer.ckpt import store as ckpt
from trainer.ckpt.params import load_params

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "labs"))
import chaos  # noqa: E402

# The drill: data positions 9 and 10 are poisoned; two bad steps in a row roll back.
DRILL = ["train.inject_nan_at=9:10", "train.on_nan=rollback", "train.max_bad_steps=2", "checkpoint.keep=0"]
STEPS = 20


def _host(state, *keys):
    return jax.tree.map(np.asarray, {k: state[k] for k in keys})


def _equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_nan_and_spike_skip_the_update_and_leave_the_state_untouched():
    from trainer.config import load_config
    from trainer.data.batches import Batches
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    cfg = load_config(TINY + ["mesh.data=8", "train.zero_stage=1", "train.steps=20", "train.inject_nan_at=2",
                              "train.spike_factor=1.2", "train.spike_window=3"])
    s = make_setup(cfg)
    state, step = fresh_state(s), jit_train_step(s)
    b = Batches(corpus(), cfg.train.seed, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
    noise = from_windows(np.random.default_rng(0).integers(0, 256, size=(16, s.model.seq_len + 1)))
    after, ms = [_host(state, "params", "opt_state")], []
    with jax.set_mesh(s.mesh):
        for i in range(9):  # step 8 (i=7) trains on uniform noise: a loss spike once the model has learned
            state, m = step(state, jax.device_put(noise if i == 7 else b.global_train(i), s.batch_sharding()))
            after.append(_host(state, "params", "opt_state"))
            ms.append({k: float(v) for k, v in jax.device_get(m).items()})
    assert int(state["step"]) == 9  # the step counter (and so the data position) moves on
    # step 2: NaN injected -> skipped, params and Adam moments bitwise as after step 1
    assert np.isnan(ms[1]["loss"]) and ms[1]["skipped"] == 1 and ms[1]["bad_streak"] == 1
    assert _equal(after[2], after[1]) and not _equal(after[1], after[0])
    assert ms[2]["bad_streak"] == 0 and not _equal(after[3], after[2])
    # step 8: finite loss above 1.2 x the median of the last 3 accepted losses (steps 5-7) -> skipped
    median = float(np.median([ms[i]["loss"] for i in (4, 5, 6)]))
    assert np.isfinite(ms[7]["loss"]) and ms[7]["loss"] > 1.2 * median, (ms[7]["loss"], median)
    assert all(m["loss"] <= 1.2 * median for m in ms[4:7])  # no false alarm before it
    assert _equal(after[8], after[7]) and ms[7]["skipped"] == 2
    assert ms[8]["bad_streak"] == 0 and ms[8]["skipped"] == 2 and not _equal(after[9], after[8])


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory):
    """The NaN-rollback drill's uninterrupted run on one device (chaos.reference())."""
    return chaos.reference(DRILL, tmp_path_factory.mktemp("chaos"), devices=1, steps=STEPS, timeout=300)


@pytest.mark.slow  # four more processes (~45 s); a kill -9 resume runs by default in test_checkpoint.py
def test_chaos_three_kills_resume_bitwise(ref_run):
    drill = chaos.chaos(3, DRILL, seed=1, timeout=300, ref=ref_run)
    assert drill["kills"] == 3 and drill["during_save"] >= 1, drill
    assert drill["params_bitwise_equal"] and drill["state_checksums_equal"], drill
    assert drill["losses_equal"] and drill["steps_once"] and drill["steps_logged"] == STEPS, drill
    assert drill["resumed_newest"], drill


def _records(run: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def test_rollback_restores_the_checkpoint_and_moves_past_the_bad_batches(ref_run):
    from models.objectives.objective import loss_fn
    from trainer.config import model_config
    from trainer.data.batches import Batches, load_corpus
    ref = Path(ref_run["workdir"]) / "ref"
    log = (ref.parent / "ref.log").read_text()
    # steps 9, 10 are bad; at 10 it rolls back to the newest checkpoint (8): data offset 2
    assert "2 consecutive bad steps (non-finite loss or gradient norm, steps 9..10); rolled back to step 8, " \
           "data offset now 2" in log, log
    recs = _records(ref)
    assert sorted(recs) == list(range(1, STEPS + 1))  # the rolled-back steps are logged once, as redone
    assert all(np.isfinite(r["loss"]) and r["skipped"] == 0 for r in recs.values())
    assert [r.get("data_offset", 0) for r in recs.values()] == [0] * 8 + [2] * (STEPS - 8)
    # step 9 after the rollback = checkpoint 8's parameters on the batch at position 11 (index 10)
    params, cfg = load_params(ref, 8, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    mc, t = model_config(cfg), cfg.train
    batches = Batches(load_corpus("synthetic"), t.seed, t.batch_size, mc.seq_len, mc.vocab_size)
    loss = jax.jit(lambda p, b: loss_fn(mc, p, b))
    moved, replayed = float(loss(params, batches.train(10))), float(loss(params, batches.train(8)))
    assert abs(moved - recs[9]["loss"]) < 1e-5 * abs(moved) < abs(replayed - recs[9]["loss"]), (moved, replayed)


def test_checkpoint_meta_records_the_data_position_past_a_rollback(ref_run):
    """Step s trains on the batch at s + offset: a checkpoint records where the next batch comes from."""
    ref = Path(ref_run["workdir"]) / "ref"
    offsets = {r["step"]: r.get("data_offset", 0) for r in _records(ref).values()}  # the metrics' own account
    assert offsets[8] == 0 and offsets[STEPS] == 2  # the rollback at step 10 to step 8 skipped 2 batches
    for step in (STEPS, 10, 8):
        rng = ckpt.read_meta(ref, step)["rng"]
        assert rng["data_step"] == step + offsets[step] and rng.get("data_offset") == offsets[step], (step, rng)


def test_stop_exits_3_naming_the_step(ref_run, tmp_path):
    run = tmp_path / "stop"
    env = chaos.child_env(1, Path(ref_run["workdir"]) / "jax-cache")  # the drill's compiled step
    p = subprocess.run([sys.executable, "-m", "trainer.cli", "train", *chaos.CONFIG, *DRILL, f"train.steps={STEPS}",
                        "train.on_nan=stop", f"run.dir={run}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3, p.stderr
    assert lines[-1].startswith("meshtrain: error: step 10: 2 consecutive bad steps (non-finite loss or "
                                "gradient norm, steps 9..10) and train.on_nan=stop;"), p.stderr
    assert "Traceback" not in p.stderr and sum("error" in ln for ln in lines) == 1, p.stderr
    assert ckpt.list_steps(run) == [2, 4, 6, 8]  # the state after the bad streak is never saved


def test_cli_prints_library_warnings_through_logging(tmp_path, capsys, caplog):
    """The guard's warning is a `logging` record; `meshtrain` prints it on stderr as 'meshtrain: warning: ...'."""
    from trainer.cli import main
    code = main(["train", *TINY, "mesh.data=8", "train.inject_nan_at=2", "train.on_nan=skip", "train.max_bad_steps=1",
                 "train.eval_every=0", "run.log_every=1", "data.source=synthetic", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    want = ("1 consecutive bad steps (non-finite loss or gradient norm) up to step 2; their updates were skipped "
            "(train.on_nan=skip)")
    assert code == 0 and [ln for ln in err.splitlines() if "warning" in ln] == [f"meshtrain: warning: {want}"], err
    logged = [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("trainer")]
    assert logged == [("trainer.run.on_nan", "WARNING", want)], logged


class _Audit:
    """Records audit events (pickle.find_class: an unpickler resolving a global; exec/compile: code run)."""
    events: list = []
    on = False

    @classmethod
    def hook(cls, event, args):
        if cls.on and event in ("pickle.find_class", "exec", "compile"):
            src = args[0].decode() if event == "compile" and isinstance(args[0], bytes) else args[0]
            cls.events.append((event, str(args)[:80], src if isinstance(src, str) else None))

    def __enter__(self):
        _Audit.events, _Audit.on = [], True
        return _Audit.events

    def __exit__(self, *exc):
        _Audit.on = False


sys.addaudithook(_Audit.hook)


def test_checkpoint_loading_never_unpickles(ref_run, tmp_path):
    ref, marker = Path(ref_run["workdir"]) / "ref", tmp_path / "pwned"
    with _Audit() as events:  # a clean load
        params, _ = load_params(ref, STEPS)
    assert jax.tree.leaves(params) and not [e for e in events if e[0] == "pickle.find_class"], events
    bomb = pickle.dumps(type("Bomb", (), {"__reduce__": lambda self: (os.system, (f"touch {marker}",))})())
    assert b"system" in bomb
    for name in ("state/_METADATA", "meta/metadata", "_CHECKPOINT_METADATA"):
        run = tmp_path / name.replace("/", "_")
        shutil.copytree(ref, run)
        (run / "checkpoints" / str(STEPS) / name).write_bytes(bomb)  # a pickle where JSON is expected
        with _Audit() as events:
            try:
                load_params(run, STEPS)
            except Exception as e:  # noqa: BLE001 - refused as unreadable is fine; running it is not
                assert "corrupt" in str(e) or "no checkpoint" in str(e), e
        assert not marker.exists() and not [e for e in events if e[0] == "pickle.find_class"], (name, events)


def test_config_parsing_never_evaluates_code(tmp_path):
    from trainer.config import load_config
    from trainer.errors import UserError
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f'train:\n  steps: !!python/object/apply:os.system ["touch {marker}"]\n')
    good = tmp_path / "good.yaml"
    good.write_text("train:\n  steps: 7\n  lr: ${train.b1}\nrun:\n  dir: /x\n")
    with _Audit() as events:
        assert load_config([str(good), "train.seed=3"]).train.lr == 0.9  # interpolation is a lookup, not code
        for args in ([str(evil)], ['train.steps=!!python/object/apply:os.system ["touch x"]']):
            with pytest.raises(UserError, match="could not determine a constructor"):
                load_config(args)
        compile("'the audit sees this'", "<control>", "eval")  # the hook is live: a compile is recorded
    assert not marker.exists() and not [e for e in events if e[0] == "pickle.find_class"], events
    # OmegaConf may evaluate the schema's own type annotations (strings under `from __future__ import
    # annotations`; once per process); nothing else, and nothing from the files or overrides, is compiled
    compiled = {e[2] for e in events if e[0] == "compile"}
    assert "'the audit sees this'" in compiled, events
    assert compiled - {"'the audit sees this'"} <= _annotations(), compiled - _annotations()


def _annotations() -> set:
    import dataclasses
    from trainer.config import Config
    sections = [f.default_factory for f in dataclasses.fields(Config)]
    return {f.type for cls in [Config, *sections] for f in dataclasses.fields(cls)}


def test_no_code_loading_calls_in_the_source():
    """What would run code from a file: pickle, eval/exec, unsafe YAML loaders, numpy pickles."""
    bad = re.compile(r"\bimport pickle\b|\bpickle\.|cloudpickle|(?<![.\w])(?<!def )(eval|exec)\(|yaml\.(unsafe_)?load\(|"
                     r"UnsafeLoader|FullLoader|allow_pickle\s*=\s*True|marshal\.")
    hits = [f"{p.relative_to(ROOT)}:{i}" for d in ("trainer", "models", "meshes") for p in (ROOT / d).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert hits == [], hits
    assert bad.search("x = pickle.loads(b)") and bad.search("eval(s)") and not bad.search("batches.eval(i)")
    assert not bad.search("    def eval(self, i):")


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory):
    """6 logged steps, data position 2 NaN (skipped), evaluations at 2, 4, 6; the peak measurement counted."""
    import inspect
    from io import StringIO

    from rich.console import Console

    from trainer.observe import metrics
    from trainer.config import load_config
    from trainer.run.loop import train
    calls, measure = [], metrics.measure_matmul_rate

    def counted(*args, **kw):
        bound = inspect.signature(measure).bind(*args, **kw)
        bound.apply_defaults()
        calls.append(bound.arguments)
        return measure(*args, **kw)
    cfg = load_config(TINY + ["train.steps=6", "train.warmup_steps=3", "train.inject_nan_at=2", "train.on_nan=skip",
                              "train.eval_every=2", "train.eval_batches=1", "run.log_every=1",
                              f"run.dir={tmp_path_factory.mktemp('skip')}"])
    out = StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metrics, "measure_matmul_rate", counted)
        result = train(cfg, console=Console(file=out, width=400))
    return cfg, result, calls, out.getvalue()


def test_logged_lr_is_the_schedule_at_the_optimizer_count(skip_run):
    import math
    cfg, result, _, _ = skip_run
    t = cfg.train
    peak, end, warmup, total = t.lr, t.lr * t.min_lr_ratio, 3, 6

    def schedule(count):  # linear warmup from 0, then cosine to lr * min_lr_ratio at train.steps
        if count < warmup:
            return peak * count / warmup
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * (count - warmup) / (total - warmup)))
    recs = {r["step"]: r for r in result.history if "loss" in r}
    assert sorted(recs) == list(range(1, 7)) and np.isnan(recs[2]["loss"]) and recs[2]["skipped"] == 1
    # step 2's update was skipped: the optimizer has taken step - 2 updates before step 3, 4, ...
    counts = {1: 0, 2: 1, 3: 1, 4: 2, 5: 3, 6: 4}
    got = [recs[s]["lr"] for s in range(1, 7)]
    want = [schedule(counts[s]) for s in range(1, 7)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


def test_cpu_peak_measured_once_before_training_and_named(skip_run):
    _, result, calls, out = skip_run
    assert len([r for r in result.history if "eval_loss" in r]) == 3  # evaluations ran, none measured again
    assert len(calls) == 1, calls
    m = re.search(r"peak [\d.]+ TFLOP/s x 1 \(measured: float32 (\d+)\^3 matmul, best of (\d+)", out)
    assert m, out[:2000]
    assert (int(m.group(1)), int(m.group(2))) == (calls[0]["n"], calls[0]["reps"]), (m.group(0), calls)
