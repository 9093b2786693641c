"""Checkpoints: bit-exact resume after SIGTERM and kill -9, reshard on restore, atomicity, corruption."""
import dataclasses
import errno
import gc
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore
from conftest import TINY

from trainer.ckpt import checkpoint as ckpt, store
from trainer.ckpt.initial import initial_state
from trainer.ckpt.params import load_params
from trainer.cli import STOPPED_EARLY, main
from trainer.config import load_config, model_config
from trainer.errors import CheckpointUnreadable, UserError
from trainer.state import init_state, make_setup

ROOT = Path(__file__).resolve().parents[1]


def warnings(caplog) -> str:
    """The checkpoint module's warnings, logged (library code leaves the handlers to the CLI or the caller)."""
    return "\n".join(r.getMessage() for r in caplog.records
                     if r.name in ("trainer.ckpt.checkpoint", "trainer.ckpt.store") and r.levelno == logging.WARNING)
# Subprocess runs: synthetic data (no corpus to read), a metrics line every step, 20 steps.
RUN = ["model.preset=tiny", "train.batch_size=16", "train.warmup_steps=2", "train.lr=1e-2", "train.steps=20",
       "train.eval_every=0", "run.log_every=1", "run.progress=false", "data.source=synthetic", "mesh.data=8"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The tests' XLA_FLAGS (conftest.py: 8 simulated devices, LLVM at -O0: the processes' compiles take about half
    the time); one persistent compilation cache so that only the first process compiles."""
    return dict(os.environ, JAX_PLATFORMS="cpu",
                PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax-cache")),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def start(run: Path, env, *extra) -> subprocess.Popen:
    run.mkdir(parents=True, exist_ok=True)
    log = open(run.parent / f"{run.name}.log", "a")
    return subprocess.Popen([sys.executable, "-m", "trainer.cli", "train", *RUN, f"run.dir={run}", *extra],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def log_of(run: Path) -> str:
    return (run.parent / f"{run.name}.log").read_text()


def finish(p: subprocess.Popen, timeout=300) -> int:
    return p.wait(timeout=timeout)


def wait_for(cond, p: subprocess.Popen, what: str, timeout=300, poll=0.002):
    t0 = time.time()
    while not cond():
        assert p.poll() is None, f"the run exited (rc {p.returncode}) before {what}"
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(poll)


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line being written
            continue
        if "loss" in rec:
            out.append(rec["step"])
    return out


def losses(run: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "loss" in r]
    steps = [r["step"] for r in recs]
    assert steps == list(range(1, len(steps) + 1)), f"each step must be logged once, in order: {steps}"
    return {r["step"]: r["loss"] for r in recs}


def step_dirs(run: Path) -> list[int]:
    """Finalized step directories, by name (cheap enough to poll)."""
    d = run / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def tmp_dirs(run: Path) -> list[str]:
    d = run / "checkpoints"
    return sorted(p.name for p in d.iterdir() if "tmp" in p.name) if d.is_dir() else []


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, env):
    """Run A: 20 steps straight."""
    run = tmp_path_factory.mktemp("a") / "run"
    assert finish(start(run, env, "checkpoint.every=10")) == 0, log_of(run)
    return losses(run)


def test_resume_is_bit_exact_after_sigterm_and_after_kill9(tmp_path, env, run_a):
    """One run stopped twice (one process start fewer than a run per stop): SIGTERM during step 10 or 11 (that
    step finishes, is saved, exit 75), then, resumed and saving every 5 steps, kill -9 once step 15's checkpoint
    is there; resumed again to step 20: the losses equal run A's (straight, saving every 10), bit for bit."""
    run = tmp_path / "b"
    p = start(run, env, "checkpoint.every=10")
    wait_for(lambda: 9 in logged_steps(run), p, "step 9")
    p.send_signal(signal.SIGTERM)  # arrives during step 10 (or 11): that step finishes, is saved, exit 75
    assert finish(p) == STOPPED_EARLY, log_of(run)  # stopped before train.steps, resumable
    stopped = logged_steps(run)[-1]
    assert 9 <= stopped < 15 and store.list_steps(run)[-1] == stopped, (stopped, store.list_steps(run))
    p = start(run, env, "checkpoint.every=5")
    wait_for(lambda: 15 in step_dirs(run), p, "the step-15 checkpoint")
    p.kill()
    p.wait()
    assert f"resumed from {run}/checkpoints/{stopped} " in log_of(run)
    written = logged_steps(run)[-1]
    assert finish(start(run, env, "checkpoint.every=5")) == 0, log_of(run)
    assert f"resumed from {run}/checkpoints/15 " in log_of(run)
    b = losses(run)  # steps 16..written were logged before the kill and again after: kept once
    assert len(b) == 20 and b == run_a, f"logged up to {written} before the kill"  # exact float equality, steps 1-20


