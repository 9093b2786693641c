"""meshtrain under a real SLURM: `munged`, `slurmctld` and `slurmd` started on localhost for this module (a generated
slurm.conf with one node of this host's cores and one partition; their own ports, munge key, socket and state, never
the system's), and the unedited scripts/slurm/train.sbatch submitted as users submit it. Its GPU request is cleared on
the command line (`--gpus-per-node=0`): the fixture declares no GPUs.

Without slurm-wlm and munge (apt-get install slurm-wlm munge) or without root (slurmd starts jobs as their user) the
tests skip and say why; with MESHTRAIN_REQUIRE_SLURM=1 (.ci/run sets it) they fail instead."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import SGD, TINY, run_steps
from test_checkpoint import logged_steps

from trainer.ckpt.params import load_params
from trainer.ckpt.store import list_steps

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo")
SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _unavailable(why: str):
    if os.environ.get("MESHTRAIN_REQUIRE_SLURM") == "1":
        pytest.fail(f"MESHTRAIN_REQUIRE_SLURM=1 but {why}")
    pytest.skip(why)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONF = """ClusterName=meshtrain-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=5
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A SLURM controller and node on localhost, up until the module ends; .env points clients at them."""
    missing = [t for t in DAEMONS + CLIENTS if shutil.which(t, path=SBIN) is None]
    if missing:
        _unavailable(f"SLURM is not installed ({', '.join(missing)} not found): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        _unavailable("slurmd must run as root to start jobs; run the tests as root")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir()
    (d / "munge").chmod(0o700)
    (d / "munge" / "key").write_bytes(os.urandom(1024))
    (d / "munge" / "key").chmod(0o400)
    host = socket.gethostname().split(".")[0]
    (d / "slurm.conf").write_text(CONF.format(host=host, d=d, ctld_port=_port(), slurmd_port=_port(),
                                              cpus=os.cpu_count()))
    env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"), PATH=SBIN)
    log = open(d / "daemons.log", "w")
    procs = [subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT) for cmd in (
        ["munged", "-F", "--force", f"--socket={d}/munge/sock", f"--key-file={d}/munge/key",
         f"--pid-file={d}/munge/pid", f"--seed-file={d}/munge/seed", f"--log-file={d}/munge/log"],
        ["slurmctld", "-D", "-f", str(d / "slurm.conf")],
        ["slurmd", "-D", "-f", str(d / "slurm.conf"), "-N", host])]
    try:
        t0 = time.time()
        while subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip() \
                != "idle":
            if time.time() - t0 > 30 or any(p.poll() is not None for p in procs):
                logs = "".join((d / f).read_text()[-1500:] for f in ("daemons.log", "slurmctld.log", "slurmd.log")
                               if (d / f).exists())
                pytest.fail(f"the SLURM node did not become idle in 30 s:\n{logs}")
            time.sleep(0.1)
        yield SimpleNamespace(env=env, dir=d)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def _ctl(s, *args) -> str:
    return subprocess.run(list(args), env=s.env, capture_output=True, text=True, check=True).stdout


def _job(s, jid: str) -> dict:
    """scontrol show job's KEY=VALUE fields."""
    return dict(f.split("=", 1) for f in _ctl(s, "scontrol", "show", "job", jid).split() if "=" in f)


def _wait(s, jid: str, states, timeout=240) -> dict:
    t0 = time.time()
    while (job := _job(s, jid))["JobState"] not in states:
        assert time.time() - t0 < timeout, f"job {jid} still {job['JobState']} after {timeout} s"
        time.sleep(0.05)
    return job


def _submit(s, folder: Path, run_dir: Path, *keys) -> str:
    """sbatch of the shipped script from `folder`, one node x 2 tasks x 4 CPU devices, as a user would."""
    env = dict(s.env, RUN_DIR=str(run_dir), JAX_PLATFORMS="cpu",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), s.env["PATH"]]),  # `meshtrain` of this venv
               XLA_FLAGS=os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=4"))
    out = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                          "--gpus-per-node=0", str(SBATCH), *keys], cwd=folder, env=env, capture_output=True,
                         text=True, check=True).stdout
    return out.strip().split(";")[0]


STEPS = 40
KEYS = TINY + SGD + [f"train.steps={STEPS}", "train.eval_every=0", "run.log_every=1", "data.source=synthetic",
                     "mesh.data=8", "checkpoint.every=0"]


