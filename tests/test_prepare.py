"""`meshtrain prepare`: by-document split, EOT, sidecar, rerun no-op, dtype choice; training on the result with
eval_bpb, generate through the run's tokenizer, and each bad input."""
import hashlib
import json
import math
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY
from trainer.cli import main

HELDOUT = 0.3


def _docs(root):
    """12 documents, each with words no other one has, so a document's text is recognisable anywhere."""
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        words = [f"doc{i}_{w}" for w in rng.integers(0, 50, 300)]
        (root / f"d{i:02d}.txt").write_text(f"# document {i}\n" + " ".join(words) + "\n")
    return root


def _held(root) -> set[str]:
    """The held-out file names by the rule documented in trainer/data/batches.py: crc32 of the relative path."""
    return {p.name for p in root.iterdir() if zlib.crc32(p.name.encode()) % 10_000 < HELDOUT * 10_000}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prep")
    docs = _docs(tmp / "docs")
    out = tmp / "data" / "corpus.bin"
    assert main(["prepare", str(docs), "--out", str(out), "--train-tokenizer", "300", "--heldout", str(HELDOUT),
                 "--no-progress"]) == 0
    run = tmp / "run"
    assert main(["train", f"data.source={out}", *TINY, "train.steps=2", "train.batch_size=8", "train.eval_every=1",
                 "train.eval_batches=1", f"run.dir={run}"]) == 0
    return docs, out, run


def _segments(toks, eot):
    cuts = np.flatnonzero(toks == eot)
    assert len(cuts) and cuts[-1] == len(toks) - 1  # every document ends with EOT
    return np.split(toks, cuts + 1)[:-1]


def test_split_by_document_with_eot(prepared):
    from tokenizers import Tokenizer
    docs, out, _ = prepared
    meta = json.loads((out.parent / "corpus.bin.json").read_text())
    tok = Tokenizer.from_file(str(out.parent / "tokenizer.json"))
    toks = np.fromfile(out, np.uint16)
    cut, eot = meta["heldout_range"][0], tok.token_to_id("<|endoftext|>")
    texts = {p.name: p.read_text() for p in docs.iterdir()}
    held = _held(docs)
    assert 0 < len(held) < len(texts)  # the hash picks some documents, not none or all
    train_text = tok.decode(toks[:cut].tolist(), skip_special_tokens=False)
    for name, text in texts.items():
        marker = text.split()[3]  # a word only this document has
        assert (marker in train_text) == (name not in held), name
    for part, names in ((toks[:cut], sorted(set(texts) - held)), (toks[cut:], sorted(held))):
        segs = _segments(part, eot)
        assert [tok.decode(s[:-1].tolist()) for s in segs] == [texts[n] for n in names]


def test_sidecar(prepared):
    docs, out, _ = prepared
    meta = json.loads((out.parent / "corpus.bin.json").read_text())
    held = _held(docs)
    size = {p.name: p.stat().st_size for p in docs.iterdir()}
    n = out.stat().st_size // 2
    tok_file = out.parent / "tokenizer.json"
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 300
    assert meta["tokenizer"] == {"path": "tokenizer.json", "trained": True,
                                 "sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest()}
    assert meta["documents"] == {"train": 12 - len(held), "heldout": len(held)}
    assert meta["tokens"]["total"] == n and meta["heldout_range"] == [meta["tokens"]["train"], n]
    assert meta["bytes_per_token"] == pytest.approx(sum(size.values()) / n)
    assert meta["heldout_bytes_per_token"] == pytest.approx(
        sum(size[k] for k in held) / (n - meta["heldout_range"][0]))


def test_rerun_is_a_noop_until_an_input_changes(tmp_path, capsys):
    docs = _docs(tmp_path / "docs")
    out = tmp_path / "d.bin"
    args = ["prepare", str(docs), "--out", str(out), "--train-tokenizer", "280", "--no-progress"]
    assert main(args) == 0
    stamp = out.stat().st_mtime_ns, (tmp_path / "d.bin.json").read_text()
    capsys.readouterr()
    assert main(args) == 0
    assert "skipped" in capsys.readouterr().out
    assert (out.stat().st_mtime_ns, (tmp_path / "d.bin.json").read_text()) == stamp
    (docs / "d03.txt").write_text("changed\n")
    assert main(args) == 0
    assert "skipped" not in capsys.readouterr().out
    assert json.loads((tmp_path / "d.bin.json").read_text())["inputs_sha256"] != json.loads(stamp[1])["inputs_sha256"]


def test_dtype_from_vocab_size_and_given_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("w1 w70000 w65536")
    for vocab_n, dtype in ((1000, "uint16"), (70001, "uint32")):
        vocab = {f"w{i}": i for i in range(vocab_n) if i not in (3, 5)} | {"</s>": 3, "[UNK]": 5}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(tmp_path / f"t{vocab_n}.json"))
        out = tmp_path / f"{vocab_n}.bin"
        assert main(["prepare", str(tmp_path / "docs"), "--out", str(out), "--tokenizer",
                     str(tmp_path / f"t{vocab_n}.json"), "--no-progress"]) == 0
        meta = json.loads((tmp_path / f"{vocab_n}.bin.json").read_text())
        assert meta["dtype"] == dtype and meta["eot_id"] == 3
        # a lone document trains; w65536 and w70000 need 32 bits
        want = [1, 70000, 65536, 3] if vocab_n > 70000 else [1, 5, 5, 3]
        assert np.fromfile(out, dtype).tolist() == want


