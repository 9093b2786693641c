"""Multi-process training on localhost (jax.distributed, gloo) against one process holding all 8 devices.

Runs go through scripts/launch_local.sh as real processes. They share one compilation cache, and
the checkpoint test restores the ZeRO-3 run's checkpoint, so that few programs compile twice.
min_lr_ratio=1 makes the learning rate constant after warmup: a relaunch with other train.steps
then sees the same schedule as the run it resumes.
"""
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
from conftest import TINY, corpus, run_steps

from trainer import distributed
from trainer.checkpoint import Checkpointer, checksums, list_steps, read_meta
from trainer.config import load_config
from trainer.data import Batches
from trainer.errors import UserError
from trainer.state import make_setup

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch_local.sh"
RUN = TINY + ["train.min_lr_ratio=1.0", "train.eval_every=0", "run.log_every=1", "data.source=synthetic"]
FSDP = ["mesh.data=8", "mesh.stage=1", "mesh.model=1", "train.zero_stage=3"]
HYBRID = ["mesh.preset=cpu-8-2x2x2", "mesh.dcn_stage=2"]  # stage across the 2 processes, model inside one
REF_STEPS = 30  # the in-process reference run is this long (the resume test compares later steps)

# Restores a run's newest checkpoint onto the mesh its arguments give; prints the parameters' checksums.
RESTORE = """
import json, sys
from trainer.config import load_config
from trainer.distributed import initialize
cfg = load_config(sys.argv[2:])
initialize(cfg.dist)
import jax
from trainer.checkpoint import Checkpointer, checksums
from trainer.state import make_setup
s = make_setup(cfg)
ckpt = Checkpointer(s, cfg.run.dir)
state, step = ckpt.restore_or_init(lambda: sys.exit("no checkpoint"))
ckpt.close()
sums = checksums(state["params"])
if jax.process_index() == 0:
    print("RESTORED", step, json.dumps(sums), flush=True)
"""


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax-cache")
    return dict(os.environ, PYTHONPATH=str(ROOT), MESHTRAIN=f"{sys.executable} -m trainer.cli",
                JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", GRACE_S="10")


def launch(env, procs, devices, *args, timeout=300, **popen):
    """Start launch_local.sh; returns the Popen (stdout and stderr together, as text)."""
    return subprocess.Popen([str(LAUNCH), str(procs), str(devices), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)


def run(env, procs, devices, *args, timeout=300) -> str:
    p = launch(env, procs, devices, *args)
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-3000:]
    return out


def losses(run_dir) -> dict[int, float]:
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.fixture(scope="module")
def ref_fsdp():
    """Losses of 1 process x 8 devices, (8,1,1) ZeRO-3, for REF_STEPS steps."""
    return run_steps(RUN + FSDP + [f"train.steps={REF_STEPS}"], steps=REF_STEPS, source="synthetic")[0]


@pytest.fixture(scope="module")
def fsdp_run(env, tmp_path_factory):
    """2 processes x 4 devices, (8,1,1) ZeRO-3, 5 steps; it checkpoints step 5 at the end."""
    d = tmp_path_factory.mktemp("fsdp") / "run"
    log = run(env, 2, 4, *RUN, *FSDP, "train.steps=5", f"run.dir={d}")
    return d, log


def test_same_losses_zero3(fsdp_run, ref_fsdp):
    d, log = fsdp_run
    got = losses(d)
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert rel([got[i] for i in range(1, 6)], ref_fsdp[:5]) < 1e-5
    # each process fed its own half of the batch to its own 4 devices
    assert "[0] process 0 of 2 | 4 devices at data 0-3 stage 0 model 0 | batch rows 0:8 of 16" in log
    assert "[1] process 1 of 2 | 4 devices at data 4-7 stage 0 model 0 | batch rows 8:16 of 16" in log


def test_same_losses_2x2x2_hybrid(env, tmp_path):
    ref = run_steps(RUN + HYBRID[:1] + ["train.steps=5"], steps=5, source="synthetic")[0]
    d = tmp_path / "run"
    log = run(env, 2, 4, *RUN, *HYBRID, "train.steps=5", "checkpoint.every=100", f"run.dir={d}")
    got = losses(d)
    assert rel([got[i] for i in range(1, 6)], ref) < 1e-5
    # mesh.dcn_stage=2: stage i lives on process i; data and model stay inside a process, so both need all rows
    for i in range(2):
        assert f"[{i}] process {i} of 2 | 4 devices at data 0-1 stage {i} model 0-1 | batch rows 0:16 of 16" in log


def test_checkpoint_across_process_counts(env, fsdp_run, tmp_path):
    d, _ = fsdp_run
    saved = {k.removeprefix("params."): v["checksum"] for k, v in read_meta(d, 5)["leaves"].items()
             if k.startswith("params.")}
    # 1 process x 8 devices, onto (2,1,4) ZeRO-0
    cfg = load_config(RUN + ["mesh.data=2", "mesh.model=4", "train.steps=5", f"run.dir={d}"])
    s = make_setup(cfg)
    ckpt = Checkpointer(s, d)
    state, step = ckpt.restore_or_init(lambda: pytest.fail("no checkpoint restored"))
    ckpt.close()
    assert step == 5 and checksums(state["params"]) == saved
    assert state["params"]["embed"].sharding.spec != read_meta(d, 5)["leaves"]["params.embed"]["spec"]
    # 4 processes x 2 devices, onto (4,1,2) ZeRO-1
    script = tmp_path / "restore.py"
    script.write_text(RESTORE)
    out = run(dict(env, MESHTRAIN=f"{sys.executable} {script}"), 4, 2, *RUN, "mesh.data=4", "mesh.model=2",
              "train.zero_stage=1", "train.steps=5", f"run.dir={d}")
    line = next(ln for ln in out.splitlines() if ln.startswith("[0] RESTORED"))
    _, _, step, sums = line.split(" ", 3)
    assert int(step) == 5 and json.loads(sums) == saved


def _child(launcher: subprocess.Popen, index: int) -> int:
    """Pid of the launcher's child that runs process `index`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher.pid and f"dist.process_id={index}".encode() in cmd:
            return int(stat.parent.name)
    raise AssertionError(f"process {index} not found under the launcher")


def test_dead_process_then_resume(env, ref_fsdp, tmp_path):
    d = tmp_path / "run"
    args = [*RUN, *FSDP, "checkpoint.every=3", f"run.dir={d}"]
    p = launch(env, 2, 4, *args, "train.steps=10000")
    deadline = time.time() + 240
    while not list_steps(d):  # a complete checkpoint exists: the run is well under way
        assert p.poll() is None and time.time() < deadline, p.communicate()[0][-3000:]
        time.sleep(0.5)
    os.kill(_child(p, 1), signal.SIGKILL)
    t0 = time.time()
    out, _ = p.communicate(timeout=90)
    waited = time.time() - t0
    assert p.returncode != 0 and waited < 60, (p.returncode, waited, out[-2000:])
    assert "launch_local: process 1 exited with status 137" in out

    last = list_steps(d)[-1]
    assert last + 2 <= REF_STEPS, f"the run got to checkpoint {last} before the kill; raise REF_STEPS"
    out = run(env, 2, 4, *args, f"train.steps={last + 2}")
    assert f"[0] resumed from {d / 'checkpoints' / str(last)}" in out
    got = losses(d)
    assert sorted(got)[-2:] == [last + 1, last + 2]
    assert rel([got[last + 1], got[last + 2]], ref_fsdp[last:last + 2]) < 1e-5


def test_peer_never_arrives(env):
    """One process of two: a one-line error and status 2 once dist.timeout_s has passed."""
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "trainer.cli", "train", *RUN, "dist.coordinator=127.0.0.1:"
                        f"{free_port()}", "dist.num_processes=2", "dist.process_id=1", "dist.timeout_s=3"],
                       cwd=ROOT, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and time.time() - t0 < 60
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("meshtrain: error:")]
    assert len(errors) == 1 and "process 1 of 2 waited dist.timeout_s=3s" in errors[0], p.stderr[-2000:]


@pytest.mark.parametrize("mesh,procs", [((8, 1, 1), 2), ((8, 1, 1), 4), ((4, 1, 2), 2), ((2, 2, 2), 4)])
def test_data_split(mesh, procs):
    """Rows per process from the batch sharding, with device i on process i // (8 / procs)."""
    data, stage, model = mesh
    cfg = load_config(TINY + [f"mesh.data={data}", f"mesh.stage={stage}", f"mesh.model={model}",
                              "train.microbatches=2"])
    sh, B, per = make_setup(cfg).batch_sharding(), cfg.train.batch_size, 8 // procs
    held = [set() for _ in range(procs)]  # the batch rows each process's devices hold
    for dev, idx in sh.devices_indices_map((B,)).items():
        held[dev.id // per].update(range(B)[idx[0]])
    parts = [Batches(corpus(), 0, B, 32, 256, *distributed.process_rows(sh, B, lambda dev: dev.id // per, p))
             for p in range(procs)]
    whole = Batches(corpus(), 0, B, 32, 256).global_train(7)
    for p, b in enumerate(parts):  # a process loads exactly the rows its devices hold
        assert set(range(B)[b.rows]) == held[p]
        np.testing.assert_array_equal(b.train(7), whole[b.rows])
    blocks = sorted({(b.rows.start, b.rows.stop) for b in parts})
    assert len(blocks) == min(data, procs)  # processes that share a data shard load the same rows
    assert blocks[0][0] == 0 and blocks[-1][1] == B and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    first = {(b.rows.start, b.rows.stop): b for b in reversed(parts)}
    np.testing.assert_array_equal(np.concatenate([first[r].train(7) for r in blocks]), whole)


def test_detect():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert distributed.detect(dict(slurm, SLURM_NTASKS="4")) == "slurm"
    assert distributed.detect(dict(slurm, SLURM_NTASKS="1")) is None
    assert distributed.detect({"TPU_WORKER_HOSTNAMES": "w-0,w-1"}) == "gketpu"
    assert distributed.detect({"TPU_WORKER_HOSTNAMES": "w-0"}) is None
    assert distributed.detect({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}) == "ompi"
    assert distributed.detect({}) is None


@pytest.mark.parametrize("args,needle", [
    (["dist.coordinator=127.0.0.1:1234"], "dist.num_processes is not set"),
    (["dist.coordinator=nohost", "dist.num_processes=2", "dist.process_id=0"], "is not HOST:PORT"),
    (["dist.coordinator=h:1", "dist.num_processes=2", "dist.process_id=2"], "dist.process_id=2 is not in"),
    (["dist.cluster=yarn"], "dist.cluster='yarn' is unknown"),
])
def test_bad_dist_keys(args, needle):
    with pytest.raises(UserError, match=needle):
        distributed.initialize(load_config(args).dist)


def test_dcn_needs_as_many_hosts():
    with pytest.raises(UserError, match="spans 2 hosts but the devices come from 1 processes"):
        make_setup(load_config(TINY + ["mesh.data=8", "mesh.dcn_data=2"]))
    with pytest.raises(UserError, match="mesh.dcn_data=3 does not divide mesh.data=8"):
        make_setup(load_config(TINY + ["mesh.data=8", "mesh.dcn_data=3"]))
