"""Where a run's wall time goes: compile, compute, data wait, checkpointing, eval, the rest."""
from __future__ import annotations

import contextlib
import time

PARTS = ("compile", "compute", "data", "checkpoint", "eval")


class Goodput:
    """Accumulates seconds per part; `record()` adds the total, `other` and the goodput fraction.

    compute is host-observed: step dispatch plus waiting for results. With asynchronous dispatch
    the device may still be busy while the host waits for data, so `data` bounds stalls from above.
    """

    def __init__(self):
        self.t0 = time.perf_counter()
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def add(self, part: str, seconds: float):
        self.seconds[part] += seconds

    @contextlib.contextmanager
    def span(self, part: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - t)

    def timed(self, part: str, iterable):
        """Yield from iterable, counting the time spent waiting for each item."""
        it = iter(iterable)
        while True:
            with self.span(part):
                item = next(it, StopIteration)
            if item is StopIteration:
                return
            yield item

    def record(self) -> dict:
        """Seconds per part as time_<part>_s, time_other_s, time_total_s, and goodput = compute / total."""
        total = time.perf_counter() - self.t0
        rec = {f"time_{k}_s": v for k, v in self.seconds.items()}
        rec["time_other_s"] = total - sum(self.seconds.values())
        rec["time_total_s"] = total
        rec["goodput"] = self.seconds["compute"] / total if total > 0 else 0.0
        return rec


def summary(rec: dict) -> str:
    total = rec["time_total_s"]
    parts = " | ".join(f"{k} {rec[f'time_{k}_s']:.1f}s ({100 * rec[f'time_{k}_s'] / total:.0f}%)"
                       for k in PARTS + ("other",))
    return f"goodput {100 * rec['goodput']:.1f}% of {total:.1f}s: {parts}"
