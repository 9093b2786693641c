"""Step watchdog (train.step_timeout_s): a step that does not finish ends the process, so that the
scheduler restarts it from the newest checkpoint instead of leaving it hung; so does a phase beside the
steps that waits on other processes or devices (eval, a checkpoint save or the wait for it, the stop
agreement, a rollback's restore: the plug-ins that declare `waits`).

A step waits forever when a collective waits for a dead peer or a device is wedged; the main
thread is then stuck inside XLA and can neither notice nor raise. The loop marks each step before
dispatching it and hands its outputs to a waiter thread, which blocks on them (no host sync is
added to the loop) and records when each step finished. A monitor thread checks the oldest
unfinished step: once it has been running (dispatched, its predecessor done) longer than
max(train.step_timeout_s, FACTOR x the median step time so far), it writes one line to stderr and
ends the process with EXIT_CODE (os._exit: the main thread cannot unwind). Checkpoints stay
intact: Orbax writes a save in flight to a temporary folder and renames it only when complete.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import statistics
import threading
import time

import jax

from trainer.errors import UserError
from trainer.logs import last_words
from trainer.run.plugin import Plugin

FACTOR = 20  # x the median step time: a slow step, a busy host or an async save stays far below it
WINDOW = 100  # recent step times in the median
EXIT_CODE = 4  # distinct from UserError (2) and TrainingStopped (3): "restart me"
log = logging.getLogger(__name__)


class StepWatchdog:
    """begin(step) before dispatching a step, watch(step, outputs) after, close() at the end; timeout_s=0: off."""

    def __init__(self, timeout_s: float, poll_s: float = 1.0, exit=os._exit):
        self.floor, self.poll_s, self._exit = float(timeout_s), poll_s, exit
        self.enabled = self.floor > 0
        self._queue: queue.Queue = queue.Queue()
        self._times: collections.deque = collections.deque(maxlen=WINDOW)
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()  # (step, dispatch time) of steps not finished
        self._last_done = 0.0
        self._phase = None  # (what, since) of the phase beside the steps now waiting
        self._stop = threading.Event()
        if self.enabled:
            threading.Thread(target=self._wait, name="meshtrain-step-waiter", daemon=True).start()
            threading.Thread(target=self._monitor, name="meshtrain-step-watchdog", daemon=True).start()

    def begin(self, step: int) -> None:
        """Step `step` (1-based, as logged) is about to be dispatched; on CPU dispatch may run it to the end."""
        if self.enabled:
            with self._lock:
                self._pending.append((step, time.monotonic()))

    def watch(self, step: int, outputs) -> None:
        """Step `step` was dispatched; `outputs` are ready when it has finished."""
        if self.enabled:
            self._queue.put(outputs)

    @contextlib.contextmanager
    def phase(self, what: str | None):
        """A phase that waits on other processes or devices; one that runs past limit() ends the process."""
        if not self.enabled or what is None:
            yield
            return
        with self._lock:
            self._phase = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._phase = None

    def limit(self) -> float:
        """Seconds a step may run: the configured floor, or FACTOR x the median step time if longer."""
        with self._lock:
            times = list(self._times)
        return max(self.floor, FACTOR * statistics.median(times)) if times else self.floor

    def close(self, error: BaseException | None = None) -> None:
        """Stop watching; with `error` escaping a multi-process run, end the process if it has not exited by limit()."""
        self._stop.set()
        self._queue.put(None)
        # a collective that failed because a peer is gone leaves jax's exit (checkpoint and shutdown
        # barriers) waiting for that peer until dist.heartbeat_s; a bad input is raised on every process
        if self.enabled and error is not None and not isinstance(error, UserError) and jax.process_count() > 1:
            threading.Thread(target=self._deadline, args=(error, self.limit()), name="meshtrain-exit-watchdog",
                             daemon=True).start()

    def _deadline(self, error: BaseException, limit: float):
        time.sleep(limit)  # a daemon thread: it runs on during atexit, where jax.distributed waits for peers
        why = (str(error).strip().splitlines() or [""])[0][:300]
        last_words(log, f"training stopped on {type(error).__name__}: {why}; still not exited {limit:.0f}s later "
                        "(waiting for a process that is gone): exiting so that the run restarts from its newest "
                        "checkpoint (rerun the same command)")
        self._exit(EXIT_CODE)

    def _running(self) -> tuple[int, float] | None:
        """(step, when it started running) of the oldest unfinished step: dispatched, predecessor done."""
        with self._lock:
            if not self._pending:
                return None
            step, dispatched = self._pending[0]
            return step, max(dispatched, self._last_done)

    def _wait(self):
        while (outputs := self._queue.get()) is not None:
            try:
                jax.block_until_ready(outputs)
            except Exception:  # noqa: BLE001 - a failed step is the main thread's to report, not a hang
                pass
            done = time.monotonic()
            with self._lock:
                _, dispatched = self._pending.popleft()
                self._times.append(done - max(dispatched, self._last_done))
                self._last_done = done

    def _monitor(self):
        while not self._stop.wait(self.poll_s):
            with self._lock:
                phase = self._phase
            if phase is not None and time.monotonic() - phase[1] > self.limit():
                self._fire_phase(*phase)
            running = self._running()
            if running is None:
                continue
            step, start = running
            waited, limit = time.monotonic() - start, self.limit()
            if waited > limit and not self._stop.is_set():
                self._fire(step, waited, limit)

    def _fire_phase(self, what: str, since: float):
        limit = self.limit()
        last_words(log, f"{what} did not finish after {time.monotonic() - since:.0f}s (limit {limit:.0f}s = "
                        f"max(train.step_timeout_s={self.floor:g}, {FACTOR} x median step time)); it waits for "
                        "another process or a device that is gone or stuck: exiting so that the run restarts from "
                        "its newest checkpoint (rerun the same command)")
        self._exit(EXIT_CODE)

    def _fire(self, step: int, waited: float, limit: float):
        with self._lock:
            times = list(self._times)
        median = f"{statistics.median(times):.3g}s over {len(times)} steps" if times else "none finished yet"
        msg = (f"step {step} did not finish after {waited:.0f}s (limit {limit:.0f}s = "
               f"max(train.step_timeout_s={self.floor:g}, {FACTOR} x median step time: {median})); a collective "
               "is waiting for a dead process or a device is stuck: exiting so that the run restarts from its "
               "newest checkpoint (rerun the same command)")
        last_words(log, msg)  # the main thread is stuck in XLA, holding none of logging's locks
        self._exit(EXIT_CODE)


class Watchdog(Plugin):
    """The step watchdog as a loop plug-in: each step marked before dispatch, its outputs watched after; the
    other plug-ins' waiting phases watched through run.phase. Last in the loop's list, so that it watches
    every other plug-in's exit too."""

    def __init__(self, run):
        self.wd = StepWatchdog(run.cfg.train.step_timeout_s)
        run.phase = self.wd.phase

    def before_step(self, run, step: int):
        self.wd.begin(step)  # before dispatch: on CPU the call itself may run the step

    def after_step(self, run, step: int):
        self.wd.watch(step, run.metrics)  # a waiter thread blocks on them, not the loop

    def on_exit(self, run, error):
        self.wd.close(error)  # an error with peers gone must not hang the exit
