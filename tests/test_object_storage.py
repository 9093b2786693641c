"""Data in object storage (trainer/data/remote.py) against an S3 server on localhost (moto's ThreadedMotoServer, as
s3fs's own suite runs it; nothing leaves this machine), and gs:// through the same code with fsspec's in-memory
filesystem registered for the scheme: prepare to a bucket and train from it as from local disk, bit for bit; a rerun
uploads only what is missing; training reads byte ranges, never whole shards; a missing bucket or object is one
line."""
import json
from pathlib import Path

import numpy as np
import pytest

from trainer.cli import main
from trainer.errors import UserError


def _texts(tmp):
    rng = np.random.default_rng(0)
    src = tmp / "texts"
    src.mkdir(exist_ok=True)
    for i in range(24):
        (src / f"d{i:02d}.txt").write_text(" ".join(f"w{i % 5}_{w}" for w in rng.integers(0, 60, 100 + 40 * i)))
    return src


def _prepare(src, out, *more):
    return main(["prepare", str(src), "--out", str(out), "--train-tokenizer", "400", "--shard-mb", "0.01",
                 "--no-progress", *more])


def test_prepare_to_s3_and_train_from_it_as_from_disk(s3, tmp_path):
    """Shards prepared by 2 workers into s3://bkt/data/ hold the local prepare's tokens; 3 steps on the bucket's data
    equal 3 steps on the local folder bit for bit (losses, gradient norms, parameters), documents masked; a rerun
    writes nothing; with one shard and the manifest gone, a rerun uploads that shard and the manifest only."""
    import jax

    from conftest import run_steps
    src = _texts(tmp_path)
    assert _prepare(src, "s3://bkt/data/", "--workers", "2") == 0
    assert _prepare(src, tmp_path / "local", "--workers", "1") == 0
    m = json.loads(s3.cat_file("bkt/data/manifest.json"))
    local = json.loads((tmp_path / "local" / "manifest.json").read_text())
    assert m["shards"] == local["shards"] and len(m["shards"]) >= 4
    for e in m["shards"]:
        assert s3.cat_file(f"bkt/data/{e['path']}") == (tmp_path / "local" / e["path"]).read_bytes()
    keys = ["model.vocab_size=400", "model.seq_len=32", "mesh.data=1", "data.document_mask=true"]
    a, b = (run_steps(keys, 1, source=src) for src in ("s3://bkt/data", str(tmp_path / "local")))
    assert np.array_equal(a.losses, b.losses) and np.array_equal(a.grad_norms, b.grad_norms)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))
    stamps = {p["name"]: p["LastModified"] for p in s3.ls("bkt/data", detail=True, refresh=True)}
    assert _prepare(src, "s3://bkt/data/", "--workers", "2") == 0
    assert {p["name"]: p["LastModified"] for p in s3.ls("bkt/data", detail=True, refresh=True)} == stamps
    from trainer.ckpt.sources import resolve
    from trainer.config import load_config
    cfg = resolve(load_config(["data.source=s3://bkt/data/"]))  # what `meshtrain train` reads of its data first
    assert cfg.model.vocab_size == m["vocab_size"] and cfg.data.tokenizer == "s3://bkt/data/tokenizer.json"
    s3.rm(["bkt/data/manifest.json", "bkt/data/shard-00002.bin"])
    assert _prepare(src, "s3://bkt/data/", "--workers", "1") == 0
    after = {p["name"]: p["LastModified"] for p in s3.ls("bkt/data", detail=True, refresh=True)}
    changed = {n for n in after if after[n] != stamps.get(n)}
    assert changed == {"bkt/data/manifest.json", "bkt/data/shard-00002.bin", "bkt/data/shard-00002.bin.docs",
                       "bkt/data/shard-00002.bin.json"}, changed


