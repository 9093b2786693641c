"""Preemption: SIGTERM/SIGINT stop the loop after the current step; a second SIGINT aborts at once."""
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


class StopRequest:
    """Context manager that turns SIGTERM/SIGINT into a stop request the loop polls between steps."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = None
        self._saved = {}

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            # os.write and os._exit are safe inside a handler; a partial checkpoint is never
            # visible because Orbax only renames a save into place once it is complete.
            os.write(2, b"\nmeshtrain: second interrupt, aborting without saving\n")
            os._exit(130)
        self.signum = signum
        name = signal.Signals(signum).name
        os.write(2, f"\nmeshtrain: {name} received; stopping after this step and saving a checkpoint "
                    f"(Ctrl-C again aborts)\n".encode())

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._saved = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, h in self._saved.items():
            signal.signal(s, h)
        self._saved = {}

    def agreed(self, can_sync: bool = True) -> bool:
        """Whether to stop now; with several processes all agree, checked only where `can_sync`
        (a collective every step would stall the host's dispatch ahead of the devices)."""
        if jax.process_count() == 1:
            return self.signum is not None
        return can_sync and any_process(self.signum is not None)
