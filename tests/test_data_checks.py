"""The start-of-run data checks (trainer/data/checks.py): a fine-tune from a model with a tokenizer of its own on
bytes, or on data of another vocabulary, is one line naming both and the fix (data.tokenizer_check=false when meant);
and `meshtrain plan` refuses what `meshtrain train` refuses when the data decides it, with the same line."""
import json
import os
from pathlib import Path

import pytest

from trainer.cli import main

FIX = Path(__file__).parent / "fixtures"
HF = FIX / "hf" / "head_dim_long_f32"  # a 2-layer Llama with a byte-level BPE tokenizer.json of 384 tokens
POLICY = FIX / "dpo" / "policy"  # an HF folder with its tokenizer (the DPO fixture's policy)
BASE = ["model.preset=tiny", "train.steps=1", "train.eval_every=0", "run.progress=false"]


def _prepare(src, out, *how) -> None:
    assert main(["prepare", str(src), "--out", str(out), "--no-progress", *how]) == 0


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Text, chat records and prepared data: with the HF folder's tokenizer, with that tokenizer written again with
    other formatting (the same vocabulary), with a trained one (another vocabulary), and DPO pairs and text with the
    policy's tokenizer."""
    d = tmp_path_factory.mktemp("checks")
    text = " ".join(f"word{i % 37} and more text {i}" for i in range(400))
    (d / "a.txt").write_text(text)
    (d / "chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    for sub, how in (("own", ["--tokenizer", str(HF)]), ("other", ["--train-tokenizer", "300"]),
                     ("policy", ["--tokenizer", str(POLICY)])):
        (d / sub).mkdir()
        _prepare(d / "a.txt", d / sub / f"{sub}.bin", "--heldout", "0.2", *how)
    (d / "again").mkdir()
    tok = json.loads((HF / "tokenizer.json").read_text())
    (d / "again" / "tokenizer.json").write_text(json.dumps(tok, indent=4, sort_keys=True))
    _prepare(d / "a.txt", d / "again" / "again.bin", "--heldout", "0.2", "--tokenizer", str(d / "again"))
    _prepare(FIX / "dpo" / "pairs_text.jsonl", d / "policy" / "pairs.bin", "--heldout", "0", "--tokenizer",
             str(POLICY))
    return d


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _line(capsys, argv) -> tuple[int, str]:
    """(exit status, the one error line) of an in-process meshtrain command."""
    capsys.readouterr()
    rc = main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("meshtrain: error: ")]
    assert len(err) <= 1, err
    return rc, err[0].removeprefix("meshtrain: error: ") if err else ""


def _passes(keys: list[str]) -> None:
    """The data checks that train and plan call pass (they run after resolve, as both run them)."""
    from trainer.ckpt.sources import resolve
    from trainer.config import load_config
    from trainer.data.checks import check_data
    check_data(resolve(load_config(BASE + keys), tensors=False))


def _same_refusal(capsys, keys: list[str]) -> str:
    """The line `train` and `plan` both refuse keys with (exit status 2 from both)."""
    got = {cmd: _line(capsys, [cmd, *BASE, *keys]) for cmd in ("train", "plan")}
    assert got["train"] == got["plan"] and got["train"][0] == 2 and got["train"][1], got
    return got["train"][1]


@pytest.mark.parametrize("source", ["builtin", "a.txt", "chats.jsonl"])
def test_a_fine_tune_on_bytes_is_one_line(data, tmp_path, capsys, monkeypatch, source):
    """Item 1: model.init_from an HF folder with a tokenizer and bytes data (builtin, a text file, unprepared records):
    one line naming the model's tokenizer and the prepare that fixes it, the working folder as it was; with
    data.tokenizer_check=false it is meant (the checks pass)."""
    monkeypatch.chdir(tmp_path)
    src = source if source == "builtin" else str(data / source)
    out = "builtin.bin" if source == "builtin" else str(Path(src).with_suffix(".bin"))
    before = _tree(tmp_path), _tree(data)
    keys = [f"model.init_from={HF}", f"data.source={src}", "run.dir=run"]
    msg = _same_refusal(capsys, keys)
    assert msg == (f"model.init_from '{HF}' has a tokenizer of its own ({HF}/tokenizer.json, 384 tokens) and "
                   f"data.source '{src}' is bytes, which it would read as its token ids 0-255; prepare the data with "
                   f"the model's tokenizer: meshtrain prepare {src} --out {out} --tokenizer {HF}, then train with "
                   f"data.source={out}; data.tokenizer_check=false trains on them anyway"), msg
    assert (_tree(tmp_path), _tree(data)) == before
    _passes(keys + ["data.tokenizer_check=false"])