def _handmade(fs_put, base: str, shards: int, tokens: int):
    """A manifest of `shards` shards of `tokens` random uint16 tokens each (one document each, no held-out part),
    written through fs_put(name, bytes)."""
    entries = []
    for k in range(shards):
        name = f"shard-{k:05d}.bin"
        fs_put(name, np.random.default_rng(k).integers(0, 400, tokens).astype(np.uint16).tobytes())
        fs_put(name + ".docs", np.array([0, tokens], np.uint64).tobytes())
        side = {"dtype": "uint16", "vocab_size": 400, "tokens": {"train": tokens, "heldout": 0, "total": tokens},
                "documents": {"train": 1, "heldout": 0}, "heldout_range": [tokens, tokens],
                "document_index": {"path": name + ".docs", "entries": 2}, "bytes": {"train": 2 * tokens, "heldout": 0},
                "tokenizer": {"path": "tokenizer.json", "sha256": "0" * 64}, "inputs_sha256": str(k)}
        fs_put(name + ".json", json.dumps(side).encode())
        entries.append({"path": name, "tokens": side["tokens"], "documents": side["documents"],
                        "inputs_sha256": str(k), "loss_mask": False})
    total = {"train": shards * tokens, "heldout": 0, "total": shards * tokens}
    fs_put("manifest.json", json.dumps({"format": "meshtrain-manifest", "version": 1, "shards": entries,
                                        "tokens": total, "vocab_size": 400, "eot_id": 0,
                                        "tokenizer": {"path": "tokenizer.json", "sha256": "0" * 64}}).encode())


def test_training_reads_ranges_not_shards(s3, monkeypatch):
    """10 steps of 8 windows of 8,193 uint16 tokens on 4 shards of 2,000,000 tokens (16 MB, 12x what is fetched):
    the bytes fetched, in the shipped blocks (remote.BLOCK, 4 KiB), are at most 1.25x the windows' bytes (a window
    of 16,386 bytes from an even byte touches at most 5 blocks; measured 1.19x); 64 KiB blocks fetch 3.95x here."""
    from trainer.data import remote
    from trainer.data.batches import Batches, load_corpus
    _handmade(lambda name, data: s3.pipe_file(f"bkt/big/{name}", data), "bkt/big", 4, 2_000_000)
    blocks = remote.Blocks()
    assert blocks.block == 4096
    monkeypatch.setattr(remote, "BLOCKS", blocks)
    T, B = 8192, 8
    b = Batches(load_corpus("s3://bkt/big"), 0, B, T, 400, evaluates=False)
    start = blocks.fetched
    for step in range(10):
        b.train(step)
    fetched, windows = blocks.fetched - start, 10 * B * (T + 1) * 2
    print(f"fetched {fetched:,} bytes for {windows:,} bytes of windows ({fetched / windows:.2f}x), blocks of "
          f"{blocks.block:,} bytes")
    assert windows <= fetched <= 1.25 * windows and 4 * 2_000_000 * 2 >= 10 * fetched


def test_gs_goes_through_the_same_code(tmp_path, monkeypatch):
    """gs:// with fsspec's in-memory filesystem registered for the scheme: prepare into it (one worker: the memory
    filesystem is this process's) and the batches read from it equal the local folder's."""
    import sys

    import fsspec.registry  # noqa: F401  (the module, whose _registry maps schemes to classes)
    from fsspec.implementations.memory import MemoryFileSystem

    from trainer.data.batches import Batches, load_corpus
    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "gs", MemoryFileSystem)  # restored after the test
    src = _texts(tmp_path)
    assert _prepare(src, "gs://bkt/data/", "--workers", "1") == 0
    assert _prepare(src, tmp_path / "local", "--workers", "1") == 0
    x, y = (Batches(load_corpus(s), 0, 8, 32, 400, document_mask=True) for s in ("gs://bkt/data",
                                                                              str(tmp_path / "local")))
    for step in (0, 5):
        a, b = x.global_train(step), y.global_train(step)
        assert all(np.array_equal(a[k], b[k]) for k in b)


def test_a_missing_bucket_or_object_is_one_line(s3, tmp_path):
    from trainer.data.batches import load_corpus
    with pytest.raises(UserError, match=r"^data.source 's3://nobucket/data' holds no manifest.json \(a missing "
                       r"bucket or folder\?\)"):
        load_corpus("s3://nobucket/data")
    with pytest.raises(UserError, match=r"^'s3://bkt/nothing.bin.json' does not exist"):
        load_corpus("s3://bkt/nothing.bin")
    _handmade(lambda name, data: s3.pipe_file(f"bkt/gone/{name}", data), "bkt/gone", 2, 1000)
    s3.rm("bkt/gone/shard-00001.bin")
    with pytest.raises(UserError, match=r"shard 'shard-00001.bin' named by its manifest.json is missing"):
        load_corpus("s3://bkt/gone")