def test_text_records_and_exchanges_are_tokenizer_text_then_eot(tmp_path, capsys):
    """With a tokenizer whose post-processor puts a BOS first (tests/fixtures/generate's), a text record and an
    exchange without a template are transformers' tokenizer(text) (the fixture's reference.json), then the
    end-of-text token; the exchange's BOS is its prompt's (not counted), its end-of-text the completion's. A rerun
    is up to date."""
    fix = Path(__file__).parent / "fixtures" / "generate"
    (plain,) = [c for c in json.loads((fix / "reference.json").read_text())["cases"] if c["name"] == "plain"]
    (tmp_path / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # without the folder's chat template
        shutil.copy(fix / name, tmp_path / "tok")
    text, cut = plain["prompt"], plain["prompt"].index(" The")
    (tmp_path / "r.jsonl").write_text(json.dumps({"text": text}) + "\n"
                                      + json.dumps({"prompt": text[:cut], "completion": text[cut:]}) + "\n")
    out = tmp_path / "o" / "d.bin"
    args = ["prepare", str(tmp_path / "r.jsonl"), "--out", str(out), "--tokenizer", str(tmp_path / "tok"),
            "--heldout", "0", "--no-progress"]
    assert main(args) == 0
    want = plain["prompt_ids"] + [0]  # <|begin_of_text|> ... <|endoftext|>
    assert np.fromfile(out, np.uint16).tolist() == want + want
    mask = np.fromfile(out.with_name("d.bin.mask"), np.uint8)
    assert mask[:len(want)].all() and mask[len(want)] == 0 and mask[-1] == 1, mask
    assert json.loads(out.with_name("d.bin.json").read_text())["text_specials"] == {"before": [1024], "after": []}
    capsys.readouterr()
    assert main(args) == 0 and "skipped" in capsys.readouterr().out


def test_training_logs_eval_bpb(prepared):
    docs, out, run = prepared
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out.parent / "tokenizer.json"))
    held = sorted(_held(docs))
    # bits per byte of the held-out documents, counted here: their bytes over their tokens (each + EOT)
    n_bytes = sum((docs / n).stat().st_size for n in held)
    n_toks = sum(len(tok.encode((docs / n).read_text()).ids) + 1 for n in held)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in recs if "eval_loss" in r]  # step 1: an eval-only line; step 2: the logged last step
    assert len(ev) == 2 and all(r["eval_bpb"] == pytest.approx(r["eval_loss"] / math.log(2) * n_toks / n_bytes) for r in ev)
    cfg = (run / "config.yaml").read_text()
    assert "vocab_size: 300" in cfg and f"tokenizer: {out.parent / 'tokenizer.json'}" in cfg


def test_bits_per_byte_by_hand():
    from trainer.data.batches import bits_per_byte
    assert bits_per_byte(math.log(8), 1.0) == pytest.approx(3.0)  # 8 equally likely bytes: 3 bits each
    assert bits_per_byte(math.log(8), 1.5) == pytest.approx(2.0)  # a token of 1.5 bytes carries 3 bits


def test_generate_decodes_with_the_runs_tokenizer(prepared, capsys):
    import jax
    from tokenizers import Tokenizer
    from models.decode import generate
    from trainer.ckpt.params import load_params
    from trainer.config import model_config
    _, out, run = prepared
    tok = Tokenizer.from_file(str(out.parent / "tokenizer.json"))
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "doc1_", "--tokens", "6", "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    params, cfg = load_params(str(run), None, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    ids = tok.encode("doc1_").ids
    new = [int(t[0]) for t in generate(model_config(cfg), params, np.array([ids], np.int32), 6)]
    assert text == "doc1_" + tok.decode(new, skip_special_tokens=False) + "\n"


