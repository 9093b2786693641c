"""Sharded prepare (`meshtrain prepare SOURCES --out DIR/`, trainer/data/shards.py): the same bytes with 1 worker,
2 workers and on a Ray cluster started here on localhost; a prepare killed mid-way and run again redoes only the
shards it had not finished; a finished one run again writes nothing."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from trainer.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _sources(tmp: Path, files: int = 40, words: int = 400) -> Path:
    """A folder of text files of varied lengths and a JSONL file of text records."""
    rng = np.random.default_rng(1)
    src = tmp / "src"
    (src / "sub").mkdir(parents=True)
    for i in range(files):
        where = src / "sub" if i % 3 == 0 else src
        (where / f"f{i:03d}.txt").write_text(" ".join(f"w{w}" for w in rng.integers(0, 300, words + 37 * i)) + "\n")
    (src / "records.jsonl").write_text("".join(json.dumps({"text": f"record {i} " + "z" * (i % 50)}) + "\n"
                                               for i in range(300)))
    return src


def _args(src: Path, out: Path, *more: str) -> list[str]:
    return ["prepare", str(src), "--out", str(out), "--train-tokenizer", "400", "--shard-mb", "0.01",
            "--no-progress", *more]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_worker_two_workers_and_ray_write_the_same_bytes(tmp_path, capsys):
    src = _sources(tmp_path)
    assert main(_args(src, tmp_path / "one", "--workers", "1")) == 0
    assert main(_args(src, tmp_path / "two", "--workers", "2")) == 0
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    manifest = json.loads(one["manifest.json"])
    assert len(manifest["shards"]) >= 4 and manifest["shards"][-1]["loss_mask"] is False
    texts, inputs = sum(p.stat().st_size for p in src.rglob("*.txt")), [e["input_bytes"] for e in manifest["shards"]]
    records = inputs[int(np.searchsorted(np.cumsum(inputs), texts)) + 1:]  # the shards after the text files'
    assert len(records) >= 2 and sum(records) == (src / "records.jsonl").stat().st_size  # the JSONL file cut
    assert sum(s["tokens"]["total"] for s in manifest["shards"]) == manifest["tokens"]["total"] > 0
    assert one == two
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    subprocess.run(ray + ["start", "--head", "--num-cpus", "2", "--port", str(port), "--include-dashboard", "false"],
                   check=True, capture_output=True, env=env)
    try:
        assert main(_args(src, tmp_path / "ray", "--ray", f"127.0.0.1:{port}")) == 0
    finally:
        subprocess.run(ray + ["stop", "--force"], capture_output=True, env=env)
    assert _files(tmp_path / "ray") == one
    assert "on the Ray cluster" in capsys.readouterr().out


@pytest.mark.slow
def test_a_killed_prepare_redoes_only_unfinished_shards(tmp_path):
    """SIGKILL once two shards are written; the rerun gives a clean run's bytes and leaves the finished shards'
    files alone (the same inodes and times); run again, it writes nothing."""
    src = _sources(tmp_path, files=120, words=3000)
    assert main(_args(src, tmp_path / "clean", "--workers", "1")) == 0
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "import sys; from trainer.cli import main; sys.exit(main(sys.argv[1:]))",
           *_args(src, out, "--workers", "1")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (out / "shard-00001.bin.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "killed too late to test a rerun"
    done = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-*") if not p.name.endswith("tmp")}
    assert "shard-00000.bin.json" in done
    assert main(_args(src, out, "--workers", "2")) == 0
    assert _files(out) == _files(tmp_path / "clean")
    for name, stamp in done.items():
        p = out / name
        if (out / (name.split(".bin")[0] + ".bin.json")).name in done:  # a finished shard: untouched
            assert (p.stat().st_ino, p.stat().st_mtime_ns) == stamp, name
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(_args(src, out, "--workers", "2")) == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_workers_need_a_folder_and_ray_is_one_line(tmp_path, monkeypatch, capsys):
    src = _sources(tmp_path, files=2)
    assert main(["prepare", str(src), "--out", str(tmp_path / "x.bin"), "--train-tokenizer", "300", "--workers",
                 "2"]) != 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"meshtrain: error: --workers and --ray write shards into a folder; give --out a folder instead of "
        f"'{tmp_path / 'x.bin'}'"]
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    assert main(_args(src, tmp_path / "r", "--ray", "auto")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtrain: error: --ray needs Ray, which is not installed; pip "), err
    assert not (tmp_path / "r").exists()


def _documents(folder: Path) -> dict[str, list[bytes]]:
    """Each split's documents (token bytes), shard after shard, as the shards' document indexes cut them."""
    out = {"train": [], "heldout": []}
    for e in json.loads((folder / "manifest.json").read_text())["shards"]:
        meta = json.loads((folder / (e["path"] + ".json")).read_text())
        toks = np.fromfile(folder / e["path"], meta["dtype"])
        starts = np.fromfile(folder / meta["document_index"]["path"], np.uint64).astype(np.int64)
        docs = [toks[a:b].tobytes() for a, b in zip(starts[:-1], starts[1:])]
        out["train"] += docs[:meta["documents"]["train"]]
        out["heldout"] += docs[meta["documents"]["train"]:]
    return out


def test_a_large_jsonl_file_is_cut_at_line_ends_into_the_same_documents(tmp_path, capsys):
    """One JSONL file of 60 KB with --shard-mb 0.01: several shards that hold, split by split and in order, the
    documents of the file prepared as one shard (a piece need not hold out a record, the file must: one line, no
    manifest); a bad line in a later piece is named by its line in the file; a small file with --workers 2 is one
    shard, said in one line."""
    src = tmp_path / "r.jsonl"
    lines = [json.dumps({"text": f"record {i} " + "z" * (i % 97)}) + "\n" for i in range(900)]
    src.write_text("".join(lines))
    common = [str(src), "--train-tokenizer", "300", "--no-progress", "--heldout", "0.05", "--workers", "1"]
    assert main(["prepare", *common, "--out", str(tmp_path / "whole"), "--shard-mb", "1"]) == 0
    assert main(["prepare", *common, "--out", str(tmp_path / "cut"), "--shard-mb", "0.01"]) == 0
    whole, cut = _documents(tmp_path / "whole"), _documents(tmp_path / "cut")
    shards = json.loads((tmp_path / "cut" / "manifest.json").read_text())["shards"]
    assert len(shards) >= 5 and min(e["documents"]["heldout"] for e in shards) == 0
    assert len(whole["train"]) + len(whole["heldout"]) == 900 and len(whole["heldout"]) > 20
    assert cut == whole
    capsys.readouterr()
    assert main(["prepare", *common, "--heldout", "0.0001", "--out", str(tmp_path / "none"), "--shard-mb",
                 "0.01"]) != 0
    assert capsys.readouterr().err == (f"meshtrain: error: --heldout 0.0001 held out none of the records of {src} (a "
                                       "record is held out by a hash of its content); use a larger --heldout, more "
                                       "records, or --heldout 0 to hold out none\n")
    assert not (tmp_path / "none" / "manifest.json").exists()
    lines[700] = "{not json\n"
    src.write_text("".join(lines))
    capsys.readouterr()
    given = [str(src), "--tokenizer", str(tmp_path / "whole" / "tokenizer.json"), "--no-progress", "--workers", "1"]
    assert main(["prepare", *given, "--out", str(tmp_path / "bad"), "--shard-mb", "0.01"]) != 0
    assert capsys.readouterr().err.startswith(f"meshtrain: error: {src}:701 is not JSON")
    small = tmp_path / "small.jsonl"
    small.write_text("".join(lines[:50]))
    assert main(["prepare", str(small), "--out", str(tmp_path / "small"), "--train-tokenizer", "300", "--no-progress",
                 "--workers", "2"]) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("--workers 2")]
    assert said == ["--workers 2: 1 shard to write, so 1 worker idle; shards hold --shard-mb 256 of text files or of a "
                    "JSONL file on local disk (a Parquet file or an object in storage is one shard): a smaller "
                    "--shard-mb makes more"], said


# ----------------------------------------------------------------------------- training on a manifest

def _texts(tmp: Path, n: int = 30) -> Path:
    rng = np.random.default_rng(0)
    src = tmp / "texts"
    src.mkdir()
    for i in range(n):
        (src / f"d{i:02d}.txt").write_text(" ".join(f"w{i % 5}_{w}" for w in rng.integers(0, 60, 100 + 40 * i)))
    return src


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The same documents as one .bin, as a manifest of one shard, and as a manifest of several."""
    tmp = tmp_path_factory.mktemp("manifest")
    src = _texts(tmp)
    common = ["--train-tokenizer", "400", "--no-progress"]
    for out, more in (("one.bin", []), ("one", ["--workers", "1"]),
                      ("many", ["--shard-mb", "0.004", "--workers", "1"])):
        assert main(["prepare", str(src), "--out", str(tmp / out), *common, *more]) == 0
    return tmp