def test_prepare_reads_sources_in_a_bucket(s3, tmp_path):
    """A folder of text files and a JSONL file uploaded as they are: prepared from s3:// its shards hold the same
    tokens, documents and masks as prepared from local disk (the sidecars differ in the sources named)."""
    src = _texts(tmp_path)
    (src / "sub").mkdir()
    (src / "sub" / "more.txt").write_text("more words " * 50)
    records = "".join(json.dumps({"text": f"record {i} " + "z" * i}) + "\n" for i in range(40))
    (src / "records.jsonl").write_text(records)
    for f in sorted(src.rglob("*")):
        if f.is_file():
            s3.put_file(str(f), f"bkt/src/{f.relative_to(src)}")
    assert _prepare("s3://bkt/src/", tmp_path / "from-s3", "--workers", "1") == 0
    assert _prepare(src, tmp_path / "from-disk", "--workers", "1") == 0
    a, b = tmp_path / "from-s3", tmp_path / "from-disk"
    names = sorted(p.name for p in b.iterdir() if not p.name.endswith(".json"))
    assert names == sorted(p.name for p in a.iterdir() if not p.name.endswith(".json")) and len(names) > 6
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    with pytest.raises(UserError, match=r"^source 's3://bkt/none/' does not exist \(no object under it\)"):
        from trainer.data.prepare import collect
        collect(["s3://bkt/none/"], 0.05)


def test_init_from_a_bucket_reads_a_local_copy(s3, tmp_path, monkeypatch):
    """model.init_from=s3://... (a Hugging Face folder): copied once into $MESHTRAIN_CACHE, then imported as the local
    folder is, parameters bit for bit; a second resolve fetches nothing again."""
    import jax

    from conftest import TINY
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    fix = Path(__file__).parent / "fixtures" / "hf" / "gqa_untied_f32"
    for f in sorted(fix.rglob("*")):
        if f.is_file():
            s3.put_file(str(f), f"bkt/models/gqa/{f.relative_to(fix)}")
    got = []
    for where in ("s3://bkt/models/gqa/", str(fix)):
        cfg = resolve(load_config(TINY + ["mesh.data=1", f"model.init_from={where}"]))
        s = make_setup(cfg, jax.devices()[:1])
        got.append(jax.tree.leaves(init_params(s, cfg.model.init_from)))
    assert all(np.array_equal(a, b) for a, b in zip(*got)) and len(got[0]) > 5
    copy = next((tmp_path / "cache" / "objects").iterdir())
    stamps = {p: p.stat().st_mtime_ns for p in copy.rglob("*")}
    resolve(load_config(TINY + ["mesh.data=1", "model.init_from=s3://bkt/models/gqa"]))
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*")} == stamps


def test_a_failed_read_is_retried_then_one_line(monkeypatch):
    """Two failed range reads then a good one: the data, after two backoffs; failing every time: one line naming the
    object after remote.TRIES tries."""
    import sys

    import fsspec.registry  # noqa: F401
    from fsspec.implementations.memory import MemoryFileSystem

    from trainer.data import remote
    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "gs", MemoryFileSystem)
    monkeypatch.setattr(remote.time, "sleep", lambda s: slept.append(s))
    slept, calls = [], []
    fs, path = remote.filesystem("gs://bkt/r/x.bin")
    fs.pipe_file(path, np.arange(1000, dtype=np.uint16).tobytes())
    real = MemoryFileSystem.cat_file

    def flaky(self, p, start=None, end=None, **kw):
        calls.append(p)
        if len(calls) <= fails:
            raise OSError("connection reset")
        return real(self, p, start=start, end=end, **kw)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", flaky)
    fails = 2
    a = remote.Remote("gs://bkt/r/x.bin", np.uint16, blocks=remote.Blocks(block=256))
    assert np.array_equal(a[np.array([[3, 4, 5]])], [[3, 4, 5]]) and slept == [0.1, 0.2]
    fails = 10 ** 6
    with pytest.raises(UserError, match=r"^reading 'gs://bkt/r/x.bin' failed 5 times \(OSError: connection reset\); "
                       r"check the endpoint, the credentials and the object$"):
        remote.Remote("gs://bkt/r/x.bin", np.uint16, blocks=remote.Blocks(block=256))[np.array([500])]