def test_data_of_another_tokenizer_is_one_line(data, tmp_path, capsys, monkeypatch):
    """Item 2: data prepared with a trained 300-token BPE against the HF folder's 384: one line naming both tokenizers
    (vocabulary hashes) and the fix, the folder as it was. The same vocabulary in a tokenizer.json of other bytes
    (written with other formatting) is the same tokenizer; data.tokenizer_check=false says the mismatch is meant."""
    from tokenizers import Tokenizer
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path), _tree(data)
    keys = [f"model.init_from={HF}", "run.dir=run"]
    msg = _same_refusal(capsys, keys + [f"data.source={data / 'other' / 'other.bin'}"])
    sizes = [Tokenizer.from_file(str(f)).get_vocab_size(with_added_tokens=True)
             for f in (data / "other" / "tokenizer.json", HF / "tokenizer.json")]
    assert sizes == [300, 384]
    assert msg.startswith(f"data.source '{data / 'other' / 'other.bin'}' was prepared with the tokenizer "
                          f"{data / 'other' / 'tokenizer.json'}, 300 tokens (vocabulary ") and \
        f"and model.init_from '{HF}' has another, {HF}/tokenizer.json, 384 tokens (vocabulary " in msg and \
        msg.endswith(f"prepare the data with the model's tokenizer: meshtrain prepare {data / 'a.txt'} --out NEW.bin "
                     f"--tokenizer {HF}; data.tokenizer_check=false trains on them anyway"), msg
    assert (_tree(tmp_path), _tree(data)) == before
    again = (data / "again" / "tokenizer.json").read_bytes()
    assert again != (HF / "tokenizer.json").read_bytes()  # other bytes, the same vocabulary
    for ok in (["data.source=" + str(data / "own" / "own.bin")], ["data.source=" + str(data / "again" / "again.bin")],
               [f"data.source={data / 'other' / 'other.bin'}", "data.tokenizer_check=false"]):
        _passes(keys + ok)


def test_plan_refuses_what_train_refuses_for_its_data(data, tmp_path, capsys, monkeypatch):
    """Item 7: DPO on data without pairs, a model.seq_len too short for the longest pair, a mixture of two tokenizers,
    data.document_mask=true on one text file: train and plan say the same line."""
    monkeypatch.chdir(tmp_path)
    pol = data / "policy"
    dpo = [f"model.init_from={POLICY}", "train.objective=dpo", "run.dir=run"]
    cases = {
        "no pairs": (dpo + [f"data.source={pol / 'policy.bin'}"],
                     f"train.objective=dpo trains on preference pairs, and data.source '{pol / 'policy.bin'}' has "
                     "none;"),
        "seq_len": (dpo + [f"data.source={pol / 'pairs.bin'}", "model.seq_len=8"],
                    f"of data.source '{pol / 'pairs.bin'}' needs "),
        "tokenizers": ([f"data.mixture=[{data / 'own' / 'own.bin'}=0.5,{data / 'other' / 'other.bin'}=0.5]",
                        "run.dir=run"], "data.mixture mixes tokenizers: 'own' has tokenizer "),
        "documents": ([f"data.source={data / 'a.txt'}", "data.document_mask=true", "run.dir=run"],
                      f"data.document_mask=true needs documents, and data.source '{data / 'a.txt'}' has none"),
    }
    for name, (keys, want) in cases.items():
        msg = _same_refusal(capsys, keys)
        assert want in msg, (name, msg)
    assert not (tmp_path / "run").exists()