def test_a_manifest_of_one_shard_trains_like_its_bin(prepared):
    """The shard's files are the .bin's, bytes and all but the timings; training on the folder is bitwise training on
    the .bin (loss, grad_norm, parameters), with and without the document mask."""
    from conftest import run_steps
    assert (prepared / "one" / "shard-00000.bin").read_bytes() == (prepared / "one.bin").read_bytes()
    for mask in ("false", "true"):
        keys = ["model.vocab_size=400", "model.seq_len=32", "mesh.data=1", f"data.document_mask={mask}"]
        a = run_steps(keys, 1, source=str(prepared / "one"))
        b = run_steps(keys, 1, source=str(prepared / "one.bin"))
        assert np.array_equal(a.losses, b.losses) and np.array_equal(a.grad_norms, b.grad_norms)
        assert all(np.array_equal(x, y) for x, y in zip(*(__import__("jax").tree.leaves(r.params) for r in (a, b))))


def test_windows_stay_in_their_shard_and_follow_its_tokens(prepared):
    """Several shards: no window crosses a shard; each shard's share of 1,000 windows within 3 standard errors of
    its share of the training tokens; the documents are the shards' own; a process's rows are the global batch's."""
    from trainer.data.batches import _TRAIN, Batches, load_corpus
    c = load_corpus(str(prepared / "many"))
    m = json.loads((prepared / "many" / "manifest.json").read_text())
    lens = np.array([s["tokens"]["train"] for s in m["shards"]])
    assert len(lens) >= 4 and len(c.train) == lens.sum()
    bounds = np.cumsum([0, *lens])
    T, B = 32, 8
    b = Batches(c, 0, B, T, 400, document_mask=True)
    starts = np.concatenate([b._windows(c.train, [0, s, _TRAIN], B)[1] for s in range(125)])
    k = np.searchsorted(bounds, starts, side="right") - 1
    assert np.all(starts + T + 1 <= bounds[k + 1])  # inside shard k
    share, p = np.bincount(k, minlength=len(lens)) / len(starts), lens / lens.sum()
    assert np.all(np.abs(share - p) <= 3 * np.sqrt(p * (1 - p) / len(starts))), (share, p)
    docs = c.documents()
    for e, lo in zip(m["shards"], bounds[:-1]):  # each shard's train documents where its tokens are
        own = np.fromfile(prepared / "many" / (e["path"] + ".docs"), np.uint64).astype(np.int64)
        assert set((lo + own[own < e["tokens"]["train"]]).tolist()) <= set(docs.tolist())
    whole = b.global_train(7)
    half = Batches(c, 0, B, T, 400, process_index=1, process_count=2, document_mask=True).train(7)
    assert all(np.array_equal(half[f], whole[f][B // 2:]) for f in whole)


def test_a_missing_or_truncated_shard_is_one_line(prepared, tmp_path):
    import shutil

    from trainer.data.batches import load_corpus
    from trainer.errors import UserError
    folder = tmp_path / "many"
    shutil.copytree(prepared / "many", folder)
    (folder / "shard-00002.bin").unlink()
    with pytest.raises(UserError, match=r"shard 'shard-00002.bin' named by its manifest.json is missing; run "
                       r"meshtrain prepare --out FOLDER again \(it redoes only what is missing\)$"):
        load_corpus(str(folder))
    shutil.copy(prepared / "many" / "shard-00002.bin", folder)
    with open(folder / "shard-00001.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError, match=r"shard 'shard-00001.bin' has 50 tokens where its manifest.json says "):
        load_corpus(str(folder))
