"""Chat templates: a conversation's text and which of its characters are the assistant's.

A template renders in a sandboxed jinja2 environment made as transformers 5.x's `apply_chat_template` makes
it (`trim_blocks`, `lstrip_blocks`, loop controls, `tojson` without ASCII escaping, `raise_exception`,
`strftime_now`, `dict`, a `namespace` refusing underscore names, `{% generation %}` blocks), given the
messages with their None-valued keys dropped, `tools` when the record has them, `add_generation_prompt`,
the tokenizer's named special tokens, and the record's `chat_template_kwargs` over them (`variables_of`).
`strftime_now` returns the date given (`--date`), never today's, so that a prepared file does not depend on the
day it was made.

The assistant's characters: with `{% generation %}` blocks, what the blocks rendered (transformers'
`return_assistant_tokens_mask`). Without them, each assistant turn i is the text between the rendering of
the turns before it with `add_generation_prompt=True` and the rendering of the turns up to it, whose
trailing whitespace is left out: the generation prompt is prompt, the end-of-turn token is the assistant's,
the template's separator after it is not. That takes every earlier rendering to be a prefix of the whole.

What a template may not lose (docs/data.md, "Nothing dropped silently"): a role other than the usual four and those
the template compares against, and any message text missing from the rendering, bar the exemptions in `_shown`.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import UserError

DEFAULT_DATE = "2026-01-01"  # what strftime_now returns unless --date says otherwise
ROLES = ("system", "user", "assistant", "tool")  # a message's role: these, or one the template compares against
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_spans: ContextVar = ContextVar("generation_spans", default=None)


class TemplateFailed(Exception):
    """The template raised on a record (its own raise_exception or any jinja error)."""


def _environment(date: _dt.date):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records where the block's text lands in the output."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

        def _track(self, caller):
            text = caller()
            if (state := _spans.get()) is not None:
                parts, spans = state
                start = sum(map(len, parts))
                spans.append((start, start + len(text)))
            return text

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 (jinja's own signature trick, so namespace(self=...) works)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=Dict(), namespace=Namespace,
                       strftime_now=lambda fmt: _dt.datetime.combine(date, _dt.time()).strftime(fmt))
    return env


_REPLY = "MESHTRAIN-REPLY"  # an assistant turn's content: what the template writes after it ends the turn
_REASONING = ("reasoning_content", "thinking", "reasoning")  # names a message's reasoning goes by


def _message(message):
    """A message as transformers hands it to a template: None-valued keys dropped, its reasoning (under any of
    its names) under `reasoning_content` and `thinking` too."""
    if not isinstance(message, dict):
        return message
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING if k in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


@dataclass
class ChatTemplate:
    source: str  # where the template came from (the tokenizer folder's file, or --chat-template)
    text: str
    specials: dict  # the tokenizer's named special tokens: bos_token, eos_token, ...
    date: _dt.date
    tool_use: str | None = None  # where the folder's `tool_use` template is: transformers' for a record with tools

    def __post_init__(self):
        import jinja2
        self.blocks = bool(_GENERATION.search(self.text))
        self.sha256 = hashlib.sha256(self.text.encode()).hexdigest()
        env = _environment(self.date)
        try:
            self._t = env.from_string(self.text)
        except jinja2.TemplateError as e:
            raise UserError(f"the chat template {self.source} does not parse ({type(e).__name__}: {e}); fix it or "
                            "give another with --chat-template FILE") from None
        named = _named_roles(env.parse(self.text)) - set(ROLES)
        self.roles = (*ROLES, *sorted(named))  # the roles a message may have: the usual four, then the template's

    def render(self, messages: list, variables: dict | None = None, add_generation_prompt: bool = False,
               spans: list | None = None) -> str:
        """The conversation's text; `variables` are a record's (`variables_of`); `spans` (a list) receives the
        (start, end) of each generation block."""
        import jinja2
        messages = [_message(m) for m in messages]
        parts: list[str] = []
        token = _spans.set((parts, spans if spans is not None else []))
        given = {"tools": None, **self.specials, **(variables or {})}  # as transformers: kwargs over special tokens
        try:
            for part in self._t.generate(messages=messages, documents=None, add_generation_prompt=add_generation_prompt,
                                         **given):
                parts.append(part)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise TemplateFailed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]) from None
        finally:
            _spans.reset(token)
        return "".join(parts)

    def variables(self, rec: dict, where: str) -> dict:
        """variables_of(rec); one line where the record has tools and transformers renders it with another template
        (the tokenizer folder's `tool_use`, which its get_chat_template picks when tools are given)."""
        given = variables_of(rec, where)
        if self.tool_use and given["tools"] is not None:
            raise UserError(f"{where} has 'tools', which transformers renders with the tokenizer's 'tool_use' chat "
                            f"template ({self.tool_use}), not {self.source}; meshtrain renders every record with one "
                            "template: give it with --chat-template FILE and prepare records without tools apart")
        return given

    def assistant_spans(self, messages: list, variables: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(the whole conversation's text, the character spans of the assistant's turns in it)."""
        if self.blocks:
            spans: list = []
            return self.render(messages, variables, spans=spans), spans
        whole = self.render(messages, variables)
        spans = []
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and m.get("role") == "assistant"):
                continue
            prompt = self.render(messages[:i], variables, add_generation_prompt=True)
            upto = self.render(messages[:i + 1], variables) if i + 1 < len(messages) else whole
            if not (whole.startswith(upto) and upto.startswith(prompt)):
                raise PrefixMismatch(i)
            spans.append((len(prompt), len(upto.rstrip())))
        return whole, spans

    def end_of_turn(self, added: dict[str, int]) -> int | None:
        """The added token (`added`: text -> id) the template writes right after an assistant's reply (ChatML's
        <|im_end|>, Llama 3's <|eot_id|>); None when it writes none there or cannot render a user/assistant turn."""
        try:
            text = self.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _REPLY}])
        except TemplateFailed:
            return None
        at = text.rfind(_REPLY)
        rest = text[at + len(_REPLY):].lstrip() if at >= 0 else ""
        found = [t for t in added if t and rest.startswith(t)]
        return added[max(found, key=len)] if found else None