def test_sbatch_preempted_by_scancel_requeued_resumes_to_the_uninterrupted_result(slurm, tmp_path):
    """One job: 2 tasks x 4 devices, `scancel --signal=TERM` mid-run (a checkpoint at the step every process stopped
    at, the job COMPLETED with exit 0), `scontrol requeue`, run to the end: each step logged once, JobState=COMPLETED
    with Restarts=1, the final parameters those of 1 process x 8 devices run straight; the user's dist.timeout_s wins
    over the script's."""
    run = tmp_path / "run"
    jid = _submit(slurm, tmp_path, run, *KEYS, "dist.timeout_s=300")
    t0 = time.time()
    while len(logged_steps(run)) < 2:
        assert _job(slurm, jid)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), \
            (tmp_path / f"meshtrain-{jid}.out").read_text()[-3000:]
        assert time.time() - t0 < 240, "no step logged in 240 s"
        time.sleep(0.01)
    _ctl(slurm, "scancel", "--signal=TERM", jid)
    job = _wait(slurm, jid, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"))
    first = (tmp_path / f"meshtrain-{jid}.out").read_text()
    stop = list_steps(run)[-1]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", first[-3000:]
    assert 2 <= stop < STEPS and logged_steps(run) == list(range(1, stop + 1)), (stop, logged_steps(run))
    assert f"stopped after step {stop}; checkpoint saved" in first, first[-3000:]
    # slurmd revokes a cancelled job's credential with a time in whole seconds and refuses a launch whose credential
    # is not newer ("Job credential revoked"): a requeue within the same second as the end fails the job
    time.sleep(1.5)
    _ctl(slurm, "scontrol", "requeue", jid)
    _ctl(slurm, "scontrol", "update", f"JobId={jid}", "StartTime=now")  # a requeued job waits 2 minutes otherwise
    job = _wait(slurm, jid, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"))
    second = (tmp_path / f"meshtrain-{jid}.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", second[-3000:]
    assert f"resumed from {run}/checkpoints/{stop} " in second, second[-3000:]
    assert logged_steps(run) == list(range(1, STEPS + 1)) and list_steps(run)[-1] == STEPS
    assert "timeout_s: 300" in (run / "config.yaml").read_text()
    got = jax.tree.map(np.asarray, load_params(str(run))[0])
    ref = run_steps(KEYS, 8, STEPS, "synthetic").params
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    print(f"job {jid}: stopped at step {stop}, resumed, {STEPS} steps; largest parameter difference from 1 x 8: "
          f"{worst:.3g}")
    assert worst <= 1e-6


def test_a_task_killed_ends_the_job_failed(slurm, tmp_path):
    """kill -9 of task 1's process: srun's --kill-on-bad-exit ends the whole job within 30 s, FAILED, its output
    naming the lost task; not a hang in a collective."""
    run = tmp_path / "run"
    jid = _submit(slurm, tmp_path, run, *KEYS[:-2], "train.steps=100000", "mesh.data=8")
    t0 = time.time()
    while not logged_steps(run):
        assert _job(slurm, jid)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING")
        assert time.time() - t0 < 240, "no step logged in 240 s"
        time.sleep(0.05)
    pid = next(int(p.parent.name) for p in Path("/proc").glob("[0-9]*/environ") if _task_of(p, jid) == "1")
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    job = _wait(slurm, jid, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout=60)
    ended = time.time() - t0
    out = (tmp_path / f"meshtrain-{jid}.out").read_text()
    print(f"job {jid}: task 1 killed, job {job['JobState']} after {ended:.1f} s")
    assert job["JobState"] == "FAILED" and ended < 30, (job["JobState"], ended, out[-3000:])
    assert "task 1: Killed" in out, out[-3000:]


def _task_of(environ: Path, jid: str) -> str | None:
    """SLURM_PROCID of a process of job `jid` running meshtrain, else None."""
    try:
        env = dict(kv.split("=", 1) for kv in environ.read_bytes().decode(errors="replace").split("\0") if "=" in kv)
        cmd = (environ.parent / "cmdline").read_bytes()
    except OSError:
        return None
    return env.get("SLURM_PROCID") if env.get("SLURM_JOB_ID") == jid and b"meshtrain" in cmd else None


def test_launcher_defaults_are_below_every_layer(tmp_path, monkeypatch, capsys):
    """MESHTRAIN_DEFAULTS (what the sbatch script sets) loses to a YAML file and to key=value; a word that is not
    key=value is one line."""
    from trainer.cli import launcher_defaults, main
    from trainer.config import load_config
    monkeypatch.setenv("MESHTRAIN_DEFAULTS", "run.dir='/runs/a b' run.progress=false dist.timeout_s=600")
    (tmp_path / "mine.yaml").write_text("run:\n  dir: /runs/mine\n")
    base = launcher_defaults()
    assert load_config([], base=base).run.dir == "/runs/a b"
    assert load_config([str(tmp_path / "mine.yaml")], base=base).run.dir == "/runs/mine"
    cfg = load_config([str(tmp_path / "mine.yaml"), "run.dir=/runs/cli", "dist.timeout_s=5"], base=base)
    assert (cfg.run.dir, cfg.dist.timeout_s, cfg.run.progress) == ("/runs/cli", 5, False)
    monkeypatch.setenv("MESHTRAIN_DEFAULTS", "run.dir=/x progress")
    assert main(["train"]) == 2
    assert capsys.readouterr().err.strip() == ("meshtrain: error: MESHTRAIN_DEFAULTS holds 'progress', not key=value; "
                                               "write key=value pairs, e.g. MESHTRAIN_DEFAULTS='run.dir=runs/x "
                                               "run.progress=false'")
