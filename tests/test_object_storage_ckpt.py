"""Checkpoints in object storage (trainer/ckpt/objects.py) against an S3 server on localhost (moto's
ThreadedMotoServer; the `s3` fixture of conftest.py): a save to s3:// restores bit for bit onto another mesh; a step
without Orbax's commit file (a save cut short) is never listed and is saved over; a run with run.dir=s3://... resumes
onto another mesh exactly as from local disk, its metrics and TensorBoard files beside the checkpoints; kill -9 during
a save leaves the previous checkpoint the newest valid one; a missing bucket is one line."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TINY

from trainer.ckpt import checkpoint as ckpt, store
from trainer.cli import main
from trainer.config import load_config
from trainer.state import init_state, make_setup

ROOT = Path(__file__).resolve().parents[1]


def _equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _commits(s3, prefix: str) -> list[str]:
    return sorted(k[len(prefix) + 1:] for k in s3.find(prefix, refresh=True) if k.endswith("commit_success.txt"))


def test_checkpoint_in_s3_restores_bitwise_onto_another_mesh(s3, tmp_path, monkeypatch):
    """Saved on (8,1,1) ZeRO-3 to s3://, read back on (2,1,4) ZeRO-1 and on one device: every leaf bit for bit, in
    the target's shardings. Step 2 written but for its commit files (a save cut short) is not listed, the restore
    takes step 1, and saving step 2 again replaces it. Nothing is written to local disk."""
    monkeypatch.chdir(tmp_path)
    s = make_setup(load_config(TINY + ["mesh.data=8", "train.zero_stage=3"]), jax.devices())
    state = init_state(s)
    saved = jax.tree.map(np.asarray, state)
    url = "s3://bkt/reshard"
    c = ckpt.Checkpointer(s, url)
    c.save(1, state)
    c.close()
    assert _commits(s3, "bkt/reshard/checkpoints/1") == ["commit_success.txt", "meta/commit_success.txt",
                                                         "state/commit_success.txt"]
    assert store.list_steps(url) == [1] and list(tmp_path.iterdir()) == []
    for key in s3.find("bkt/reshard/checkpoints/1"):  # step 2: every object of a save but its commit files
        if not key.endswith(("commit_success.txt", "/")):
            s3.pipe_file(key.replace("/checkpoints/1/", "/checkpoints/2/"), s3.cat_file(key))
    assert store.list_steps(url) == [1]
    for over, n in ((["mesh.data=2", "mesh.model=4", "train.zero_stage=1"], 8), (["mesh.data=1"], 1)):
        s2 = make_setup(load_config(TINY + over), jax.devices()[:n])
        got, at = ckpt.Checkpointer(s2, url).restore()
        assert at == 1 and _equal(got, saved), over
        for x, sh in zip(jax.tree.leaves(got), jax.tree.leaves(s2.shardings)):
            assert x.sharding == sh, over  # read into the target layout, never whole on one device
    c = ckpt.Checkpointer(s, url)
    c.save(2, state)
    c.close()
    assert store.list_steps(url) == [1, 2] and len(_commits(s3, "bkt/reshard/checkpoints/2")) == 3


def test_a_missing_bucket_for_run_dir_is_one_line(s3, capsys):
    assert main(["train", *TINY, "data.source=synthetic", "run.dir=s3://nobucket/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("meshtrain: error: run.dir 's3://nobucket/run': bucket 'nobucket' does not exist (or cannot be "
                   "reached at the endpoint); create it or give another run.dir"), err


# Runs of the CLI: synthetic data, a metrics line and a checkpoint every step.
RUN = ["model.preset=tiny", "train.batch_size=16", "train.warmup_steps=1", "train.lr=1e-2", "train.eval_every=0",
       "run.log_every=1", "run.progress=false", "data.source=synthetic", "checkpoint.every=1"]


def _losses(text: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, text.splitlines()) if "loss" in r]


@pytest.mark.slow  # four runs of the CLI (~25 s); the in-process save and restore above runs by default
def test_a_run_in_s3_resumes_onto_another_mesh_as_on_disk(s3, tmp_path, monkeypatch):
    """2 steps on (8,1,1), then resumed to 3 on (2,1,4): with run.dir=s3://... and with a local run.dir, the same
    losses and the same final parameters bit for bit; metrics.jsonl (each step once), config.yaml and the TensorBoard
    events are in the bucket beside the checkpoints; `meshtrain inspect` and model.init_from read the bucket's run."""
    from trainer.ckpt.params import load_params
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    for run in ("s3://bkt/e2e", str(tmp_path / "local")):
        assert main(["train", *RUN, "mesh.data=8", "train.steps=2", f"run.dir={run}"]) == 0
        assert main(["train", *RUN, "mesh.data=2", "mesh.model=4", "train.steps=3", f"run.dir={run}"]) == 0
    here = _losses((tmp_path / "local" / "metrics.jsonl").read_text())
    there = _losses(s3.cat_file("bkt/e2e/metrics.jsonl").decode())
    assert there == here and [st for st, _ in there] == [1, 2, 3]
    names = {k.removeprefix("bkt/e2e/") for k in s3.find("bkt/e2e")}
    assert {"config.yaml", "goodput.jsonl"} <= names and any(n.startswith("tensorboard/events.") for n in names)
    assert store.list_steps("s3://bkt/e2e") == [1, 2, 3]
    assert _equal(load_params("s3://bkt/e2e")[0], load_params(str(tmp_path / "local"))[0])
    assert main(["inspect", "--run", "s3://bkt/e2e"]) == 0
    more = ["mesh.data=8", "train.steps=1", "checkpoint.every=0", "model.init_from=s3://bkt/e2e"]
    assert main(["train", *RUN, *more, f"run.dir={tmp_path / 'tuned'}"]) == 0