@pytest.mark.parametrize("case", ["empty folder", "empty file", "text as tokenizer", "folder without tokenizer"])
def test_bad_input(tmp_path, capsys, case):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("some text")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.txt").write_text("")
    src, how = {"empty folder": ("empty", ["--train-tokenizer", "300"]),
                "empty file": ("empty.txt", ["--train-tokenizer", "300"]),
                "text as tokenizer": ("docs", ["--tokenizer", str(tmp_path / "docs" / "a.txt")]),
                "folder without tokenizer": ("docs", ["--tokenizer", str(tmp_path / "docs")])}[case]
    out = tmp_path / "out" / "d.bin"
    assert main(["prepare", str(tmp_path / src), "--out", str(out), *how]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtrain: error:"), err
    assert ("empty" in err[0]) if "empty" in case else ("not a tokenizer" in err[0])
    assert not (tmp_path / "out").exists()


def test_vocab_larger_than_model(prepared, tmp_path, capsys):
    _, out, _ = prepared
    assert main(["train", f"data.source={out}", *TINY, "model.vocab_size=256", f"run.dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "300" in err[0] and "model.vocab_size=256" in err[0], err


def test_hf_export_carries_the_runs_tokenizer(prepared, tmp_path):
    """A run on prepared data exports to an HF folder with its tokenizer.json, a tokenizer_config.json naming
    the end-of-text token, and that token as generation's eos."""
    import json
    _, out, run = prepared
    hf = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--out", str(hf), "--format", "hf"]) == 0
    assert (hf / "tokenizer.json").read_bytes() == (out.parent / "tokenizer.json").read_bytes()
    eot = json.loads(out.with_name(out.name + ".json").read_text())["eot_id"]
    conf = json.loads((hf / "tokenizer_config.json").read_text())
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(hf / "tokenizer.json")).token_to_id(conf["eos_token"]) == eot
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == eot


def test_document_index_matches_each_documents_token_count(prepared):
    """The index (sidecar `document_index`) against each document encoded alone, in the order written
    (train documents, then held-out), plus its end-of-text token."""
    from tokenizers import Tokenizer
    from trainer.data.batches import load_corpus
    from trainer.data.prepare import collect
    docs, out, _ = prepared
    meta = json.loads((out.parent / "corpus.bin.json").read_text())
    assert meta["document_index"] == {"path": "corpus.bin.docs", "dtype": "uint64", "entries": 13}
    index = np.fromfile(out.parent / "corpus.bin.docs", np.uint64).astype(np.int64)
    tok = Tokenizer.from_file(str(out.parent / "tokenizer.json"))
    train, held, _ = collect([str(docs)], HELDOUT)
    counts = [len(tok.encode(d.path.read_text(), add_special_tokens=False).ids) + 1 for d in train + held]
    np.testing.assert_array_equal(np.diff(index), counts)
    assert index[0] == 0 and index[-1] == meta["tokens"]["total"] and index[len(train)] == meta["heldout_range"][0]
    np.testing.assert_array_equal(load_corpus(str(out)).documents(), index)


def test_an_older_bin_without_an_index_finds_documents_by_its_eot(prepared, tmp_path, caplog):
    import logging
    from trainer.data.batches import load_corpus
    _, out, _ = prepared
    old = tmp_path / "old.bin"
    shutil.copy(out, old)
    meta = json.loads((out.parent / "corpus.bin.json").read_text())
    index = np.fromfile(out.parent / "corpus.bin.docs", np.uint64).astype(np.int64)
    del meta["document_index"]
    (tmp_path / "old.bin.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.INFO, logger="trainer.data.batches"):
        found = load_corpus(str(old)).documents()
    np.testing.assert_array_equal(found, index)
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.data.batches"]
    assert len(lines) == 1 and "no document index" in lines[0] and "12 documents" in lines[0], lines


def test_files_read_as_bytes_are_one_document_each(tmp_path):
    from trainer.data.batches import load_corpus
    root = _docs(tmp_path / "docs")
    c = load_corpus(str(root), HELDOUT)
    sizes = [len(b) for b in (p.read_bytes() for p in sorted(root.iterdir()) if p.name not in _held(root))]
    sizes += [len(b) for b in (p.read_bytes() for p in sorted(root.iterdir()) if p.name in _held(root))]
    np.testing.assert_array_equal(np.diff(c.documents()), sizes)
    assert c.documents()[-1] == len(c.whole)
    assert load_corpus(str(root / "d00.txt")).documents() is None  # a single text file: no documents
