"""meshtrain under a real SLURM: `munged`, `slurmctld` and `slurmd` started on localhost for this module (a generated
slurm.conf with one node of this host's cores and one partition; their own ports, munge key, socket and state, never
the system's), and the unedited scripts/slurm/train.sbatch submitted as users submit it. Its GPU request is cleared on
the command line (`--gpus-per-node=0`): the fixture declares no GPUs.

Without slurm-wlm and munge (apt-get install slurm-wlm munge) or without root (slurmd starts jobs as their user) the
tests skip and say why; with MESHTRAIN_REQUIRE_SLURM=1 (.ci/run sets it) they fail instead."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
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


def _submit(s, folder: Path, run_dir: Path, *args, env=None) -> str:
    """sbatch of the shipped script from `folder`, one node x 2 tasks x 4 CPU devices, as a user would; `args`
    may start with sbatch's own options, and the tests' plug-ins (tests/plugins) are importable."""
    env = dict(s.env, RUN_DIR=str(run_dir), JAX_PLATFORMS="cpu", **(env or {}),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), s.env["PATH"]]),  # `meshtrain` of this venv
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "plugins"), os.environ.get("PYTHONPATH", "")]),
               XLA_FLAGS=os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=4"))
    opts = [a for a in args if a.startswith("--")]
    keys = [a for a in args if not a.startswith("--")]
    out = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                          "--gpus-per-node=0", *opts, str(SBATCH), *keys], cwd=folder, env=env, capture_output=True,
                         text=True, check=True).stdout
    return out.strip().split(";")[0]


STEPS = 40
KEYS = TINY + SGD + [f"train.steps={STEPS}", "train.eval_every=0", "run.log_every=1", "data.source=synthetic",
                     "mesh.data=8", "checkpoint.every=0"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
# the time-limit job: --time in whole minutes, and SLURM sends --signal's SIGTERM up to 60 s before its lead time,
# so 2 minutes with a 20 s lead signal each run 40 to 100 s after it starts. PACE_S per step (tests/plugins/pace.py)
# makes the 40 steps last about 100 s whatever the host's load: two or three runs of the job, each stopped and
# requeued by the script, the last one finishing. run.log_every stays at its default (10).
LIMIT_STEPS, PACE_S = 40, "2.4"
LIMIT_KEYS = TINY + SGD + [f"train.steps={LIMIT_STEPS}", "train.eval_every=0", "data.source=synthetic", "mesh.data=8",
                           "checkpoint.every=0", "run.plugins=[pace:Pace]"]


def _caught(text: str) -> list[float]:
    """When jax's preemption notifier caught SIGTERM (its log line; unix time), in each task of the run."""
    return [datetime.fromisoformat(m[:26]).replace(tzinfo=timezone.utc).timestamp()
            for m in re.findall(r"SIGTERM caught at (\S+)", text)]


def _paced(text: str) -> dict[int, float]:
    return {int(a): float(b) for a, b in re.findall(r"^pace: step (\d+) at (\S+)$", text, re.M)}


def _runs_of(s, jid: str, out: Path, timeout=600) -> tuple[dict, list[str]]:
    """Follow a job that requeues itself to its end: its final scontrol fields and each run's output (SLURM
    truncates the output file when a run starts). A requeued job waits 2 minutes (its BeginTime): once it has
    waited a second and a half (slurmd refuses a launch in the second its credential was revoked) it is let go."""
    t0, texts, restarts = time.time(), [], 0

    def text():  # the run's own lines, whether SLURM truncated the file or appended to it
        whole, before = out.read_text(), "".join(texts)
        return whole[len(before):] if whole.startswith(before) else whole
    while (job := _job(s, jid))["JobState"] not in ENDED:
        assert time.time() - t0 < timeout, f"job {jid} not done after {timeout} s: {job['JobState']}"
        if int(job.get("Restarts", 0)) > restarts:
            restarts = int(job["Restarts"])
            texts.append(text())
            time.sleep(1.5)
            _ctl(s, "scontrol", "update", f"JobId={jid}", "StartTime=now")
        time.sleep(0.2)
    return job, texts + [text()]