# apply_chat_template's own arguments (transformers 5.x) and the names it renders with: a chat_template_kwargs key
# among them is no template variable (TRL hands the dict to apply_chat_template, where it sets the argument or clashes)
NOT_VARIABLES = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                 "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                 "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


def variables_of(rec: dict, where: str) -> dict:
    """What a record gives its chat template beside the messages, as TRL 1.16 and transformers give it: `tools` (a
    list of objects, or JSON text of one: Parquet keeps a schema's key order only as text) and each entry of
    `chat_template_kwargs` as a variable."""
    tools, kwargs = rec.get("tools"), rec.get("chat_template_kwargs", {})
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise UserError(f"{where}: 'tools' is a string but not JSON ({e}); fix the record") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UserError(f"{where}: 'tools' is a JSON {type(tools).__name__}; give a list of objects (the functions' "
                        "JSON schemas), or JSON text of one")
    if not isinstance(kwargs, dict):
        raise UserError(f"{where}: 'chat_template_kwargs' is a JSON {type(kwargs).__name__}; give an object (the "
                        "chat template's variables by name)")
    if (clash := next((k for k in kwargs if k in NOT_VARIABLES), None)) is not None:
        raise UserError(f"{where}: chat_template_kwargs.{clash} names an argument of apply_chat_template, not a "
                        "variable of the chat template; remove it from chat_template_kwargs")
    return {"tools": tools, **kwargs}


def no_variables(rec: dict, where: str, what: str):
    """One line where a record that no chat template renders (`what` it is) carries fields only a template reads."""
    if (name := next((k for k in ("tools", "chat_template_kwargs") if rec.get(k) not in (None, [], {})), None)):
        raise UserError(f"{where}: '{name}' is read by a chat template, and {what} is not rendered with one; make "
                        "it a conversation (lists of messages), or remove the field")


class PrefixMismatch(Exception):
    """An assistant turn's rendering is not a prefix of the whole conversation's."""


def _reads_role(node) -> bool:
    """Whether an expression reads a role: `m.role`, `m['role']` or a variable named like `role`, filtered or not."""
    import jinja2.nodes as n
    return any(isinstance(x, n.Getattr) and x.attr == "role"
               or isinstance(x, n.Getitem) and isinstance(x.arg, n.Const) and x.arg.value == "role"
               or isinstance(x, n.Name) and "role" in x.name for x in (node, *node.find_all(n.Node)))


def _named_roles(ast) -> set[str]:
    """The strings a template compares a role against: `m.role == 'developer'`, `m['role'] in ['ipython', ...]`."""
    import jinja2.nodes as n
    names = set()
    for cmp in ast.find_all(n.Compare):
        sides = [cmp.expr, *(op.expr for op in cmp.ops)]
        if any(_reads_role(x) for x in sides):
            for x in sides:
                consts = x.items if isinstance(x, (n.List, n.Tuple)) else [x]
                names.update(c.value for c in consts if isinstance(c, n.Const) and isinstance(c.value, str))
    return names


_ANYWHERE, _AFTER, _NEXT = 0, 1, 2  # where a message's text is looked for: anywhere, after the previous
# message's (without moving past it: reasoning precedes its answer), the next in order (moving past it)


