"""No silent data loss in prepare: a role outside the usual four and the template's own is refused, a message text
the template leaves out of its rendering is refused (earlier turns' reasoning exempt), a record without a counted
token is counted (an error with --require-counted), each refusal one line naming file, line and field, the output
left as it was."""
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from trainer.data.prepare import prepare
from trainer.errors import UserError

F = Path(__file__).parent / "fixtures" / "chat"
ROOT = Path(__file__).resolve().parents[1]


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


GOOD = {"messages": _msgs(("user", "hi"), ("assistant", "hello"))}


def _prepare(tmp: Path, records: list, template: str | None = None, suffix=".jsonl", **kw):
    """Prepare the records (with a template text, else the fixture tokenizer's ChatML) into tmp/o/d.bin."""
    tmp.mkdir(parents=True, exist_ok=True)
    src = tmp / f"chats{suffix}"
    if suffix == ".jsonl":
        src.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(records), src)
    if template is not None:
        (tmp / "t.jinja").write_text(template)
    kw.setdefault("heldout", 0)
    return src, prepare([str(src)], str(tmp / "o" / "d.bin"), tokenizer=str(F / "tokenizer"), show_progress=False,
                        chat_template=template and str(tmp / "t.jinja"), **{"log": lambda *a: None, **kw})


def _text(tmp: Path, meta: dict) -> str:
    """The prepared tokens of tmp/o/d.bin, decoded."""
    from tokenizers import Tokenizer
    ids = np.fromfile(tmp / "o" / "d.bin", meta["dtype"]).tolist()
    return Tokenizer.from_file(str(F / "tokenizer" / "tokenizer.json")).decode(ids, skip_special_tokens=False)


def _refused(tmp: Path, records: list, template: str | None = None, suffix=".jsonl", **kw) -> tuple[Path, str]:
    with pytest.raises(UserError) as e:
        _prepare(tmp, records, template, suffix, **kw)
    assert not (tmp / "o").exists() or not list((tmp / "o").iterdir())  # nothing written, nothing staged left
    return tmp / f"chats{suffix}", str(e.value)


@pytest.mark.parametrize("suffix,at", [(".jsonl", ":3"), (".parquet", " row 3")])
def test_an_unknown_role_names_the_line_or_row_and_the_field(tmp_path, suffix, at):
    bot = {"messages": _msgs(("user", "hi"), ("assistant", "hello"), ("bot", "I am a bot"), ("assistant", "ok"))}
    src, err = _refused(tmp_path, [GOOD, GOOD, bot], suffix=suffix)
    assert err.startswith(f"{src}{at}: messages[2].role is 'bot': neither system, user, assistant, tool nor"), err
    assert "\n" not in err and "--chat-template" in err


NAMED = """{% for m in messages %}{% set role = m.role %}{% if m['role'] == 'developer' %}<|im_start|>developer
{{ m['content'] }}<|im_end|>
{% elif m.role in ['user', 'ipython'] or role == 'critic' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}
{% endif %}{% endfor %}"""


def test_the_roles_a_template_compares_against_are_accepted_and_named(tmp_path):
    rec = {"messages": _msgs(("developer", "be terse"), ("user", "hi"), ("ipython", "42"), ("critic", "too long"),
                             ("assistant", "ok"))}
    _, meta = _prepare(tmp_path / "a", [rec], NAMED)
    text = _text(tmp_path / "a", meta)
    for role, content in (("developer", "be terse"), ("ipython", "42"), ("critic", "too long")):
        assert f"<|im_start|>{role}\n{content}<|im_end|>" in text, text
    bot = {"messages": rec["messages"][:4] + [{"role": "bot", "content": "x"}] + rec["messages"][4:]}
    _, err = _refused(tmp_path / "b", [bot], NAMED)
    assert ":1: messages[4].role is 'bot'" in err and "names (critic, developer, ipython);" in err, err