@pytest.mark.slow  # a subprocess run killed mid-save and resumed (~20 s)
def test_kill9_during_a_save_to_s3_leaves_the_previous_checkpoint_newest(s3, tmp_path):
    """A run saving every step to s3:// is killed (SIGKILL) while a step's objects are in the bucket but its commit
    file is not: that step is not listed, the one before it is the newest and restores, and the rerun resumes from
    it and trains to the end, each step logged once."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT), MESHTRAIN_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "trainer.cli", "train", *RUN, "mesh.data=8", "train.steps=30", "run.dir=s3://bkt/k9"]
    log = tmp_path / "run.log"
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    t0, cut = time.time(), None
    while cut is None:
        assert p.poll() is None, log.read_text()
        assert time.time() - t0 < 240, "no save was caught in flight"
        keys = s3.find("bkt/k9/checkpoints", refresh=True) if s3.exists("bkt/k9/checkpoints") else []
        steps = {int(k.split("/")[3]) for k in keys if k.split("/")[3].isdigit()}
        done = {int(k.split("/")[3]) for k in keys if k.endswith(tuple(f"/{st}/commit_success.txt" for st in steps))}
        cut = next((st for st in sorted(steps) if st not in done and st - 1 in done), None)
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    newest = store.list_steps("s3://bkt/k9")[-1]
    assert newest == cut - 1, (cut, store.list_steps("s3://bkt/k9"))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"resumed from s3://bkt/k9/checkpoints/{newest} " in p.stderr, p.stderr
    assert [st for st, _ in _losses(s3.cat_file("bkt/k9/metrics.jsonl").decode())] == list(range(1, 31))


@pytest.mark.slow  # two processes compile and save (~25 s)
def test_two_processes_save_to_s3_and_one_restores(s3):
    """2 processes x 4 devices, (8,1,1) ZeRO-3, checkpoints to s3:// (each process writes its own shards): the same
    losses as 1 process x 8 devices (1e-6), and the newest checkpoint restored by one process onto (2,1,4), every
    parameter equal to its saved checksum."""
    from test_multihost import FSDP, RUN as MH, STEPS, run as launch
    from conftest import run_steps
    from trainer.ckpt.store import checksums, read_meta
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHTRAIN=f"{sys.executable} -m trainer.cli", GRACE_S="3")
    launch(env, 2, 4, *MH, *FSDP, "checkpoint.every=4", "run.dir=s3://bkt/mh")
    got = [r["loss"] for r in map(json.loads, s3.cat_file("bkt/mh/metrics.jsonl").decode().splitlines())
           if "loss" in r]
    ref = run_steps(MH + FSDP, steps=STEPS, source="synthetic").losses
    assert len(got) == STEPS and np.max(np.abs(np.array(got) - ref) / np.abs(ref)) < 1e-6
    assert store.list_steps("s3://bkt/mh") == [4, 8, 12]
    meta = read_meta("s3://bkt/mh", STEPS)
    assert meta["processes"] == 2
    s = make_setup(load_config(MH + ["mesh.data=2", "mesh.model=4", "run.dir=s3://bkt/mh"]))
    c = ckpt.Checkpointer(s, "s3://bkt/mh")
    state, step = c.restore()
    c.close()
    saved = {k.removeprefix("params."): v["checksum"] for k, v in meta["leaves"].items() if k.startswith("params.")}
    assert step == STEPS and checksums(state["params"]) == saved