def _folder(s3, base: str, weights: bytes):
    s3.pipe_file(f"{base}/config.json", b'{"a": 1}')
    s3.pipe_file(f"{base}/sub/w.bin", weights)


def test_mirror_is_keyed_by_version(s3, tmp_path, monkeypatch):
    """A folder copied by mirror, then one object overwritten with as many bytes: the next mirror holds the new bytes
    (the cache is keyed by the objects' versions, not their sizes); a mirror of an unchanged folder fetches nothing."""
    from trainer.data import remote
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    _folder(s3, "bkt/mv", bytes(range(200)))
    first = remote.mirror("s3://bkt/mv/")
    assert (first / "sub" / "w.bin").read_bytes() == bytes(range(200))
    _folder(s3, "bkt/mv", bytes(range(200))[::-1])
    fs = remote.filesystem("s3://bkt/mv")[0]
    real, fetched = fs.get_file, []
    monkeypatch.setattr(fs, "get_file", lambda rpath, lpath, **kw: (fetched.append(rpath), real(rpath, lpath, **kw)))
    again = remote.mirror("s3://bkt/mv/")
    assert (again / "sub" / "w.bin").read_bytes() == bytes(range(200))[::-1]
    assert (again / "config.json").read_bytes() == b'{"a": 1}'
    fetched.clear()
    assert remote.mirror("s3://bkt/mv") == again and fetched == []


def test_mirror_while_another_process_copies(s3, tmp_path, monkeypatch):
    """Another process on the host copies the same folder while this one downloads an object (its copy made and
    renamed between this download and its rename, as a nested mirror here): each writes a file of its own, both
    copies are whole, no partial file is left."""
    from trainer.data import remote
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    _folder(s3, "bkt/race", bytes(range(256)) * 4)
    fs = remote.filesystem("s3://bkt/race")[0]
    real, other = fs.get_file, []

    def get_file(rpath, lpath, **kw):
        real(rpath, lpath, **kw)
        if not other:  # the other process's whole copy, before this one renames its download
            other.append(None)
            other[0] = remote.mirror("s3://bkt/race")
    monkeypatch.setattr(fs, "get_file", get_file)
    here = remote.mirror("s3://bkt/race")
    assert here == other[0] and (here / "sub" / "w.bin").read_bytes() == bytes(range(256)) * 4
    assert sorted(p.name for p in here.rglob("*")) == ["config.json", "sub", "w.bin"]


def test_a_source_rewritten_during_a_run_is_one_line(s3):
    """An object rewritten (as many bytes) after a run opened it: an array opened on the new version reads its bytes,
    not the old version's cached blocks; the array opened before stops at its next fetch with one line, rather than
    mixing the two versions' blocks."""
    from trainer.data import remote
    s3.pipe_file("bkt/rw/x.bin", np.arange(4000, dtype=np.uint16).tobytes())
    blocks = remote.Blocks(block=1024)
    old = remote.Remote("s3://bkt/rw/x.bin", np.uint16, blocks=blocks)
    assert np.array_equal(old[np.arange(10)], np.arange(10))
    s3.pipe_file("bkt/rw/x.bin", np.arange(4000, dtype=np.uint16)[::-1].tobytes())
    new = remote.Remote("s3://bkt/rw/x.bin", np.uint16, blocks=blocks)
    assert np.array_equal(new[np.arange(10)], 3999 - np.arange(10))
    assert np.array_equal(old[np.arange(10)], np.arange(10))  # its own version's blocks, cached: not mixed
    with pytest.raises(UserError, match=r"^'s3://bkt/rw/x.bin' changed while this run read it \(ETag=.*\): its "
                       r"blocks would mix two versions; leave data a run reads as it is"):
        old[np.array([3000])]
