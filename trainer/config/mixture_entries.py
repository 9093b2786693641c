"""data.mixture's and data.mixture_schedule's entries, parsed and checked here, where the config's schema checks them
too (which source each row of a step draws from, and the batches: trainer/data/mixture.py)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from trainer.errors import UserError

# NAME:SOURCE=WEIGHT: a NAME is a plain identifier before the first ':', which a URL's '://' never is
_NAMED = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*):(?!//)(.+)")


def name_of(source: str) -> str:
    """A source's default name in metrics: its file or folder name without suffix."""
    return Path(source.rstrip("/")).stem or source


def split_entry(entry: str, key: str = "data.mixture") -> tuple[str, str, float]:
    """(name, source, weight) of one [NAME:]SOURCE=WEIGHT entry (no NAME: the source's file or folder name)."""
    source, eq, w = str(entry).rpartition("=")
    try:
        weight = float(w)
    except ValueError:
        weight = None
    if not eq or not source or weight is None or not np.isfinite(weight):
        raise UserError(f"{key} entry '{entry}' is not [NAME:]SOURCE=WEIGHT; write e.g. "
                        f"{key}=[web:data/web/=0.7,code.bin=0.3]")
    if weight < 0:
        raise UserError(f"{key} entry '{entry}' has a negative weight; weights are >= 0, not all 0")
    named = _NAMED.fullmatch(source)
    return (named[1], named[2], weight) if named else (name_of(source), source, weight)


def parse_entries(entries, key: str = "data.mixture") -> tuple[list[str], list[str], np.ndarray]:
    """(sources, names, weights) of data.mixture's [NAME:]SOURCE=WEIGHT entries, checked."""
    names, sources, weights = zip(*[split_entry(e, key) for e in entries]) if len(entries) else ((), (), ())
    names, sources = list(names), list(sources)
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UserError(f"{key} names two sources '{twice[0]}' (a source is named by its file or folder name unless "
                        f"its entry names it); name them apart: {key}=[web:runs/a/data.bin=0.7,code:runs/b/data.bin"
                        "=0.3]")
    w = np.asarray(weights, np.float64)
    if len(w) and not w.sum() > 0:
        raise UserError(f"{key} weights are all 0; give at least one source a positive weight")
    return sources, names, w


def ignored_source(data) -> str | None:
    """The warning for a data.source set beside data.mixture, which the run does not read; None where there is none."""
    if data.mixture and data.source != "builtin":
        return (f"data.source='{data.source}' is ignored: data.mixture names this run's sources; drop data.source, "
                "or drop data.mixture to train on that source alone")
    return None


def parse_schedule(entries, names: list[str] | None, key: str = "data.mixture_schedule") -> list[tuple]:
    """(step, source index, weight) of data.mixture_schedule's STEP:NAME=WEIGHT entries, in step order (names None:
    the form only, the name in the index's place)."""
    out = []
    for e in entries:
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(.+?)\s*=\s*([^=]+?)\s*", str(e))
        try:
            step, name, weight = int(m.group(1)), m.group(2), float(m.group(3))
        except (AttributeError, ValueError):
            raise UserError(f"{key} entry '{e}' is not STEP:NAME=WEIGHT; write e.g. {key}=[100:web=0.5]") from None
        if names is not None and name not in names:
            raise UserError(f"{key} entry '{e}' names '{name}', which is not a source of data.mixture "
                            f"({', '.join(names)}); use one of those names")
        if step < 1 or not np.isfinite(weight) or weight < 0:
            raise UserError(f"{key} entry '{e}' needs a step >= 1 and a weight >= 0")
        out.append((step, names.index(name) if names is not None else name, weight))
    return sorted(out, key=lambda x: x[0])


def check_schedule(w0: np.ndarray, schedule):
    """data.mixture_schedule's changes leave a positive weight at every step."""
    w = w0.copy()
    for at, j, weight in schedule:
        w[j] = weight
        if not w.sum() > 0:
            raise UserError(f"data.mixture_schedule leaves every weight 0 from step {at}; keep one source's weight "
                            "positive")
