"""Diagnostics through `logging`: the CLI's one stderr handler, 'meshtrain[: process I]: warning: message'.

Library code logs to `logging.getLogger(__name__)` and configures nothing; `meshtrain` (trainer/cli.py)
calls `configure()` once. The run's console lines (start-up summary, per-step metrics, progress bar)
stay on the rich console.
"""
from __future__ import annotations

import logging
import os
import sys

PACKAGES = ("trainer", "models", "meshes")  # records from elsewhere (orbax, absl, jax) also name their logger


class _Stderr(logging.StreamHandler):
    """A stream handler on whatever sys.stderr is when a record arrives (rich's live display and tests swap it)."""

    def __init__(self):
        logging.Handler.__init__(self)  # StreamHandler's would assign `stream`, here a property

    @property
    def stream(self):
        return sys.stderr


class Formatter(logging.Formatter):
    """'meshtrain: warning: message'; in a multi-process run 'meshtrain: process I: warning: message'."""

    def __init__(self):
        super().__init__()
        self._process = None  # ': process I' or '' once jax.distributed has joined (it never changes after)

    def process(self) -> str:
        if self._process is None:
            jax = sys.modules.get("jax")  # not imported yet: nothing has joined, and importing it here is slow
            try:
                if jax is not None and jax.distributed.is_initialized():
                    self._process = f": process {jax.process_index()}" if jax.process_count() > 1 else ""
            except Exception:  # noqa: BLE001 - a failed backend must not lose the message about it
                return ""
        return self._process or ""

    def format(self, record: logging.LogRecord) -> str:
        origin = "" if record.name.split(".")[0] in PACKAGES else f"{record.name}: "
        return f"meshtrain{self.process()}: {record.levelname.lower()}: {origin}{super().format(record)}"


def configure(level: int = logging.WARNING) -> logging.Handler:
    """The command line's logging: one handler on stderr at the root logger (idempotent)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, _Stderr):
            return h
        # absl's first log (importing orbax logs) calls logging.basicConfig() on a root without handlers:
        # its handler would print every record a second time, as 'WARNING:name:message'
        if type(h) is logging.StreamHandler and getattr(h.formatter, "_fmt", None) == logging.BASIC_FORMAT:
            root.removeHandler(h)
    handler = _Stderr()
    handler.setFormatter(Formatter())
    handler.setLevel(level)  # a root level lowered by a caller must not let jax's debug records through
    root.addHandler(handler)
    return handler


def last_words(log: logging.Logger, msg: str) -> None:
    """Log an error just before os._exit, which skips all flushing: written and flushed before it returns."""
    try:
        log.error(msg)
        logger = log
        while logger is not None:
            for h in logger.handlers:
                h.flush()
            logger = logger.parent if logger.propagate else None
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - the process is about to end: say it without logging's help
        os.write(2, f"meshtrain: error: {msg}\n".encode())
