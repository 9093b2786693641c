"""The config schema's machinery: each key is declared once (`setting`: default, allowed values, one line of
meaning), checked in one place (`check_ranges`), listed for `--help` and docs/config.md (`specs`, `help_text`,
`markdown`), and an unknown key is answered with the closest known one (`closest`)."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import operator
import re
import typing
from typing import Any, Callable

from models.config import FLOAT32, INT32, POSITIVE  # noqa: F401  (the ceilings every section's ranges use)
from trainer.errors import UserError

_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "": operator.eq}
_TYPES = {int: "int", float: "float", str: "str", bool: "bool"}
# Ceilings of the range rules: sizes (array dimensions, token ids) are int32 in XLA and every float a step computes
# with is a float32 (models/config.py, whose keys they bound first); step counts int64 where they are kept
# (checkpoints, metrics).
INT64 = "2**63-1"


@dataclasses.dataclass(frozen=True)
class Form:
    """The allowed values of a text or list key, given by a parser: `text` for the docs, `parse(value, key)` raises
    a UserError naming the key and the form."""
    text: str
    parse: Callable[[Any, str], Any]


def setting(default, allowed=None, doc: str = ""):
    """A config key's field: its default; its allowed values: a rule for a number ('> 0', '>= 0 and <= 1', '-1 (the
    rest) or >= 1 and <= 2**31-1'), a collection of choices, a Form, or None (any value of its type); one line of
    meaning."""
    meta = {"allowed": allowed, "doc": doc}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One key of the schema: its dotted name, type, default, allowed values and meaning."""
    key: str
    type: Any
    optional: bool
    default: Any
    allowed: Any
    doc: str

    @property
    def type_text(self) -> str:
        args = typing.get_args(self.type)
        name = f"list of {_TYPES[args[0]]}" if typing.get_origin(self.type) in (list, typing.List) else \
            _TYPES[self.type]
        return name + (" or null" if self.optional else "")

    @property
    def allowed_text(self) -> str:
        a = self.allowed
        if a is None or isinstance(a, str):
            return a or ""
        return a.text if isinstance(a, Form) else ", ".join(str(c) for c in a)

    @property
    def default_text(self) -> str:
        d = self.default
        return "null" if d is None else str(d).lower() if isinstance(d, bool) else "''" if d == "" else str(d)


def _section(f: dataclasses.Field):
    t = f.default_factory if f.default_factory is not dataclasses.MISSING else None
    return t if t is not None and dataclasses.is_dataclass(t) else None


@functools.lru_cache(maxsize=None)
def specs(root) -> tuple[Spec, ...]:
    """Every key of a schema (a dataclass of section dataclasses), in declaration order."""
    out = []
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        if (sub := _section(f)) is not None:
            out += [dataclasses.replace(s, key=f"{f.name}.{s.key}") for s in specs(sub)]
            continue
        t, args = hints[f.name], typing.get_args(hints[f.name])
        optional = typing.get_origin(t) is typing.Union and type(None) in args
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        out.append(Spec(f.name, args[0] if optional else t, optional, default, f.metadata.get("allowed"),
                        f.metadata.get("doc", "")))
    return tuple(out)


def text_lists(node, root) -> None:
    """A list-of-text key whose entries have a form (a Form checks each) given as one text, without brackets
    (`data.mixture=a=0.7,b=0.3`, or a YAML line's plain text), in place: the list of its comma-separated entries, as
    [a=0.7,b=0.3] gives."""
    from omegaconf import OmegaConf
    given = OmegaConf.to_container(node, resolve=False) or {}
    for s in specs(root):
        section, _, name = s.key.partition(".")
        if "." in name:  # a section's own section: no list key of that form there
            continue
        value = given.get(section, {}).get(name) if isinstance(given.get(section), dict) else None
        if isinstance(s.allowed, Form) and typing.get_args(s.type) == (str,) and isinstance(value, str) \
                and not value.startswith("${"):
            node[section][name] = [e.strip() for e in value.split(",") if e.strip()]


def _number(text: str) -> int | float:
    """'7' -> 7, '2**31-1' -> 2147483647 (ints exact: 2**63 is not <= float(2**63-1)), '3.4e38' -> 3.4e38."""
    if m := re.fullmatch(r"2\*\*(\d+)(-1)?", text):
        return 2 ** int(m.group(1)) - (1 if m.group(2) else 0)
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


@functools.lru_cache(maxsize=None)
def _rule(text: str) -> tuple:
    """'0 (off) or > 1' -> ((('', 0),), (('>', 1),)): alternatives, each a conjunction of (operator, bound)."""
    alternatives = []
    for alt in text.split(" or "):
        bounds = []
        for part in re.sub(r"\s*\([^)]*\)$", "", alt.strip()).split(" and "):
            m = re.fullmatch(r"(>=|<=|>|<)?\s*(-?\d+(?:\.\d*)?(?:e-?\d+)?|2\*\*\d+(?:-1)?)", part.strip())
            if not m:
                raise ValueError(f"cannot read the range rule '{text}' (at '{part}')")
            bounds.append((m.group(1) or "", _number(m.group(2))))
        alternatives.append(tuple(bounds))
    return tuple(alternatives)


def in_range(value, rule: str) -> bool:
    return any(all(_OPS[op](value, bound) for op, bound in alt) for alt in _rule(rule))


def check_value(s: Spec, value) -> None:
    """A UserError of one line naming the key, the value and what is allowed, if `value` is not allowed."""
    a = s.allowed
    if value is None or a is None:
        return
    if isinstance(a, Form):
        a.parse(value, s.key)
    elif isinstance(a, str):
        null = " or null" if s.optional else ""
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{s.key}={value} is not a finite number; give one that is {a}{null}: {s.doc}")
        if not in_range(value, a):
            raise UserError(f"{s.key}={value} must be {a}{null}: {s.doc}")
    else:
        check_choice(s.key, value, a)


