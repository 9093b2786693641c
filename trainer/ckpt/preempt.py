"""Preemption: SIGTERM/SIGINT stop the loop after a step every process agrees on; a second SIGINT aborts at once.

One owner per signal. With several processes joined by jax.distributed, jax's preemption notifier owns SIGTERM:
its C handler, set by jax.distributed.initialize, starts the sync protocol (every process reports its step counter
and all stop at the largest + 1), and a Python handler set after it would silently replace it. A process without
that notifier (one process, or jax_enable_preemption_service off) keeps a Python handler for SIGTERM too.
"""
from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is true on any of them (a no-op with one process)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils
    return bool(np.max(multihost_utils.process_allgather(np.int32(bool(flag)))))


# agreed() calls so far in this process: the counter jax's sync protocol compares across processes. jax's sync
# manager lives as long as the process, so the counter does too (a second train() in one process goes on counting)
_calls = 0


def jax_notifier():
    """jax's preemption sync manager where this process joined a cluster with it (else None): it owns SIGTERM."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    state = distributed.global_state
    return getattr(state, "preemption_sync_manager", None) if getattr(state, "client", None) is not None else None


class StopRequest:
    """Context manager that turns SIGTERM/SIGINT into a stop request the loop polls between steps."""

    def __init__(self):
        self.signum = None
        self.jax_owns_sigterm = jax_notifier() is not None
        self._saved = {}

    @property
    def signals(self) -> tuple:
        return (signal.SIGINT,) if self.jax_owns_sigterm else (signal.SIGTERM, signal.SIGINT)

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            # os.write and os._exit are safe inside a handler; a partial checkpoint is never
            # visible: Orbax renames a save into place once it is complete on disk, and in object storage
            # writes its commit file last (trainer/ckpt/objects.py).
            os.write(2, b"\nmeshtrain: second interrupt, aborting without saving\n")
            os._exit(130)
        self.signum = signum
        name = signal.Signals(signum).name
        os.write(2, f"\nmeshtrain: {name} received; stopping after a step every process agrees on and saving a "
                    f"checkpoint (Ctrl-C again aborts)\n".encode())
        if self.jax_owns_sigterm:
            signal.raise_signal(signal.SIGTERM)  # jax's handler: the other processes hear of it through its protocol

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._saved = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, *exc):
        for s, h in self._saved.items():
            signal.signal(s, h)
        self._saved = {}

    def agreed(self, can_sync: bool = True) -> bool:
        """Whether to stop now, called once after every step on every process. Under jax's notifier: whether
        this is the step its protocol chose (a lock and a compare on the host, no collective); one process: a
        signal arrived; otherwise all processes agree by an all-gather, only where `can_sync` (a collective every
        step would stall the host's dispatch ahead of the devices)."""
        global _calls
        _calls += 1
        if self.jax_owns_sigterm:
            from jax.experimental import multihost_utils
            return multihost_utils.reached_preemption_sync_point(_calls)
        if jax.process_count() == 1:
            return self.signum is not None
        return can_sync and any_process(self.signum is not None)