@pytest.mark.slow  # minutes: two or three runs of a job, each waiting for its time limit's signal
def test_sbatch_at_its_time_limit_saves_requeues_itself_and_finishes_as_one_run(slurm, tmp_path):
    """The shipped script with a 2-minute --time and --signal=TERM@20: each run of the job gets SIGTERM before its
    limit, every task stops within a few steps of it (not at the next logging step), saves and exits 75, and the
    script requeues the job; the last run reaches train.steps and the job ends COMPLETED, never TIMEOUT. The steps
    logged once each, the final parameters those of 1 process x 8 devices run straight."""
    run = tmp_path / "run"
    jid = _submit(slurm, tmp_path, run, "--time=2", "--signal=TERM@20", *LIMIT_KEYS, env={"PACE_S": PACE_S})
    job, texts = _runs_of(slurm, jid, tmp_path / f"meshtrain-{jid}.out")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and int(job["Restarts"]) >= 1, texts[-1][-3000:]
    assert len(texts) == int(job["Restarts"]) + 1
    stops = []
    for text in texts[:-1]:  # every run but the last: stopped at its time limit's signal, saved, requeued
        stop = int(re.search(r"stopped after step (\d+); checkpoint saved", text)[1])
        caught, paced = _caught(text), _paced(text)
        at = max([k for k, t in paced.items() if t <= min(caught)], default=min(paced) - 1)
        print(f"job {jid}: SIGTERM during step {at + 1}, stopped after step {stop}")
        assert len(caught) == 2 and stop - at <= 3, (caught, at, stop, text[-3000:])
        assert f"requeueing job {jid}" in text, text[-3000:]
        stops.append(stop)
    assert stops == sorted(set(stops)) and stops[-1] < LIMIT_STEPS and list_steps(run)[-1] == LIMIT_STEPS
    assert f"resumed from {run}/checkpoints/{stops[-1]} " in texts[-1], texts[-1][-3000:]
    logged = logged_steps(run)
    assert logged == sorted(set(logged)) and logged[-1] == LIMIT_STEPS, logged
    assert not any(k in texts[-1] for k in ("requeueing", "stopped after step"))
    got = jax.tree.map(np.asarray, load_params(str(run))[0])
    ref = run_steps(LIMIT_KEYS[:-1], 8, LIMIT_STEPS, "synthetic").params
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    print(f"job {jid}: stopped after steps {stops}, requeued {job['Restarts']} times, {LIMIT_STEPS} steps; largest "
          f"parameter difference from 1 x 8: {worst:.3g}")
    assert worst <= 7.5e-9


@pytest.mark.slow  # a real SLURM job of 2 processes
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


FAKE = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$CALLS"; [[ $0 == *scontrol ]] || exit "$SRUN_STATUS"
"""


@pytest.mark.parametrize("status,restarts,requeued", [(0, "", False), (1, "", False), (137, "2", False),
                                                      (75, "", True), (75, "2", True), (75, "3", False)])
def test_sbatch_requeues_only_a_run_that_stopped_early_and_at_most_max_requeues_times(tmp_path, status, restarts,
                                                                                        requeued):
    """The script's decision, with stand-ins for srun and scontrol: a run that finished (0) or failed (1, 137) ends
    the job with its status; one that stopped early (75) requeues the job unless SLURM_RESTART_COUNT has reached
    MAX_REQUEUES (3 here): then the job ends with 75 and one line saying how to resume."""
    for name in ("srun", "scontrol"):
        (tmp_path / name).write_text(FAKE)
        (tmp_path / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", CALLS=str(calls),
               SRUN_STATUS=str(status), SLURM_JOB_ID="42", SLURM_JOB_NAME="meshtrain", MAX_REQUEUES="3",
               RUN_DIR=str(tmp_path / "run"))
    if restarts:
        env["SLURM_RESTART_COUNT"] = restarts
    p = subprocess.run(["bash", str(SBATCH), "model.preset=tiny"], env=env, capture_output=True, text=True)
    lines = calls.read_text().splitlines()
    assert lines[0] == "srun --kill-on-bad-exit=1 --cpu-bind=none meshtrain train model.preset=tiny"
    assert lines[1:] == (["scontrol requeue 42"] if requeued else []), (lines, p.stdout, p.stderr)
    assert p.returncode == (0 if requeued else status), p.stderr
    if status == 75 and not requeued:
        assert p.stderr.strip().endswith("requeued 3 times already (MAX_REQUEUES=3); not requeueing: submit it "
                                         "again to resume"), p.stderr


OWNER = """
import os, signal, sys, time
import jax
jax.distributed.initialize("127.0.0.1:{port}", 1, 0)
from trainer.ckpt.preempt import StopRequest
with StopRequest() as request:
    for step in range(1, 1000):
        if step == 3:
            os.kill(os.getpid(), signal.{sig})
        if request.agreed(can_sync=False):  # every step, no sync point: jax's protocol alone
            print("stopped after step", step, "sent at 3", flush=True)
            break
        time.sleep(0.01)
"""


def test_jax_owns_sigterm_once_jax_distributed_has_joined():
    """A process joined by jax.distributed (one process, a real client and preemption notifier): SIGTERM reaches
    jax's notifier, not a Python handler (jax logs catching it), and its sync point, asked after every step, stops
    the loop a second or so later; Ctrl-C is Python's and is passed on to jax's notifier the same way."""
    ps = {sig: subprocess.Popen([sys.executable, "-c", OWNER.format(port=_port(), sig=sig)], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
          for sig in ("SIGTERM", "SIGINT")}  # both at once: most of each is importing jax
    for sig, p in ps.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "stopped after step" in out, (sig, out + err[-3000:])
        assert "SIGTERM caught at" in err, (sig, err[-3000:])  # jax's notifier: its handler took the signal
        assert ("SIGINT received" in err) == (sig == "SIGINT"), (sig, err[-3000:])