def check_choice(name: str, value, choices) -> None:
    """A UserError naming the choices (and the nearest one) if `value` is not one of them."""
    if value not in choices:
        names = [str(c) for c in choices]
        near = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise UserError(f"{name}='{value}' is unknown; choose one of {', '.join(names)}{hint}")


def check_ranges(cfg) -> None:
    """Every key of a config (an instance of a schema) against its allowed values: the one range check."""
    for s in specs(type(cfg)):
        node = cfg
        for part in s.key.split("."):  # a section's own section too (model.lora.rank)
            node = getattr(node, part)
        check_value(s, node)


def help_text(root, prefix: str = "") -> str:
    """The keys starting with `prefix`: a line of key, type = default and allowed values, a line of meaning; a blank
    line between sections."""
    rows = [s for s in specs(root) if s.key.startswith(prefix)]
    w0, w1 = (max(len(r) for r in col) for col in ([s.key for s in rows], [f"{s.type_text} = {s.default_text}"
                                                                            for s in rows]))
    out = []
    for i, s in enumerate(rows):
        if i and s.key.split(".")[0] != rows[i - 1].key.split(".")[0]:
            out.append("")
        out.append(f"  {s.key:<{w0}}  {f'{s.type_text} = {s.default_text}':<{w1}}  {s.allowed_text}".rstrip())
        out.append(f"  {'':<{w0}}  {s.doc}")
    return "\n".join(out)


def markdown(root) -> str:
    """A Markdown table of every key: key, type, default, allowed values, meaning."""
    def cell(text):
        return text.replace("|", "\\|")
    lines = ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{s.key}` | {s.type_text} | `{cell(s.default_text)}` | {cell(s.allowed_text)} | {cell(s.doc)} |"
              for s in specs(root)]
    return "\n".join(lines)


def closest(name: str, keys: list[str], aliases: dict[str, str], first: str = "") -> str:
    """'did you mean ...?' for an unknown dotted key: the key other trainers' name stands for; the section meant by
    a bare section name; a key of the given (or nearest) section one typo away; the keys of other sections with
    this exact name (`first`'s listed first); the given section's nearest key; or the nearest key."""
    parts = name.split(".")
    leaf = parts[-1] if len(parts) < 3 else parts[1]
    sections = list(dict.fromkeys(k.split(".")[0] for k in keys))
    if (alias := aliases.get(name) or aliases.get(leaf)) in keys:
        return f"did you mean '{alias}'?"
    if len(parts) == 1 and (sec := difflib.get_close_matches(name, sections, n=1, cutoff=0.6)) and name not in \
            [k.split(".")[1] for k in keys]:
        return f"did you mean the section '{sec[0]}'? (give its keys, e.g. {_keys_of(keys, sec[0])[0]}=...)"
    sec = [] if len(parts) == 1 else [parts[0]] if parts[0] in sections else \
        difflib.get_close_matches(parts[0], sections, n=1, cutoff=0.6)
    own = [k.split(".")[1] for k in _keys_of(keys, sec[0])] if sec else []
    # an exact name in another section beats a same-section look-alike ('model.batch_size' is train's, not
    # 'model.vocab_size'), unless the look-alike is one typo away ('plan.devices': 'plan.device', or 'sim.devices')
    if leaf in own:  # the section given by a typo ('trian.steps'), or a key deeper than section.name
        picks = [f"{sec[0]}.{leaf}"]
    else:
        picks = [f"{sec[0]}.{k}" for k in own if _one_typo(leaf, k)][:1] + sorted(
            (k for k in keys if k.split(".")[1] == leaf), key=lambda k: k.split(".")[0] != first)
    if not picks and own:
        picks = [f"{sec[0]}.{k}" for k in difflib.get_close_matches(leaf, own, n=1, cutoff=0.6)]
    if picks:
        return f"did you mean '{picks[0]}'?" + (f" (or {', '.join(repr(k) for k in picks[1:])})" if picks[1:] else "")
    near = difflib.get_close_matches(name, keys, n=1, cutoff=0.6) or \
        [k for k in keys if k.split(".")[1] in difflib.get_close_matches(leaf, [k.split(".")[1] for k in keys], 1)]
    return f"did you mean '{near[0]}'?" if near else "see the keys in `meshtrain train --help`"


def _one_typo(a: str, b: str) -> bool:
    """a and b differ by one letter changed, added or dropped, or two neighbours swapped."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) != len(b):
        short, long = sorted((a, b), key=len)
        return any(long[:i] + long[i + 1:] == short for i in range(len(long)))
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                              and a[diff[1]] == b[diff[0]])


def step_range(spec, key: str, single: bool = False) -> tuple[int, int] | None:
    """The one parser of step ranges: 'A:B' (or, with `single`, also 'A') -> (A, B) with 1 <= A <= B;
    '' -> None; anything else a UserError naming `key` and the fix."""
    if spec in ("", None):
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(spec))
    a, b = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or not (single or m.group(2)) or not 1 <= a <= b <= _number(INT64):
        form, eg = ("STEP or A:B", "7") if single else ("A:B", "5:8")
        raise UserError(f"{key}='{spec}' is not {form} with 1 <= A <= B <= {INT64}; write e.g. {key}={eg}")
    return a, b


def _keys_of(keys: list[str], section: str) -> list[str]:
    return [k for k in keys if k.split(".")[0] == section]
