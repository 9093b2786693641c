"""Multi-process training on localhost (jax.distributed, gloo) against one process holding all 8 devices.

Runs go through scripts/launch_local.sh as real processes. Compiling dominates the time, so one
ZeRO-3 run serves three tests: it is killed mid-run, relaunched to the end (dead process, resume),
compared with the single-process run (same losses), and its last checkpoint restored elsewhere.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import SGD, TINY, corpus, run_steps

from trainer.run import distributed
from trainer.ckpt.checkpoint import Checkpointer
from trainer.ckpt.store import checksums, list_steps, read_meta
from trainer.config import load_config
from trainer.data.batches import Batches
from trainer.errors import UserError
from trainer.state import make_setup

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch_local.sh"
STEPS = 12
# SGD without clipping: a gradient scale wrong across processes shows in losses and grad norms
RUN = TINY + SGD + [f"train.steps={STEPS}", "train.eval_every=0", "run.log_every=1", "data.source=synthetic"]
FSDP = ["mesh.data=8", "mesh.stage=1", "mesh.model=1", "train.zero_stage=3"]
HYBRID = ["mesh.preset=cpu-8-2x2x2", "mesh.dcn_stage=2"]  # stage across the 2 processes, model inside one

# Restores a run's newest checkpoint onto the mesh its arguments give; prints the parameters' checksums.
RESTORE = """
import json, sys
from trainer.config import load_config
from trainer.run.distributed import initialize
cfg = load_config(sys.argv[2:])
initialize(cfg.dist)
import jax
from trainer.ckpt.checkpoint import Checkpointer
from trainer.ckpt.store import checksums
from trainer.state import make_setup
s = make_setup(cfg)
ckpt = Checkpointer(s, cfg.run.dir)
state, step = ckpt.restore() or sys.exit("no checkpoint")
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
def env():
    # No persistent compilation cache: its entries are keyed per process and only process 0 writes
    # them, so process 0 would start at once while the others compile, past gloo's 30 s setup deadline.
    return dict(os.environ, PYTHONPATH=str(ROOT), MESHTRAIN=f"{sys.executable} -m trainer.cli", GRACE_S="3")


def launch(env, procs, devices, *args):
    """Start launch_local.sh; stdout and stderr together, as text."""
    return subprocess.Popen([str(LAUNCH), str(procs), str(devices), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def run(env, procs, devices, *args, timeout=300) -> str:
    p = launch(env, procs, devices, *args)
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-3000:]
    return out


def losses(run_dir, key="loss") -> dict[int, float]:
    """step -> `key` (loss or grad_norm) from a run's metrics.jsonl."""
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in recs if key in r}


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b) / np.abs(b)))


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


@pytest.fixture(scope="module")
def ref_fsdp():
    """Losses and grad norms of 1 process x 8 devices, (8,1,1) ZeRO-3."""
    r = run_steps(RUN + FSDP, steps=STEPS, source="synthetic")
    return r.losses, r.grad_norms


@pytest.fixture(scope="module")
def fsdp_run(env, tmp_path_factory):
    """2 processes x 4 devices, (8,1,1) ZeRO-3, saving every step; process 1 is killed (-9) after the first
    save, then the same command runs again, resumes and finishes (one run, to keep the file fast)."""
    d = tmp_path_factory.mktemp("fsdp") / "run"
    p = launch(env, 2, 4, *RUN, *FSDP, "checkpoint.every=1", f"run.dir={d}")
    deadline = time.time() + 240
    while not list_steps(d):
        assert p.poll() is None and time.time() < deadline, p.communicate()[0][-3000:]
        time.sleep(0.2)
    os.kill(_child(p, 1), signal.SIGKILL)
    t0 = time.time()
    killed_log, _ = p.communicate(timeout=120)
    waited = time.time() - t0
    before, last = losses(d), list_steps(d)[-1]  # the relaunch drops the records past `last`
    log = run(env, 2, 4, *RUN, *FSDP, f"run.dir={d}")
    print(f"kill -9 of process 1: launcher exited with {p.returncode} after {waited:.1f}s; resumed from step {last}")
    return SimpleNamespace(dir=d, rc=p.returncode, waited=waited, killed_log=killed_log, before=before,
                           last=last, log=log)


