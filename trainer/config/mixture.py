"""data.mixture's and data.mixture_schedule's entries and which source each row of a step draws from, parsed and
checked here, where the config's schema checks them too (the batches: trainer/data/mixture.py)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from trainer.errors import UserError

_MIX = 0x313


def name_of(source: str) -> str:
    """A source's name in metrics: its file or folder name without suffix."""
    return Path(source.rstrip("/")).stem or source


def parse_entries(entries, key: str = "data.mixture") -> tuple[list[str], list[str], np.ndarray]:
    """(sources, names, weights) of data.mixture's SOURCE=WEIGHT entries, checked."""
    sources, weights = [], []
    for e in entries:
        source, eq, w = str(e).rpartition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = None
        if not eq or not source or weight is None or not np.isfinite(weight):
            raise UserError(f"{key} entry '{e}' is not SOURCE=WEIGHT; write e.g. {key}=[web/=0.7,code.bin=0.3]")
        if weight < 0:
            raise UserError(f"{key} entry '{e}' has a negative weight; weights are >= 0, not all 0")
        sources.append(source)
        weights.append(weight)
    names = [name_of(s) for s in sources]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UserError(f"{key} names two sources '{twice[0]}' (a source is named by its file or folder name); "
                        "give them different names")
    w = np.asarray(weights, np.float64)
    if len(w) and not w.sum() > 0:
        raise UserError(f"{key} weights are all 0; give at least one source a positive weight")
    return sources, names, w


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


def weights_at(w0: np.ndarray, schedule: list[tuple[int, int, float]], step: int) -> np.ndarray:
    """The weights a step draws with (step is 0-based, a schedule's STEP counts from 1 as train.steps does: the
    change takes effect at the STEP-th step, step index STEP - 1)."""
    w = w0.copy()
    for at, j, weight in schedule:
        if at - 1 <= step:
            w[j] = weight
    return w


def check_schedule(w0: np.ndarray, schedule):
    w = w0.copy()
    for at, j, weight in schedule:
        w[j] = weight
        if not w.sum() > 0:
            raise UserError(f"data.mixture_schedule leaves every weight 0 from step {at}; keep one source's weight "
                            "positive")


def assignment(seed: int, step: int, B: int, w: np.ndarray) -> np.ndarray:
    """The source of each of the B rows of a step: systematic sampling on the weights."""
    r = np.random.default_rng([seed, step, _MIX]).random()
    cum = np.cumsum(w) / w.sum()
    return np.minimum(np.searchsorted(cum, (np.arange(B) + r) / B, side="right"), len(w) - 1)
