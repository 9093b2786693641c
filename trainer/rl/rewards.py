"""GRPO's reward functions (`grpo.rewards`, weighted by `grpo.reward_weights`), called as TRL 1.16 calls its own:
f(prompts=[...], completions=[...], completion_ids=[...], **fields) -> one float (or None) per completion, every list
one entry per completion (a record's fields repeated for each of its completions).

Built in, by name:
  exact_match:FIELD   1.0 where the completion, stripped, equals the record's FIELD (as text, stripped), else 0.0
  regex:PATTERN       1.0 where re.search(PATTERN, completion, re.DOTALL) matches (anchor it for a whole format)
  numeric:FIELD       1.0 where the completion's last number equals the record's FIELD as a number, else 0.0 (None
                      where FIELD is no number: left out of its group's mean, as TRL leaves a None)
and the user's own by import path, `module:function` (the module importable from the working directory or
PYTHONPATH). A function that is missing, raises, or returns another count than the completions stops the run in one
line naming it."""
from __future__ import annotations

import importlib
import math
import re
import sys
from typing import Callable

import numpy as np

from trainer.errors import UserError

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _number(x) -> float | None:
    try:
        v = float(str(x).replace(",", "").strip())
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _text(c) -> str:
    """A completion's text: itself, or a conversation's last message's content."""
    return c if isinstance(c, str) else str(c[-1].get("content", ""))


def _field(fields: dict, field: str, name: str) -> list:
    if field not in fields:
        raise UserError(f"grpo.rewards entry '{name}:{field}': the records have no field '{field}' (they have "
                        f"{', '.join(sorted(fields)) or 'no other field'}); name one of theirs")
    return fields[field]


def exact_match(field: str) -> Callable:
    def exact_match(completions, **fields):
        return [float(_text(c).strip() == str(a).strip()) for c, a in
                zip(completions, _field(fields, field, "exact_match"))]
    return exact_match


def regex(pattern: str) -> Callable:
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise UserError(f"grpo.rewards entry 'regex:{pattern}' is not a regular expression ({e}); fix the pattern") \
            from None

    def regex(completions, **fields):
        return [float(compiled.search(_text(c)) is not None) for c in completions]
    return regex


def numeric(field: str) -> Callable:
    def numeric(completions, **fields):
        out = []
        for c, a in zip(completions, _field(fields, field, "numeric")):
            want, found = _number(a), NUMBER.findall(_text(c).replace(",", ""))
            out.append(None if want is None else float(bool(found) and math.isclose(float(found[-1]), want,
                                                                                      rel_tol=1e-9, abs_tol=1e-9)))
        return out
    return numeric


BUILT_IN = {"exact_match": exact_match, "regex": regex, "numeric": numeric}


def load(entry: str) -> tuple[str, Callable]:
    """(the name its metrics carry, the function) of one grpo.rewards entry."""
    kind, sep, arg = entry.partition(":")
    if kind in BUILT_IN:
        if not sep or not arg:
            raise UserError(f"grpo.rewards entry '{entry}' needs its argument: {kind}:FIELD" if kind != "regex" else
                            f"grpo.rewards entry '{entry}' needs its pattern: regex:PATTERN")
        return kind, BUILT_IN[kind](arg)
    if not sep or not arg:
        raise UserError(f"grpo.rewards entry '{entry}' is neither a built-in ({', '.join(BUILT_IN)}, each with "
                        "':' and its argument) nor an import path module:function")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # the working directory, as python -m finds modules
    try:
        module = importlib.import_module(kind)
    except Exception as e:  # noqa: BLE001 - any failure to import is the user's module's, said in one line
        raise UserError(f"grpo.rewards entry '{entry}': module '{kind}' could not be imported ({type(e).__name__}: "
                        f"{e}); put it on PYTHONPATH or in the working directory") from None
    fn = getattr(module, arg, None)
    if not callable(fn):
        raise UserError(f"grpo.rewards entry '{entry}': module '{kind}' has no function '{arg}'")
    return getattr(fn, "__name__", arg), fn


def load_all(entries: list) -> list:
    """load() of every entry, a name that repeats (two regex: rewards) numbered from its second on: regex, regex_1."""
    out, seen = [], {}
    for e in entries:
        name, fn = load(e)
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append((name if n == 0 else f"{name}_{n}", fn))
    return out


def score(functions: list, prompts: list, completions: list, completion_ids: list, fields: dict) -> np.ndarray:
    """(completions, functions) float32 rewards, NaN where a function returned None. A record's fields named as the
    call's own arguments are left out, as TRL leaves them."""
    fields = {k: v for k, v in fields.items() if k not in ("prompts", "completions", "completion", "completion_ids")}
    out = np.full((len(completions), len(functions)), np.nan, np.float32)
    for j, (name, fn) in enumerate(functions):
        try:
            got = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's function failed: one line naming it, nothing written
            raise UserError(f"reward function '{name}' raised {type(e).__name__}: {e}; fix it or drop it from "
                            "grpo.rewards") from None
        if not isinstance(got, (list, tuple, np.ndarray)) or len(got) != len(completions):
            n = len(got) if isinstance(got, (list, tuple, np.ndarray)) else type(got).__name__
            raise UserError(f"reward function '{name}' returned {n} values for {len(completions)} completions; return "
                            "one float (or None) per completion")
        for i, v in enumerate(got):
            if v is not None:
                try:
                    out[i, j] = float(v)
                except (TypeError, ValueError):
                    raise UserError(f"reward function '{name}' returned {v!r} for completion {i}; return a float or "
                                    "None") from None
    return out


def metrics(names: list, rewards: np.ndarray) -> dict:
    """TRL's rewards/{name}/mean and /std (over the completions each function scored, Bessel-corrected)."""
    out = {}
    for j, name in enumerate(names):
        col = rewards[:, j].astype(np.float64)
        col = col[~np.isnan(col)]
        out[f"rewards/{name}/mean"] = float(col.mean()) if col.size else float("nan")
        out[f"rewards/{name}/std"] = float(col.std(ddof=1)) if col.size > 1 else float("nan")
    return out