def test_same_losses_zero3(fsdp_run, ref_fsdp):
    for key, ref in zip(("loss", "grad_norm"), ref_fsdp):
        got = losses(fsdp_run.dir, key)
        assert sorted(got) == list(range(1, STEPS + 1))
        assert rel([got[i] for i in range(1, 6)], ref[:5]) < 1e-5, key
        print(f"ZeRO-3 2x4 vs 1x8: max relative {key} difference {rel([got[i] for i in range(1, STEPS + 1)], ref):.2e}")
        assert rel([got[i] for i in range(1, STEPS + 1)], ref) < 1e-5, key
    # process 0 alone writes metrics and TensorBoard: one record per step, one event file per launch
    lines = (fsdp_run.dir / "metrics.jsonl").read_text().splitlines()
    assert len([ln for ln in lines if '"loss"' in ln]) == STEPS
    assert len(list((fsdp_run.dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    # each process fed its own half of the batch to its own 4 devices
    assert "[0] process 0 of 2 | 4 devices at data 0-3 stage 0 expert 0 context 0 model 0 | batch rows 0:8 of 16" in fsdp_run.log
    assert "[1] process 1 of 2 | 4 devices at data 4-7 stage 0 expert 0 context 0 model 0 | batch rows 8:16 of 16" in fsdp_run.log


def test_dead_process_then_resume(fsdp_run):
    r = fsdp_run
    assert r.rc != 0 and r.waited < 60, (r.rc, r.waited, r.killed_log[-2000:])
    assert "launch_local: process 1 exited with status 137; stopping the other processes" in r.killed_log
    assert r.last < STEPS, "the run ended before the kill"
    assert f"[0] resumed from {r.dir / 'checkpoints' / str(r.last)}" in r.log
    got = losses(r.dir)
    assert [got[i] for i in range(1, r.last + 1)] == [r.before[i] for i in range(1, r.last + 1)]
    # steps the killed run logged past its last checkpoint come out the same, bit for bit, after the resume
    redone = [i for i in r.before if i > r.last]
    assert [got[i] for i in redone] == [r.before[i] for i in redone]


@pytest.mark.slow  # the default run keeps the 2-process ZeRO-3 comparison (test_same_losses_zero3)
def test_same_losses_2x2x2_hybrid(env, tmp_path):
    ref = run_steps(RUN + HYBRID[:1] + ["train.steps=5"], steps=5, source="synthetic")
    d = tmp_path / "run"
    log = run(env, 2, 4, *RUN, *HYBRID, "train.steps=5", f"run.dir={d}")
    for key, want in (("loss", ref.losses), ("grad_norm", ref.grad_norms)):
        got = losses(d, key)
        print(f"(2,2,2) dcn_stage=2 2x4 vs 1x8: max relative {key} difference {rel([got[i] for i in range(1, 6)], want):.2e}")
        assert rel([got[i] for i in range(1, 6)], want) < 1e-5, key
    # mesh.dcn_stage=2: stage i lives on process i; data and model stay inside a process, so both need all rows
    for i in range(2):
        assert f"[{i}] process {i} of 2 | 4 devices at data 0-1 stage {i} expert 0 context 0 model 0-1 | batch rows 0:16 of 16" in log


def same_five_steps(ref, d, label: str):
    """The run in `d` logged ref's losses and grad norms over steps 1-5 (1e-5)."""
    for key, want in (("loss", ref.losses), ("grad_norm", ref.grad_norms)):
        got = losses(d, key)
        print(f"{label}: max relative {key} difference {rel([got[i] for i in range(1, 6)], want):.2e}")
        assert rel([got[i] for i in range(1, 6)], want) < 1e-5, key


@pytest.mark.slow
def test_same_losses_context_across_processes(env, tmp_path):
    """(data 2, context 4) with mesh.dcn_context=2: each row's tokens split over both processes (each loads every
    row and passes half of its tokens), ZeRO-3 over data x context: 2 processes x 4 devices equal 1 x 8."""
    CP = ["mesh.data=2", "mesh.context=4", "train.zero_stage=3", "model.seq_len=32"]
    ref = run_steps(RUN + CP + ["train.steps=5"], steps=5, source="synthetic")
    d = tmp_path / "run"
    log = run(env, 2, 4, *RUN, *CP, "mesh.dcn_context=2", "train.steps=5", f"run.dir={d}")
    same_five_steps(ref, d, "(2,1,4,1) dcn_context=2 2x4 vs 1x8")
    for i in range(2):
        assert f"[{i}] process {i} of 2 | 4 devices at data 0-1 stage 0 expert 0 context {2 * i}-{2 * i + 1} model 0 | batch " \
               "rows 0:16 of 16" in log


@pytest.mark.slow
def test_same_losses_experts_inside_each_process(env, tmp_path):
    """An MoE with its expert degree inside each process (mesh.expert=4 x data 2, mesh.dcn_data=2: each process
    holds all 8 experts over its 4 devices, tokens sent to them by all-to-all that never leaves the process), ZeRO-3,
    the router at its initial scale: 2 processes x 4 devices equal one device's losses and grad norms (1e-5)."""
    moe = ["model.family=mixtral", "model.n_experts=8", "model.expert_d_ff=32", "model.router_z_loss=0"]
    ep = ["mesh.data=2", "mesh.expert=4", "train.zero_stage=3"]
    ref = run_steps(RUN + moe + ["mesh.data=1", "train.steps=5"], steps=5, source="synthetic")
    d = tmp_path / "run"
    log = run(env, 2, 4, *RUN, *moe, *ep, "mesh.dcn_data=2", "train.steps=5", f"run.dir={d}")
    same_five_steps(ref, d, "expert 4 x data 2 over 2 processes vs one device")
    for i in range(2):
        assert f"[{i}] process {i} of 2 | 4 devices at data {i} stage 0 expert 0-3 context 0 model 0 | batch rows " \
               f"{8 * i}:{8 * i + 8} of 16" in log, log[-3000:]
    assert "experts 8 over expert=4 (2 per expert rank)" in log


@pytest.mark.slow
def test_same_losses_sequence_parallel_inside_each_process(env, tmp_path):
    """train.sequence_parallel with `model` inside each process (data 2 over the 2 processes, model 4 in each),
    ZeRO-3: the split residual's reduce-scatters and gathers stay in a process, the gradients' across: 2 processes x
    4 devices equal one device's losses and grad norms (1e-5)."""
    ref = run_steps(RUN + ["mesh.data=1", "train.steps=5"], steps=5, source="synthetic")
    d = tmp_path / "run"
    log = run(env, 2, 4, *RUN, "mesh.data=2", "mesh.model=4", "mesh.dcn_data=2", "train.zero_stage=3",
              "train.sequence_parallel=true", "train.steps=5", f"run.dir={d}")
    same_five_steps(ref, d, "sequence parallel, model 4 inside each of 2 processes vs one device")
    for i in range(2):
        assert f"[{i}] process {i} of 2 | 4 devices at data {i} stage 0 expert 0 context 0 model 0-3 | batch rows " \
               f"{8 * i}:{8 * i + 8} of 16" in log, log[-3000:]

def test_checkpoint_across_process_counts(env, fsdp_run, tmp_path):
    d = fsdp_run.dir
    meta = read_meta(d, STEPS)
    saved = {k.removeprefix("params."): v["checksum"] for k, v in meta["leaves"].items() if k.startswith("params.")}
    # 1 process x 8 devices, onto (2,1,4) ZeRO-0
    cfg = load_config(RUN + ["mesh.data=2", "mesh.model=4", f"run.dir={d}"])
    s = make_setup(cfg)
    ckpt = Checkpointer(s, d)
    state, step = ckpt.restore()
    ckpt.close()
    assert meta["processes"] == 2 and step == STEPS and checksums(state["params"]) == saved
    assert str(state["params"]["embed"].sharding.spec) != meta["leaves"]["params.embed"]["spec"]
    # 4 processes x 2 devices, onto (4,1,2) ZeRO-1
    script = tmp_path / "restore.py"
    script.write_text(RESTORE)
    out = run(dict(env, MESHTRAIN=f"{sys.executable} {script}"), 4, 2, *RUN, "mesh.data=4", "mesh.model=2",
              "train.zero_stage=1", f"run.dir={d}")
    line = next(ln for ln in out.splitlines() if ln.startswith("[0] RESTORED"))
    _, _, step, sums = line.split(" ", 3)
    assert int(step) == STEPS and json.loads(sums) == saved


FAKE = """#!/usr/bin/env bash
i=${@: -1}; i=${i#dist.process_id=}
echo "args $*"
trap 'echo "TERM $i"; [[ -n ${FAIL:-} && $i == 2 ]] || exit ${TERM_RC:-0}' TERM  # with FAIL, process 2 ignores it
if [[ $i == 1 && -n ${FAIL:-} ]]; then sleep 1; exit 3; fi
for _ in $(seq 300); do sleep 0.1; done
"""


@pytest.mark.parametrize("fail,term_rc", [(True, 0), (False, 0), (False, 75)])
def test_launcher(tmp_path, fail, term_rc):
    """With stand-in processes: prefixes and arguments; a failure stops the others (SIGKILL for one that
    ignores SIGTERM, GRACE_S later) and sets the exit status; SIGTERM to the launcher reaches every process;
    processes that stop early after saving (status 75) are not a failure and the launcher exits 75."""
    fake = tmp_path / "fake.sh"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = dict(os.environ, MESHTRAIN=str(fake), GRACE_S="2", PORT="4321", TERM_RC=str(term_rc),
               **({"FAIL": "1"} if fail else {}))
    t0 = time.time()
    p = launch(env, 3, 2, "train", "a=1")
    if not fail:
        time.sleep(2)
        p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert time.time() - t0 < 20  # the processes would run 30 s on their own
    for i in range(3):
        assert f"[{i}] args train a=1 dist.coordinator=127.0.0.1:4321 dist.num_processes=3 dist.process_id={i}" in out
    assert "[0] TERM 0" in out and "[2] TERM 2" in out
    if fail:
        assert p.returncode == 3 and "launch_local: process 1 exited with status 3" in out
    else:
        assert p.returncode == term_rc and "[1] TERM 1" in out and "stopping the other" not in out, out
        assert ("run the same command to resume" in out) == (term_rc == 75), out


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
        for f, x in b.train(7).items():
            np.testing.assert_array_equal(x, whole[f][b.rows])
    blocks = sorted({(b.rows.start, b.rows.stop) for b in parts})
    assert len(blocks) == min(data, procs)  # processes that share a data shard load the same rows
    assert blocks[0][0] == 0 and blocks[-1][1] == B and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    first = {(b.rows.start, b.rows.stop): b for b in reversed(parts)}
    for f in whole:
        np.testing.assert_array_equal(np.concatenate([first[r].train(7)[f] for r in blocks]), whole[f])


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
    (["dist.timeout_s=0"], r"dist.timeout_s=0 must be > 0 and <= 2\*\*30: seconds"),
    # this test process has used its devices already
    (["dist.coordinator=127.0.0.1:1", "dist.num_processes=2", "dist.process_id=0"], "already using devices"),
])
def test_bad_dist_keys(args, needle):
    with pytest.raises(UserError, match=needle):
        distributed.initialize(load_config(args).dist)


def test_single_process_needs_no_join():
    for args in ([], ["dist.cluster=none"], ["dist.coordinator=h:1", "dist.num_processes=1", "dist.process_id=0"]):
        assert distributed.initialize(load_config(args).dist) is False
    assert jax.process_count() == 1


def test_dcn_needs_as_many_hosts():
    with pytest.raises(UserError, match="^the hosts split dcn_data=2 dcn_stage=1 dcn_expert=1 dcn_context=1 dcn_model=1 spans 2 "
                       "hosts but the devices come from 1 processes"):
        make_setup(load_config(TINY + ["mesh.data=8", "mesh.dcn_data=2"]))
    with pytest.raises(UserError, match="mesh.dcn_data=3 does not divide mesh.data=8"):
        make_setup(load_config(TINY + ["mesh.data=8", "mesh.dcn_data=3"]))


@pytest.mark.slow
def test_deepseek_loads_are_the_global_batchs(env, tmp_path):
    """DeepSeek-V3's router bias moves by the loads of the whole step batch: (8,1,1) ZeRO-3 with the experts split
    over data, 2 processes x 4 devices, logs 1 x 8's losses, grad norms (1e-5) and every MoE layer's max/mean load
    (moe/imbalance/<layer>, each step's, from the loads the bias moves by: exactly, counts of whole choices) over 5
    steps at bias rate 1e-2; the bias's own steps follow from those loads (tests/test_deepseek_train.py)."""
    from test_deepseek_train import DS
    ds = [o for o in DS if not o.startswith("train.batch_size")] + ["model.bias_rate=0.01", "train.expert_parallel=true"]
    ref = run_steps(RUN + ds + FSDP + ["train.steps=5"], steps=5, source="synthetic")
    d = tmp_path / "run"
    run(env, 2, 4, *RUN, *ds, *FSDP, "train.steps=5", f"run.dir={d}")
    same_five_steps(ref, d, "deepseek (8,1,1) ZeRO-3 expert parallel over 2 processes vs 1 x 8")
    recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    got = {r["step"]: [r[f"moe/imbalance/{i}"] for i in (1, 2, 3)] for r in recs if "moe/imbalance/1" in r}
    assert sorted(got) == [1, 2, 3, 4, 5]
    one = make_setup(load_config(RUN + ds + FSDP + ["train.steps=5"]))
    from trainer.step import jit_train_step
    from conftest import corpus, fresh_state
    state, step = fresh_state(one), jit_train_step(one)
    b = Batches(corpus("synthetic"), one.cfg.train.seed, one.cfg.train.batch_size, one.model.seq_len,
                one.model.vocab_size)
    with jax.set_mesh(one.mesh):
        for i in range(5):
            state, m = step(state, jax.device_put(b.global_train(i), one.batch_sharding()))
            np.testing.assert_allclose(got[i + 1], [float(m[f"moe/imbalance/{j}"]) for j in (1, 2, 3)], rtol=1e-6)