@pytest.mark.slow  # three more process starts (~15 s of CPU); the kill -9 resume above runs by default
def test_kill9_during_async_saves_resumes_from_complete_checkpoints(tmp_path, env, tiny, caplog):
    """kill -9 at 3 random moments while a save is being written; each resume must start from the
    newest complete checkpoint, checksums passing (the last one is resumed in-process)."""
    run, rng, partial, newest = tmp_path / "k", random.Random(0), 0, None
    p = start(run, env, "checkpoint.every=1")
    for kill in range(3):
        if newest is not None:
            wait_for(lambda: log_of(run).count("resumed from") == kill, p, "the resume", poll=0.05)
            line = [x for x in log_of(run).splitlines() if "resumed from" in x][-1]
            assert f"resumed from {run}/checkpoints/{newest} " in line, (line, newest)
        base = max(step_dirs(run), default=0)
        wait_for(lambda: max(step_dirs(run), default=0) > base and tmp_dirs(run), p,
                 "a new checkpoint and a save in flight")
        time.sleep(rng.uniform(0, 0.05))
        p.kill()
        p.wait()
        partial += bool(tmp_dirs(run))
        newest = store.list_steps(run)[-1]
        if kill < 2:
            p = start(run, env, "checkpoint.every=1")
    _, step = ckpt.Checkpointer(tiny[0], run).restore()
    assert step == newest and "incomplete or corrupt" not in log_of(run) + warnings(caplog)
    assert partial >= 1, "no kill landed while a save was being written"


@pytest.fixture(scope="module")
def tiny():
    """A tiny 8-device setup and its initial state, shared: each init is a compile."""
    s = make_setup(load_config(TINY + ["mesh.data=8"]))
    return s, init_state(s)


def _saved_run(tmp_path, tiny, steps=(1, 2), overrides=()):
    """A run dir with checkpoints of the tiny model at the given steps; returns (run, setup, states)."""
    s, state = tiny
    if overrides:
        s = dataclasses.replace(s, cfg=load_config(TINY + ["mesh.data=8", *overrides]))
    run, states = tmp_path / "run", {}
    c = ckpt.Checkpointer(s, run)
    for st in steps:  # distinct contents per step
        state = {**state, "step": state["step"] + 1,
                 "params": jax.tree.map(lambda x: x * 1.5, state["params"])}
        c.save(st, state)
        c.mngr.wait_until_finished()
        states[st] = jax.tree.map(np.asarray, state)
    c.close()
    return run, s, states