# a Llama-3.1-style template: an assistant turn with tool calls shows the calls only; list content read as text only
# when it is a string (Qwen3's `content = ''` otherwise); only the last 4 messages
DROPS = """{% for m in messages[-4:] %}<|im_start|>{{ m.role }}
{% generation %}{% if m.tool_calls %}{{ m.tool_calls[0].function | tojson }}{% elif m.content is string %}\
{{ m.content }}{% endif %}<|im_end|>{% endgeneration %}
{% endfor %}"""
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


@pytest.mark.parametrize("case,messages,field", [
    ("content beside tool calls", _msgs(("user", "weather?")) + [
        {"role": "assistant", "content": "Let me look that up.", "tool_calls": CALL}] + _msgs(
        ("tool", "14 C"), ("assistant", "14 C in Paris.")), "messages[1].content"),
    ("a text part", [{"role": "user", "content": [{"type": "text", "text": "What is on this picture?"},
                                                  {"type": "image", "url": "cat.png"}]}] + _msgs(
        ("assistant", "A cat.")), "messages[0].content[0].text"),
    ("turns before the last four", _msgs(*[(("user", "assistant")[i % 2], f"turn number {i}") for i in range(6)]),
     "messages[0].content"),
])
def test_a_message_text_the_template_leaves_out_is_refused(tmp_path, case, messages, field):
    src, err = _refused(tmp_path, [GOOD, {"messages": messages}], DROPS)
    assert err.startswith(f"{src}:2: {field} is missing from the text the chat template"), (case, err)
    assert "--chat-template" in err and "\n" not in err


# Qwen3's reasoning rule, with generation blocks: an assistant turn after the last user turn shows its reasoning (a
# `reasoning_content` string, or <think>...</think> at the head of its content), earlier ones show the answer only
QWEN3 = """{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for m in messages[::-1] %}{% if ns.last_query == messages|length - 1 and m.role == 'user' %}\
{% set ns.last_query = messages|length - 1 - loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- set content = m.content if m.content is string else '' %}
{%- if m.role == 'assistant' %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
{%- if m.reasoning_content is not string and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' }}{% generation %}
{%- if loop.index0 > ns.last_query and R1 is not defined %}\
{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{% endif %}
{{- content.lstrip('\\n') + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}
{%- else %}{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}"""
R1 = "{% set R1 = true %}" + QWEN3  # DeepSeek-R1's rule: every turn's reasoning dropped, the final one's too