def _shown(m: dict, final: bool):
    """(field, text, where) of each text of a message that its rendering must show."""
    # Exempt: an earlier turn's reasoning (a field, or <think>...</think> heading the content), which Qwen3-style
    # templates drop on purpose; the conversation's final assistant turn keeps it. A system message may be anywhere:
    # templates fold it into a header or a user turn.
    where = _ANYWHERE if m.get("role") == "system" else _NEXT
    assistant = m.get("role") == "assistant"
    content, reasoning = m.get("content"), final and assistant
    if reasoning and (name := next((k for k in _REASONING if isinstance(m.get(k), str)), None)):
        yield name, m[name], _AFTER
    if isinstance(content, str):
        if assistant and "</think>" in content:
            if reasoning:
                yield "content's <think> part", content.split("</think>")[0].split("<think>")[-1], _AFTER
            content = content.split("</think>")[-1]
        yield "content", content, where
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                yield f"content[{j}].text", part["text"], where


def _find(text: str, piece: str, start: int) -> tuple[int, int]:
    """(where, length) of a piece in the text from `start`, as written or as `tojson` writes it; (-1, 0) if absent."""
    if (at := text.find(piece, start)) >= 0:
        return at, len(piece)
    escaped = json.dumps(piece, ensure_ascii=False)[1:-1]
    return (at, len(escaped)) if escaped != piece and (at := text.find(escaped, start)) >= 0 else (-1, 0)


def missing(messages: list, text: str) -> tuple[int, str] | None:
    """(message index, field) of the first message text, in order, that the rendering lacks; None when none."""
    at, last = 0, len(messages) - 1
    for i, m in enumerate(messages):
        for field, piece, where in _shown(m, i == last):
            if not (piece := piece.strip()):  # templates trim
                continue
            found, n = _find(text, piece, 0 if where == _ANYWHERE else at)
            if found < 0:
                return i, field
            if where == _NEXT:
                at = found + n
    return None


def _config(tokenizer_dir: Path) -> dict:
    """The folder's tokenizer_config.json; {} where it has none or it is not JSON."""
    try:
        conf = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return conf if isinstance(conf, dict) else {}


def specials_of(tokenizer_dir: Path) -> dict:
    """The tokenizer folder's named special tokens (tokenizer_config.json), as strings."""
    conf = _config(tokenizer_dir)
    out = {}
    for name in SPECIAL_NAMES:
        v = conf.get(name)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[name] = v
    return out


def template_text(tokenizer_dir: Path) -> tuple[str, str] | None:
    """(where, text) of a tokenizer folder's chat template: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates whose `default` is taken); None without one."""
    f = tokenizer_dir / "chat_template.jinja"
    if f.is_file():
        return str(f), f.read_text()
    t = _config(tokenizer_dir).get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return (str(tokenizer_dir / "tokenizer_config.json"), t) if isinstance(t, str) and t else None


def tool_use_of(tokenizer_dir: Path) -> str | None:
    """Where a tokenizer folder's `tool_use` chat template is, as transformers 5.x loads it: additional_chat_templates/
    tool_use.jinja, else (no template files, which replace the config's) tokenizer_config.json's named one."""
    f = tokenizer_dir / "additional_chat_templates" / "tool_use.jinja"
    if f.is_file():
        return str(f)
    if (tokenizer_dir / "chat_template.jinja").is_file() or any(f.parent.glob("*.jinja")):
        return None
    t = _config(tokenizer_dir).get("chat_template")
    named = isinstance(t, list) and any(isinstance(x, dict) and x.get("name") == "tool_use" for x in t)
    return f"{tokenizer_dir / 'tokenizer_config.json'}'s 'tool_use'" if named else None


def parse_date(date: str | None) -> _dt.date:
    try:
        return _dt.date.fromisoformat(date or DEFAULT_DATE)
    except ValueError:
        raise UserError(f"--date '{date}' is not a date; give YYYY-MM-DD, e.g. {DEFAULT_DATE}") from None


def load_template(tokenizer_json: Path | None, override: str | None, date: _dt.date) -> ChatTemplate | None:
    """The chat template conversations render with: --chat-template FILE, else the tokenizer folder's; None
    when neither has one (a trained tokenizer has none)."""
    folder = tokenizer_json.parent if tokenizer_json else None
    if override:
        p = Path(override)
        try:
            found = (str(p), p.read_text())
        except OSError as e:
            raise UserError(f"--chat-template '{override}' cannot be read ({e.strerror or e}); give a jinja "
                            "file") from None
    else:
        found = template_text(folder) if folder else None
    if found is None:
        return None
    return ChatTemplate(found[0], found[1], specials_of(folder) if folder else {}, date,
                        tool_use_of(folder) if folder and not override else None)
