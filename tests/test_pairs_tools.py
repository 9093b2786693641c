"""A record's `tools` and `chat_template_kwargs` reach the chat template as TRL 1.16 and transformers pass them:
conversational preference pairs tokenized as TRL's DPOTrainer tokenizes them (the prompt and both answers rendered with
both), conversations as `apply_chat_template(messages, tools=..., **chat_template_kwargs)` renders them
(tests/fixtures/dpo, whose template reads the tools, `reasoning_effort` and `enable_thinking`), and a field of the
wrong type, or one no template reads, one line."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from trainer.cli import main

FIX = Path(__file__).parent / "fixtures" / "dpo"
REF = json.loads((FIX / "reference.json").read_text())


def _prepare(src, out, *more) -> int:
    return main(["prepare", str(src), "--out", str(out), "--tokenizer", str(FIX / "policy"), "--no-progress",
                 "--heldout", "0", *more])


def _read(out: Path):
    meta = json.loads(Path(f"{out}.json").read_text())
    toks = np.fromfile(out, meta["dtype"])
    mask = np.fromfile(out.parent / meta["loss_mask"]["path"], np.uint8)
    idx = np.fromfile(out.parent / meta["document_index"]["path"], np.uint64).astype(int)
    return meta, toks, mask, idx


def test_pairs_with_tools_and_template_kwargs_are_tokenized_as_trl(tmp_path):
    """The prompt ids (tools header, `reasoning_effort` line, with `enable_thinking=false` the empty think block that
    TRL's common prefix keeps), each answer's ids and the completion masks are TRL's."""
    ref = REF["tools"]
    assert _prepare(FIX / "pairs_tools.jsonl", tmp_path / "p.bin", "--max-length", str(ref["max_length"])) == 0
    meta, toks, mask, idx = _read(tmp_path / "p.bin")
    assert meta["pairs"]["train"] == len(ref["tokens"]) == 3
    for i, t in enumerate(ref["tokens"]):
        for j, answer in enumerate(("chosen_ids", "rejected_ids")):
            a, b = idx[2 * i + j], idx[2 * i + j + 1]
            assert toks[a:b].tolist() == t["prompt_ids"] + t[answer], (i, answer)
            assert mask[a:b].tolist() == [0] * len(t["prompt_ids"]) + [1] * len(t[answer]), (i, answer)


def test_conversations_with_template_kwargs_are_transformers(tmp_path):
    """Each conversation's ids are apply_chat_template's with its tools and chat_template_kwargs; the first one's
    counted tokens are its reply and end-of-turn (the think block the template writes before it is the prompt's)."""
    from tokenizers import Tokenizer
    assert _prepare(FIX / "conversations_tools.jsonl", tmp_path / "c.bin") == 0
    _, toks, mask, idx = _read(tmp_path / "c.bin")
    want = REF["conversations"]
    assert len(idx) - 1 == len(want)
    for i, ids in enumerate(want):
        assert toks[idx[i]:idx[i + 1]].tolist() == ids, i
    tok = Tokenizer.from_file(str(FIX / "policy" / "tokenizer.json"))
    first = slice(idx[0], idx[1])
    assert tok.decode(toks[first][mask[first] == 1].tolist(), skip_special_tokens=False) == "Snow.<|im_end|>"


def test_parquet_conversations_with_template_kwargs_prepare_as_jsonl(tmp_path):
    """A Parquet struct column of chat_template_kwargs gives each row every record's keys (None where a record lacks
    one): the same ids and mask as JSONL (the second conversation has no enable_thinking)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    recs = [json.loads(line) for line in (FIX / "conversations_tools.jsonl").read_text().splitlines()]
    rows = [{**r, "tools": r["tools"] if isinstance(r["tools"], str) else json.dumps(r["tools"])} for r in recs]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    assert pa.Table.from_pylist(rows).to_pylist()[1]["chat_template_kwargs"]["enable_thinking"] is None
    for src in (FIX / "conversations_tools.jsonl", tmp_path / "c.parquet"):
        assert _prepare(src, tmp_path / f"{src.suffix[1:]}.bin") == 0
    (_, *a), (_, *b) = _read(tmp_path / "jsonl.bin"), _read(tmp_path / "parquet.bin")
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


CHAT = {"prompt": [{"role": "user", "content": "Hi."}], "chosen": [{"role": "assistant", "content": "Hello."}],
        "rejected": [{"role": "assistant", "content": "Go."}]}
TEXT = {"prompt": "Hi.", "chosen": " Hello.", "rejected": " Go."}
BAD = [
    ({**CHAT, "tools": {"type": "function"}}, r"'tools' is a JSON dict; give a list of objects"),
    ({**CHAT, "tools": "[{\"type\": "}, r"'tools' is a string but not JSON"),
    ({**CHAT, "chat_template_kwargs": ["enable_thinking"]}, r"'chat_template_kwargs' is a JSON list; give an object"),
    ({**CHAT, "chat_template_kwargs": {"add_generation_prompt": True}},
     r"chat_template_kwargs.add_generation_prompt names an argument of apply_chat_template"),
    ({**TEXT, "tools": [{"type": "function"}]}, r"'tools' is read by a chat template, and a text pair is not"),
    ({"text": "plain", "chat_template_kwargs": {"enable_thinking": False}},
     r"'chat_template_kwargs' is read by a chat template, and a text record is not"),
    ({"messages": CHAT["prompt"] + CHAT["chosen"], "chat_template_kwargs": "low"},
     r"'chat_template_kwargs' is a JSON str; give an object"),
]


@pytest.mark.parametrize("record,message", BAD)
def test_a_field_for_the_template_of_the_wrong_kind_is_one_line(tmp_path, capsys, record, message):
    good = CHAT if "chosen" in record else {"messages": CHAT["prompt"] + CHAT["chosen"]}
    (tmp_path / "r.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    assert _prepare(tmp_path / "r.jsonl", tmp_path / "r.bin", "--max-length", "64") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "r.jsonl:2" in err and re.search(message, err), err
    assert not list(tmp_path.glob("r.bin*"))


@pytest.mark.parametrize("layout", ["file", "config"])
def test_tools_where_transformers_picks_the_tool_use_template_is_one_line(tmp_path, capsys, layout):
    """transformers renders a record with tools with the folder's `tool_use` template (get_chat_template), which
    meshtrain does not: one line, unless --chat-template names the one to use."""
    import shutil
    folder, text = tmp_path / "tok", (FIX / "policy" / "chat_template.jinja").read_text()
    folder.mkdir()
    shutil.copy(FIX / "policy" / "tokenizer.json", folder)
    conf = json.loads((FIX / "policy" / "tokenizer_config.json").read_text())
    if layout == "file":
        shutil.copy(FIX / "policy" / "chat_template.jinja", folder)
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text(text)
    else:
        conf["chat_template"] = [{"name": "default", "template": text}, {"name": "tool_use", "template": text}]
    (folder / "tokenizer_config.json").write_text(json.dumps(conf))
    prep = ["prepare", str(FIX / "pairs_tools.jsonl"), "--out", str(tmp_path / "p.bin"), "--tokenizer", str(folder),
            "--no-progress", "--heldout", "0", "--max-length", "1024"]
    assert main(prep) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pairs_tools.jsonl:1 has 'tools'" in err and "'tool_use'" in err, err
    assert main([*prep, "--chat-template", str(FIX / "policy" / "chat_template.jinja")]) == 0