def test_earlier_reasoning_may_be_dropped_the_final_turns_may_not(tmp_path):
    field = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "reasoning_content": "two and two", "content":
             "4"}, {"role": "user", "content": "and 3+3?"},
             {"role": "assistant", "reasoning_content": "three and three", "content": "6"}]
    inline = [{"role": "assistant", "content": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"}
              if m["role"] == "assistant" else m for m in field]
    for name, messages in (("field", field), ("inline", inline)):
        _, meta = _prepare(tmp_path / name, [{"messages": messages}], QWEN3)
        text = _text(tmp_path / name, meta)  # the earlier turn's reasoning dropped, the final one's kept
        assert "two and two" not in text and "<think>\nthree and three\n</think>\n\n6<|im_end|>" in text, text
    src, err = _refused(tmp_path / "r1-field", [{"messages": field}], R1)
    assert err.startswith(f"{src}:1: messages[3].reasoning_content is missing"), err
    src, err = _refused(tmp_path / "r1-inline", [{"messages": inline}], R1)
    assert err.startswith(f"{src}:1: messages[3].content's <think> part is missing"), err


# folds the system message into the first user turn, trims content, writes a tool result as JSON text (tojson)
FOLDS = """{% for m in messages %}{% if m.role == 'user' %}[INST] {% if loop.index0 == 1 %}<<SYS>>
{{ messages[0].content | trim }}
<</SYS>>

{% endif %}{{ m.content | trim }} [/INST]{% elif m.role == 'tool' %}\
[TOOL_RESULTS] {"content": {{ m.content | tojson }}}[/TOOL_RESULTS]{% elif m.role == 'assistant' %}\
{% generation %} {{ m.content | trim }}</s>{% endgeneration %}{% endif %}{% endfor %}"""


def test_what_a_template_moves_trims_or_escapes_is_still_found(tmp_path):
    messages = _msgs(("system", "Answer in French."), ("user", "  Weather in Paris?\n"), ("tool", '{"temp": "14 C"}'),
                     ("assistant", "Il fait 14 C."))
    _, meta = _prepare(tmp_path, [{"messages": messages}], FOLDS)
    assert meta["records"]["conversations"] == 1 and meta["loss_mask"]["counted"]["train"] > 0


USER_ONLY = {"messages": _msgs(("user", "just a question"))}


def test_a_record_without_a_counted_token_is_counted_or_with_require_counted_refused(tmp_path):
    said = []
    src, meta = _prepare(tmp_path / "keep", [GOOD, GOOD, USER_ONLY, GOOD], log=said.append)
    assert meta["records"]["uncounted"] == 1 and meta["documents"]["train"] == 4
    assert f"1 records kept without a counted token (the first: {src}:3; --require-counted" in said[0], said
    before = {f.name: f.read_bytes() for f in (tmp_path / "keep" / "o").iterdir()}
    with pytest.raises(UserError) as e:  # the same inputs again: not skipped as up to date, refused
        _prepare(tmp_path / "keep", [GOOD, GOOD, USER_ONLY, GOOD], require_counted=True)
    assert str(e.value).startswith(f"{src}:3: messages gives no token the loss counts"), e.value
    assert {f.name: f.read_bytes() for f in (tmp_path / "keep" / "o").iterdir()} == before


def test_a_split_without_a_counted_token_is_refused_for_what_it_is(tmp_path):
    src, err = _refused(tmp_path / "alone", [USER_ONLY], heldout=0.05)  # the default --heldout holds out none of one
    assert "no assistant turn" in err and f"{src}:1" in err and "held out none" not in err, err

    def held(rec):  # the split's rule: CRC-32 of the record's JSON, keys sorted, mod 10,000 below 0.3 x 10,000
        return zlib.crc32(json.dumps(rec, sort_keys=True, separators=(",", ":")).encode()) % 10_000 < 3000
    variants = [{"messages": _msgs(("user", f"question {i}"))} for i in range(40)]
    asked = next(r for r in variants if held(r))
    trained = next(r for r in variants if not held(r))  # a training record without a counted token, first
    goods = [r for r in ({"messages": _msgs(("user", f"hi {i}"), ("assistant", "hello"))} for i in range(40))
             if not held(r)][:3]
    # each message names a record of the split it is about, not the file's first uncounted one (of the other split)
    src, err = _refused(tmp_path / "held", [trained, *goods, asked], heldout=0.3)
    assert err.startswith("the loss mask counts no token of the held-out split (1 records)"), err
    assert f"{src}:5" in err and f"{src}:1" not in err, err
    src, err = _refused(tmp_path / "train", [asked, trained], heldout=0.3)
    assert err.startswith("the loss mask counts no token of the training split"), err
    assert f"{src}:2" in err and f"{src}:1" not in err, err


def test_a_refused_prepare_through_the_cli_is_one_line_and_leaves_the_previous_output(tmp_path):
    _prepare(tmp_path, [GOOD, {"messages": _msgs(("user", "a"), ("assistant", "b"))}])
    before = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps({"messages": _msgs(("user", "x"), ("bot", "y"))}) + "\n")
    r = subprocess.run([sys.executable, "-m", "trainer.cli", "prepare", str(bad), "--out",
                        str(tmp_path / "o" / "d.bin"), "--tokenizer", str(F / "tokenizer"), "--heldout", "0",
                        "--no-progress"],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"meshtrain: error: {bad}:2: messages[1].role is 'bot'"), lines
    assert {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()} == before