def _equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _damage(step_dir: Path, how: str = "flip-byte"):
    files = sorted(step_dir.rglob("*"), key=lambda f: f.stat().st_size if f.is_file() else 0)
    big = files[-1]  # the array data
    data = bytearray(big.read_bytes())
    if how == "truncate":
        big.write_bytes(data[: len(data) // 2])
    elif how == "delete":
        big.unlink()
    elif how == "flip-frame":  # the first byte of a zstd frame: the chunk no longer decompresses
        data[0] ^= 0x10
        big.write_bytes(bytes(data))
    else:  # silent corruption: Orbax reads it without error, the checksum catches it
        data[len(data) // 3] ^= 0x10
        big.write_bytes(bytes(data))


def _files(run: Path) -> dict:
    """Every file under checkpoints/ by name, with its bytes: what 'left where it was' means."""
    d = run / "checkpoints"
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage", ["truncate", "flip-byte", "flip-frame", "delete"])
def test_corrupt_newest_checkpoint_falls_back_with_warning(tmp_path, tiny, caplog, damage):
    run, s, states = _saved_run(tmp_path, tiny)
    _damage(run / "checkpoints" / "2", damage)
    state, step = ckpt.Checkpointer(s, run).restore()
    err = warnings(caplog)
    assert step == 1 and _equal(state, states[1])
    assert f"checkpoint {run}/checkpoints/2 is incomplete or corrupt" in err and "falling back to step 1" in err
    assert store.list_steps(run) == [1] and list((run / "checkpoints").glob("2.corrupt-*"))


# Failures that say nothing about the checkpoint's bytes, raised from inside Orbax's restore: where
# (every array's tensorstore.open, or the metadata JSON's read), the exception, what the message must say.
NOT_DAMAGE = {
    "host-oom": ("arrays", lambda: MemoryError(), "MemoryError"),
    "eio": ("arrays", lambda: OSError(errno.EIO, "Input/output error"), "Input/output error"),
    "disk-full": ("arrays", lambda: OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    "device-oom": ("arrays", lambda: RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                                                  "67108864 bytes."), "RESOURCE_EXHAUSTED: Out of memory"),
    "permission": ("meta", lambda: PermissionError(errno.EACCES, "Permission denied"), "Permission denied"),
}


def _inject(monkeypatch, where: str, make, step_dir: str = "/checkpoints/"):
    """Raise make() where Orbax opens an array (or reads the metadata JSON) of a path containing step_dir."""
    real_open, real_json = tensorstore.open, ocp.JsonCheckpointHandler.restore

    def fake_open(spec, *a, **k):
        if step_dir in str(spec.to_json() if hasattr(spec, "to_json") else spec):
            raise make()
        return real_open(spec, *a, **k)

    def fake_json(self, directory, *a, **k):
        if step_dir in f"{directory}/" and Path(directory).name == "meta":
            raise make()
        return real_json(self, directory, *a, **k)

    if where == "arrays":
        monkeypatch.setattr(tensorstore, "open", fake_open)
    else:
        monkeypatch.setattr(ocp.JsonCheckpointHandler, "restore", fake_json)


@pytest.mark.parametrize("case", list(NOT_DAMAGE))
def test_restore_failure_that_is_not_damage_stops_and_moves_nothing(tmp_path, tiny, capsys, monkeypatch, case):
    where, make, cause = NOT_DAMAGE[case]
    run, _, _ = _saved_run(tmp_path, tiny)
    before = _files(run)
    _inject(monkeypatch, where, make)
    # an earlier test's damaged-checkpoint reads leave failed asyncio tasks (Orbax's); asyncio logs them
    # when they are collected: collect them now, so that this run's stderr is this run's only
    gc.collect()
    capsys.readouterr()
    code = main(["train", *TINY, "mesh.data=8", f"run.dir={run}"])
    err = capsys.readouterr().err.strip()
    assert code == CheckpointUnreadable.exit_code == 4, err
    last = err.splitlines()[-1]
    assert last.startswith(f"meshtrain: error: checkpoint {run}/checkpoints/2 could not be restored (") and \
        cause in last and "no checkpoint was moved or skipped" in last, err
    assert "Traceback" not in err and "corrupt" not in err and "falling back" not in err, err
    assert _files(run) == before and store.list_steps(run) == [1, 2]


@pytest.fixture(scope="module")
def exported_once(tmp_path_factory, tiny):
    from trainer.ckpt.tools import export
    run, _, _ = _saved_run(tmp_path_factory.mktemp("exported"), tiny)
    return export(run, run.parent / "export")


@pytest.fixture
def exported(tmp_path, exported_once):
    """A copy of an export (`meshtrain export`) of a saved run's newest checkpoint, and its files' bytes."""
    import shutil
    out = shutil.copytree(exported_once, tmp_path / "export")
    return out, {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", [c for c in NOT_DAMAGE if NOT_DAMAGE[c][0] == "arrays"] + ["meta-eacces"])
def test_export_read_failure_that_is_not_damage_is_not_called_corrupt(exported, monkeypatch, case):
    """Reading an export is judged as run checkpoints are: out of memory, EIO, EACCES are reported as they
    are (exit 4, the export left alone), not as 'incomplete or corrupt ... export again'."""
    out, before = exported
    if case == "meta-eacces":
        real = Path.read_text
        monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(
            PermissionError(errno.EACCES, "Permission denied")) if self.name == "meta.json" else real(self, *a, **k))
        cause = "Permission denied"
    else:
        _, make, cause = NOT_DAMAGE[case]
        _inject(monkeypatch, "arrays", make, step_dir="/export/params")
    with pytest.raises(CheckpointUnreadable) as e:
        load_params(out)
    msg = str(e.value)
    assert msg.startswith(f"exported parameters {out} could not be read (") and cause in msg, msg
    assert "corrupt" not in msg and "export them again" not in msg and "\n" not in msg, msg
    assert {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


@pytest.mark.parametrize("damage", ["truncate", "flip-byte", "flip-frame", "meta-json"])
def test_damaged_export_is_called_corrupt(exported, damage):
    out, _ = exported
    if damage == "meta-json":
        (out / "meta.json").write_text("{not json")
    else:
        _damage(out / "params", damage)
    with pytest.raises(UserError) as e:
        load_params(out)
    assert not isinstance(e.value, CheckpointUnreadable), e.value
    assert str(e.value).startswith(f"exported parameters {out} are incomplete or corrupt (") and \
        str(e.value).endswith("export them again"), e.value


def test_step_read_agrees_with_the_other_processes(tmp_path, tiny, monkeypatch):
    """`--step N` (export, generate) ends each stage of its read in the agreement the newest-checkpoint
    path has: told that another process could not read, this one stops too instead of going on to the
    checksums, a collective that process would never join."""
    run, _, _ = _saved_run(tmp_path, tiny)
    asked = []

    def another_process_failed(flag):
        asked.append(flag)
        return True
    monkeypatch.setattr(store, "any_process", another_process_failed)
    with pytest.raises(CheckpointUnreadable, match=f"checkpoint {run}/checkpoints/2 could not be restored on "
                                                   "another process"):
        load_params(run, step=2)
    assert asked == [False]  # asked once, after this process's own read, which worked


def test_damaged_newest_then_io_error_moves_neither(tmp_path, tiny, caplog, monkeypatch):
    run, s, _ = _saved_run(tmp_path, tiny)
    _damage(run / "checkpoints" / "2")
    before = _files(run)
    _inject(monkeypatch, "arrays", lambda: OSError(errno.EIO, "Input/output error"), "/checkpoints/1/")
    with pytest.raises(CheckpointUnreadable) as e:
        ckpt.Checkpointer(s, run).restore()
    assert str(e.value).startswith(f"checkpoint {run}/checkpoints/1 could not be restored (OSError: [Errno 5]"), e.value
    assert "checkpoints/2 is incomplete or corrupt" in warnings(caplog)
    assert _files(run) == before  # the damaged step 2 is only moved aside once an older one restores


def test_all_checkpoints_damaged_stop_listing_them_unless_fresh(tmp_path, tiny, caplog):
    run, s, _ = _saved_run(tmp_path, tiny)
    for st in (1, 2):
        _damage(run / "checkpoints" / str(st))
    before = _files(run)
    with pytest.raises(UserError) as e:
        ckpt.Checkpointer(s, run).restore()
    msg = str(e.value)
    assert "none of its 2 checkpoint(s) can be restored" in msg and "checkpoint.on_unreadable=fresh" in msg, msg
    for st in (2, 1):
        assert re.search(f"{re.escape(str(run))}/checkpoints/{st}: '[\\w.]+' does not match its checksum", msg), msg
    assert "\n" not in msg, msg
    assert _files(run) == before
    caplog.clear()
    fresh = dataclasses.replace(s, cfg=load_config(TINY + ["mesh.data=8", "checkpoint.on_unreadable=fresh"]))
    assert ckpt.Checkpointer(fresh, run).restore() is None
    err = warnings(caplog)
    assert "none of its checkpoints can be restored" in err and "starts again from step 0" in err, err
    aside = sorted(p.name.split(".")[0] for p in (run / "checkpoints").glob("*.corrupt-*"))
    assert store.list_steps(run) == [] and aside == ["1", "2"]


# Two processes restore a run's checkpoints (8,1,1) with a fault on process 1 only, at step 2: an I/O
# error opening its arrays (FAULT=eio) or a shard failing its checksum (FAULT=damage).
AGREE = """
import errno, os, sys
from trainer.config import load_config
from trainer.run.distributed import initialize
from trainer.logs import configure
configure()  # as `meshtrain` does
cfg = load_config(sys.argv[2:])
initialize(cfg.dist)
import jax, tensorstore
from trainer.ckpt import checkpoint, store
from trainer.errors import UserError
from trainer.state import make_setup
if jax.process_index() == 1 and os.environ["FAULT"] == "eio":
    real_open = tensorstore.open
    def fake_open(spec, *a, **k):
        if "/checkpoints/2/" in str(spec.to_json() if hasattr(spec, "to_json") else spec):
            raise OSError(errno.EIO, "Input/output error")
        return real_open(spec, *a, **k)
    tensorstore.open = fake_open
if jax.process_index() == 1 and os.environ["FAULT"] == "damage":
    real_verify, calls = checkpoint.verify, []
    def fake_verify(tree, leaves):
        calls.append(1)
        if len(calls) == 1:
            raise store.CorruptCheckpoint("a shard read by process 1 does not match its checksum")
        return real_verify(tree, leaves)
    checkpoint.verify = fake_verify
c = checkpoint.Checkpointer(make_setup(cfg), cfg.run.dir)
try:
    if os.environ.get("STEP"):  # as `meshtrain export --step N` reads: parameters of that step only
        from trainer.ckpt.params import load_params
        load_params(cfg.run.dir, int(os.environ["STEP"]))
        step = int(os.environ["STEP"])
    else:
        state, step = c.restore() or sys.exit("started fresh")
except UserError as e:
    print("ERROR", e, flush=True)
    sys.exit(e.exit_code)
c.close()
print("RESTORED", step, flush=True)
"""


@pytest.mark.parametrize("fault", [pytest.param("eio", marks=pytest.mark.slow), "damage",
                                   pytest.param("eio-step", marks=pytest.mark.slow)])
def test_processes_take_the_same_decision(tmp_path, tiny, fault):
    """An I/O error on one process stops all of them, moving nothing; damage seen by one process makes
    all of them fall back to the same older checkpoint. eio-step: the same I/O error while both read
    step 2's parameters as `--step 2` does (without the agreement, process 0 waited in the checksums'
    collective for ever)."""
    run, _, _ = _saved_run(tmp_path, tiny)
    before = _files(run)
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHTRAIN=f"{sys.executable} {script}", GRACE_S="10",
               FAULT=fault.removesuffix("-step"), STEP="2" if fault.endswith("-step") else "")
    p = subprocess.Popen([str(ROOT / "scripts" / "launch_local.sh"), "2", "4", *TINY, "mesh.data=8", f"run.dir={run}"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out = p.communicate(timeout=150)[0]  # ~10 s; a process left waiting in a collective never returns
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"the processes did not finish: {p.communicate()[0][-3000:]}")
    if fault.startswith("eio"):
        assert p.returncode == 4, out
        assert f"[1] ERROR checkpoint {run}/checkpoints/2 could not be restored (OSError: [Errno 5] " in out, out
        assert f"[0] ERROR checkpoint {run}/checkpoints/2 could not be restored on another process" in out, out
        assert _files(run) == before
    else:
        assert p.returncode == 0 and "[0] RESTORED 1" in out and "[1] RESTORED 1" in out, out
        # both processes warn, each line through logging with its process index
        for i, why in ((0, "damaged on another process"), (1, "a shard read by process 1 does not match its checksum")):
            assert f"[{i}] meshtrain: process {i}: warning: checkpoint {run}/checkpoints/2 is incomplete or corrupt " \
                   f"({why}); falling back to step 1" in out, out
        assert store.list_steps(run) == [1] and len(list((run / "checkpoints").glob("2.corrupt-*"))) == 1


def test_reshard_restore_is_bitwise_and_training_continues(tmp_path, tiny):
    """Save on (8,1,1) ZeRO-3 after one step; restore on (2,1,4) ZeRO-1 and on 1 device ZeRO-0."""
    from conftest import corpus
    from trainer.data.batches import Batches
    from trainer.step import jit_train_step

    def setup(over, n):
        return make_setup(load_config(TINY + over), jax.devices()[:n])

    def step(s, state, i):
        with jax.set_mesh(s.mesh):
            return jit_train_step(s)(state, jax.device_put(batches.global_train(i), s.batch_sharding()))

    s = setup(["mesh.data=8", "train.zero_stage=3"], 8)
    batches = Batches(corpus(), s.cfg.train.seed, s.cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
    fresh = jax.device_put(jax.tree.map(np.asarray, tiny[1]), s.shardings)  # own buffers: the step donates them
    state, _ = step(s, fresh, 0)  # non-zero optimizer moments
    c = ckpt.Checkpointer(s, tmp_path / "run")
    c.save(1, state)
    c.close()
    saved = jax.tree.map(np.asarray, state)
    ref = float(step(s, state, 1)[1]["loss"])
    for over, n in ((["mesh.data=2", "mesh.model=4", "train.zero_stage=1"], 8), (["mesh.data=1"], 1)):
        s2 = setup(over, n)
        got, at = ckpt.Checkpointer(s2, tmp_path / "run").restore()
        assert at == 1 and _equal(got, saved), over
        for x, sh in zip(jax.tree.leaves(got), jax.tree.leaves(s2.shardings)):
            assert x.sharding == sh, over  # read into the target layout, never whole on one device
            assert x.addressable_shards[0].data.shape == sh.shard_shape(x.shape), over
        loss = float(step(s2, got, 1)[1]["loss"])
        assert abs(loss - ref) / abs(ref) < 1e-5, (over, loss, ref)


def test_shape_mismatch_names_parameter_and_both_shapes(tmp_path, tiny):
    run, _, _ = _saved_run(tmp_path, tiny, steps=(1,))
    s2 = make_setup(load_config(TINY + ["mesh.data=8", "model.d_ff=256"]))
    with pytest.raises(UserError) as e:
        ckpt.Checkpointer(s2, run).restore()
    msg = str(e.value)
    assert "parameter 'layers.w_down'" in msg and "(2, 128, 64)" in msg and "(2, 256, 64)" in msg, msg
    assert "\n" not in msg


def test_keep_newest_and_every_mth(tmp_path, tiny):
    run, _, _ = _saved_run(tmp_path, tiny, steps=range(1, 8), overrides=["checkpoint.keep=2", "checkpoint.keep_every=3"])
    assert store.list_steps(run) == [3, 6, 7]


def test_export_inspect_and_init_from(tmp_path, tiny, capsys):
    run, s, states = _saved_run(tmp_path, tiny)
    assert main(["export", "--run", str(run), "--step", "5", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "existing steps: 1, 2" in err, err
    out = tmp_path / "export"
    assert main(["export", "--run", str(run), "--step", "1", "--out", str(out), "--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    assert main(["inspect", "--run", str(run)]) == 0
    text = capsys.readouterr().out
    for line in ("8x1x1", "layers.wq", "(2, 64, 8, 8)", "P('stage', None, 'model', None)"):
        assert line in text, text
    assert [ln.split()[0] for ln in text.splitlines()[2:4]] == ["1", "2"]  # one row per checkpoint

    params, cfg = load_params(out)  # the export: bfloat16, as asked
    want = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), states[1]["params"])
    assert model_config(cfg) == s.model and _equal(params, want)
    params, _ = load_params(run)  # the newest checkpoint, parameters only
    assert _equal(params, states[2]["params"])

    s2 = make_setup(load_config(TINY + ["mesh.data=2", "mesh.model=4", f"model.init_from={out}"]))
    assert ckpt.Checkpointer(s2, tmp_path / "new").restore() is None  # nothing to resume: init_from starts it
    state, step = initial_state(s2), 0
    assert step == 0 and int(state["step"]) == 0
    assert _equal(state["params"], jax.tree.map(lambda x: x.astype(np.float32), want))
    assert all(not np.any(np.asarray(m)) for m in jax.tree.leaves(state["opt_state"]))  # fresh optimizer


def test_second_sigint_aborts_at_once(tmp_path):
    code = ("import os, signal, time\nfrom trainer.ckpt.preempt import StopRequest\n"
            "with StopRequest() as s:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    assert s.agreed(), 'first SIGINT asks to stop'\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(60)\n")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 130 and time.time() - t0 < 30, r.stderr
    assert "stopping after a step every process agrees on" in r.stderr and "aborting" in r.stderr


def test_unwritable_run_dir_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where run.dir's parent should be")
    assert main(["train", *TINY, f"run.dir={blocker}/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "is not writable" in err and "choose another run.dir" in err, err
