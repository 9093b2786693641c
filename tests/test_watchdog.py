"""Crashes, not hangs: a step that does not finish ends the process (train.step_timeout_s)."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY

from trainer.ckpt import store as ckpt
from trainer.ckpt.params import load_params
from trainer.run.watchdog import EXIT_CODE, FACTOR, StepWatchdog

ROOT = Path(__file__).resolve().parents[1]
RUN = TINY + ["train.steps=1000", "train.eval_every=0", "run.log_every=1", "data.source=synthetic"]
ERROR = re.compile(r"meshtrain: error: step (\d+) did not finish after (\d+)s \(limit (\d+)s = "
                   r"max\(train\.step_timeout_s=([\d.]+), ")


class _Steps:
    """Jitted 'steps' whose outputs are ready after the host callback returns: sleep s, or block until released."""

    def __init__(self):
        self.release = threading.Event()
        self.f = jax.jit(lambda x, s: x + jax.pure_callback(self._wait, jax.ShapeDtypeStruct((), jnp.float32), s))
        self.x = jax.device_put(jnp.zeros((), jnp.float32), jax.devices()[0])
        self(0).block_until_ready()  # compiled now: on a busy host the compile alone can outlast a watched step

    def _wait(self, s):
        if s < 0:
            self.release.wait()
        else:
            time.sleep(float(s))
        return np.float32(0)

    def __call__(self, seconds):
        return self.f(self.x, np.float32(seconds))


def test_watchdog_fires_on_a_step_that_does_not_finish_after_the_scaled_limit(caplog):
    steps, fired = _Steps(), []
    exited = threading.Event()

    def exit(code):
        fired.append((code, time.monotonic()))
        exited.set()
        steps.release.set()
        threading.Event().wait()  # os._exit does not return: keep the monitor thread here

    wd = StepWatchdog(0.3, poll_s=0.05, exit=exit)
    try:
        for i in range(5):  # 0.1 s steps: the limit becomes FACTOR x 0.1 s = 2 s, above the 0.3 s floor
            wd.begin(i + 1)
            out = steps(0.1)
            wd.watch(i + 1, out)
            out.block_until_ready()
        deadline = time.monotonic() + 10
        while wd.limit() < 0.1 * FACTOR and time.monotonic() < deadline:  # the waiter thread records it
            time.sleep(0.01)
        assert not fired
        assert 0.1 * FACTOR <= wd.limit() < 0.2 * FACTOR, wd.limit()
        t0 = time.monotonic()
        wd.begin(6)
        wd.watch(6, steps(-1))  # never finishes until released (the call may block: CPU runs it in dispatch)
        assert exited.wait(30)
        code, when = fired[0]
        assert code == EXIT_CODE and 0.1 * FACTOR <= when - t0 < 0.2 * FACTOR + 1, when - t0
        said = [r for r in caplog.records if r.name == "trainer.run.watchdog"]  # logged before the exit
        assert len(said) == 1 and said[0].levelname == "ERROR" and said[0].getMessage().startswith(
            "step 6 did not finish after "), [r.getMessage() for r in said]
    finally:
        wd.close()
        steps.release.set()


def test_watchdog_off_and_quiet_when_steps_finish():
    steps, fired = _Steps(), []
    wd = StepWatchdog(0.5, poll_s=0.05, exit=fired.append)
    for i in range(4):  # steps of 0.2 s, each under the floor
        wd.begin(i + 1)
        wd.watch(i + 1, steps(0.2))
    time.sleep(1.5)  # nothing in flight
    wd.close()
    off = StepWatchdog(0, poll_s=0.05, exit=fired.append)
    off.begin(1)  # dispatched, never finished: nothing watches it
    time.sleep(0.3)
    assert not fired and not off.enabled


def _env(devices: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")) + \
        f" --xla_force_host_platform_device_count={devices}"
    return env


def _wait_for_line(p: subprocess.Popen, needle: str, lines: list, deadline: float) -> float:
    """Read p's output into `lines` until a line contains needle; the time it arrived."""
    for line in p.stdout:
        lines.append(line)
        if needle in line:
            return time.monotonic()
        assert time.monotonic() < deadline, "".join(lines[-30:])
    raise AssertionError(f"exited ({p.wait()}) before '{needle}':\n" + "".join(lines[-30:]))


def test_hung_step_ends_the_run_and_leaves_the_checkpoints(tmp_path):
    """Step 5 blocks in a host callback (as on a dead peer's collective): one line, exit 4, checkpoints intact.
    The fault comes in through the plug-in interface: tests/plugins/faults.py's HangStep, on PYTHONPATH."""
    run, timeout = tmp_path / "run", 8
    env = dict(_env(8), FAULT_STEP="5")
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "tests" / "plugins")
    p = subprocess.Popen([sys.executable, "-m", "trainer.cli", "train", *RUN, "checkpoint.every=2",
                          f"train.step_timeout_s={timeout}", f"run.dir={run}", "run.plugins=[faults:HangStep]"],
                         cwd=ROOT, text=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        lines = []
        t4 = _wait_for_line(p, "step 4/1000 |", lines, time.monotonic() + 240)  # step 5 is dispatched next
        lines += p.stdout.readlines()
        rc, ended = p.wait(timeout=60), time.monotonic()
    finally:
        p.kill()
    out = "".join(lines)
    errors = [ln for ln in lines if "error" in ln.lower()]
    assert rc == EXIT_CODE and len(errors) == 1, out[-3000:]
    m = ERROR.match(errors[0])
    assert m and m.group(1) == "5" and float(m.group(4)) == timeout, errors[0]
    assert timeout <= int(m.group(2)) <= timeout + 3 and "Traceback" not in out, out[-3000:]
    print(f"step 5 hung: exit {rc} {ended - t4:.1f}s after step 4's line (step_timeout_s={timeout})")
    assert ended - t4 < timeout + 15
    assert ckpt.list_steps(run) == [2, 4]  # the newest complete checkpoint is there to resume from
    params, _ = load_params(run, 4)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


# A phase beside the steps made to wait for good (tests/plugins/faults.py's BlockPhase, named in run.plugins):
# extra settings, FAULT_STEP, and what the one error line names.
PHASES = {
    "save": (["checkpoint.every=2"], "6", "a checkpoint save (or the wait for the one in flight)"),
    "eval": (["checkpoint.every=2", "train.eval_every=5"], "0", "eval (its loss is a mean over the devices)"),
    "close": (["checkpoint.every=2", "train.steps=5"], "0", "a checkpoint save (or the wait for the one in flight)"),
    "agreement": (["checkpoint.every=2"], "5", "the stop agreement between processes"),
    "restore": (["checkpoint.every=2", "train.on_nan=rollback", "train.max_bad_steps=1", "train.inject_nan_at=5"],
                "0", "the rollback's restore of the newest checkpoint"),
}


@pytest.mark.slow  # the default run keeps the hung step's end (test_hung_step_ends_the_run_and_leaves_the_checkpoints)
@pytest.mark.parametrize("phase", PHASES)
def test_a_phase_that_waits_for_good_ends_the_run(tmp_path, phase):
    """Crash, not hang, beside the steps too: one line naming the phase, exit 4, checkpoints 2 and 4 intact."""
    extra, at, what = PHASES[phase]
    run, timeout = tmp_path / "run", 10  # well above a save's or an eval's time on a busy host
    env = dict(_env(8), FAULT_PHASE=phase, FAULT_STEP=at)
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "tests" / "plugins")
    p = subprocess.run([sys.executable, "-m", "trainer.cli", "train", *RUN, *extra, f"train.step_timeout_s={timeout}",
                        f"run.dir={run}", "run.plugins=[faults:BlockPhase]"], cwd=ROOT, text=True, env=env,
                       capture_output=True, timeout=240)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("meshtrain: error:")]
    assert p.returncode == EXIT_CODE and len(errors) == 1, p.stderr[-3000:]
    assert errors[0].startswith(f"meshtrain: error: {what} did not finish after ") and \
        f"max(train.step_timeout_s={timeout}" in errors[0] and "Traceback" not in p.stderr, errors[0]
    assert ckpt.list_steps(run)[:2] == [2, 4]  # the checkpoints before the wait are there to resume from


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes and a kill; the default run keeps the blocked-step test
def test_killed_peer_ends_the_survivor(tmp_path):
    """2 processes (jax.distributed, gloo), started directly: SIGKILL one; the other exits on its own within 60 s.
    Seen both ways: the survivor's collective fails (gloo: connection reset) and its exit then waits for the
    dead peer in jax's checkpoint and shutdown barriers; or its other devices wait in the collective for good."""
    run, timeout, devices = tmp_path / "run", 10, 1
    args = [*RUN, f"mesh.data={2 * devices}", "train.batch_size=8", f"train.step_timeout_s={timeout}",
            f"run.dir={run}", f"dist.coordinator=127.0.0.1:{_free_port()}", "dist.num_processes=2"]
    ps = [subprocess.Popen([sys.executable, "-m", "trainer.cli", "train", *args, f"dist.process_id={i}"], cwd=ROOT,
                           env=_env(devices), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
          for i in (0, 1)]
    try:
        lines = []
        _wait_for_line(ps[0], "step 3/1000 |", lines, time.monotonic() + 240)
        ps[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        lines += ps[0].stdout.readlines()
        rc, waited = ps[0].wait(timeout=90), time.monotonic() - t0
    finally:
        for p in ps:
            p.kill()
            p.wait()
    out = "".join(lines)
    errors = [ln for ln in lines if ln.startswith("meshtrain: error:")]
    print(f"{devices} device(s) per process, process 1 killed: process 0 exited with {rc} after {waited:.1f}s "
          f"(step_timeout_s={timeout}): {errors[-1][:110] if errors else ''}")
    assert rc == EXIT_CODE and waited < 60 and len(errors) == 1, out[-3000:]
    assert ERROR.match(errors[0]) or errors[0].startswith("meshtrain: error: training stopped on "), \
        errors[0]


def test_negative_step_timeout_is_a_one_line_error():
    from trainer.config import load_config, validate
    from trainer.errors import UserError
    with pytest.raises(UserError, match=r"train.step_timeout_s=-1.0 must be >= 0 and <= 1e9: .*0: off"):
        validate(load_config(TINY + ["train.step_timeout_s=-1"]), 8)
