"""The URL rule (trainer/config/paths.py) against an S3 server on localhost (the `s3` fixture of conftest.py): a URL
is accepted by every command that takes a path (train, prepare, generate, inspect, export, plot) or refused by every
one in one line; a mistyped URL is one line before anything is written; `export --out s3://...` uploads; missing
credentials are one line naming them; a run trained on bucket data generates and exports with its tokenizer; a failed
export writes nothing. Every refusal leaves the working folder and the bucket as they were (both listed)."""
import io
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from trainer.cli import main

# one device-free run: its checkpoint saved from init_state (no train step compiled), data prepared into the bucket
SMALL = ["model.preset=tiny", "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
         "model.d_ff=48", "model.seq_len=16", "train.batch_size=8", "train.steps=2", "train.eval_every=0",
         "train.memory_check=false", "run.progress=false", "mesh.data=1"]
ONE = jax.devices()[:1]
DATA = "s3://bkt/u/data/"


def _listing(s3, wd: Path) -> tuple[dict, dict]:
    """(every object under bkt/: its size and ETag; every path under wd: its mtime and a file's bytes)."""
    objects = {k: (v["size"], v.get("ETag")) for k, v in s3.find("bkt", detail=True, refresh=True).items()}
    files = {str(p.relative_to(wd)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
             for p in sorted(wd.rglob("*"))}
    return objects, files


def _cat(s3, key: str) -> bytes:
    s3.invalidate_cache()  # what the bucket holds now, not the fixture's earlier listing
    return s3.cat_file(key)


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory):
    """(working folder, a local run.dir whose data is DATA, the same run at s3://bkt/u/run): a checkpoint at step 2,
    config.yaml and metrics.jsonl, as a finished run leaves them."""
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.ckpt.sources import resolve
    from trainer.config import load_config, to_yaml
    from trainer.state import init_state, make_setup
    tmp = tmp_path_factory.mktemp("urls")
    mp = pytest.MonkeyPatch()
    mp.setenv("MESHTRAIN_CACHE", str(tmp / "cache"))
    rng = np.random.default_rng(0)
    for i in range(6):  # sources in the bucket, prepared into the bucket: prepare takes URLs both ways
        s3.pipe_file(f"bkt/u/src/d{i}.txt", " ".join(f"w{w}" for w in rng.integers(0, 30, 60 + 20 * i)).encode())
    assert main(["prepare", "s3://bkt/u/src/", "--out", DATA, "--train-tokenizer", "300", "--no-progress",
                 "--workers", "1"]) == 0
    cfg = resolve(load_config(SMALL + [f"data.source={DATA}"]))
    assert cfg.data.tokenizer == DATA + "tokenizer.json", cfg.data.tokenizer
    c = Checkpointer(make_setup(cfg, ONE), "s3://bkt/u/run")
    c.save(2, init_state(c.s))
    c.close()
    local = tmp / "run"
    s3.get("bkt/u/run/", str(local), recursive=True)  # the same checkpoint on disk (a commit file more in each folder)
    local.joinpath("config.yaml").write_text(to_yaml(cfg))
    local.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": k, "loss": 5.0 - k}) + "\n" for k in (1, 2)))
    for name in ("config.yaml", "metrics.jsonl"):
        s3.put_file(str(local / name), f"bkt/u/run/{name}")
    (tmp / "wd").mkdir()
    yield tmp / "wd", local, "s3://bkt/u/run"
    mp.undo()


def _refused(capsys, args: list, match: str):
    assert main(args) == 2, args
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshtrain: error: ") and "\n" not in err and match in err, (args, err)
    return err


MISTYPED = ("s3:/bkt/u/x", "s3:bkt/u/x", "S3://bkt/u/x", "gcs://bkt/u/x")


@pytest.mark.parametrize("bad", MISTYPED)
def test_a_mistyped_url_is_one_line_from_every_command(s3, tmp_path, capsys, monkeypatch, bad):
    """Items 4 and the URL rule: each key and flag that names a path, given a mistyped URL, is refused in one line
    that spells the URL as meant, before anything is read or written: no ./s3: folder, the bucket as it was."""
    wd, run = tmp_path, "runs/none"  # checked before the run is read
    monkeypatch.chdir(wd)
    before = _listing(s3, wd)
    fix = "gs://bkt/u/x" if bad.startswith("gcs") else "s3://bkt/u/x"
    for args in ([f"run.dir={bad}"], [f"data.source={bad}"], [f"model.init_from={bad}"], [f"dpo.reference={bad}"],
                 [f"data.mixture=[{bad}=1,b.bin=1]"], [f"data.mixture=[web:{bad}=1]"]):
        err = _refused(capsys, ["train", *SMALL, "mesh.data=-1", *args],  # a start that would run on all devices
                       f"'{bad}' (command line) is a mistyped URL; write {fix} ")
        assert err.startswith(f"meshtrain: error: {args[0].split('=')[0]} "), err
    for args in (["prepare", bad, "--out", "o/", "--train-tokenizer", "300"],
                 ["prepare", "builtin", "--out", bad, "--train-tokenizer", "300"],
                 ["generate", "--run", bad], ["inspect", "--run", bad],
                 ["export", "--run", bad, "--out", "e"], ["export", "--run", str(run), "--out", bad],
                 ["export", "--run", str(run), "--out", bad, "--format", "hf"],
                 ["plot", bad], ["plot", str(run), "--out", bad]):
        _refused(capsys, args, f"'{bad}' is a mistyped URL; write {fix} ")
    assert _listing(s3, wd) == before


@pytest.mark.slow  # a checkpoint saved and read (with the next test: ~10 s); the refusals run by default above
def test_export_to_a_bucket_uploads_both_formats(runs, s3, capsys, monkeypatch):
    """Item 3: `export --out s3://...` puts the export in the bucket, not in ./s3:/: the orbax export of the run in the
    bucket reads back bit for bit as the run's parameters, the HF one holds the bytes a local export writes."""
    from trainer.ckpt.params import load_params
    wd, run, url = runs
    monkeypatch.chdir(wd)
    assert main(["export", "--run", url, "--out", "s3://bkt/u/exp"]) == 0
    assert capsys.readouterr().out.strip() == "exported parameters to s3://bkt/u/exp"
    (a, _), (b, _) = load_params("s3://bkt/u/exp"), load_params(str(run))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))) and len(jax.tree.leaves(a))
    assert main(["export", "--run", str(run), "--out", "s3://bkt/u/hf", "--format", "hf"]) == 0
    assert main(["export", "--run", str(run), "--out", str(wd.parent / "hf-local"), "--format", "hf"]) == 0
    local = {p.name: p.read_bytes() for p in (wd.parent / "hf-local").iterdir()}
    assert {k.rpartition("/")[2]: _cat(s3, k) for k in s3.find("bkt/u/hf", refresh=True)} == local
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(local)
    assert list(wd.iterdir()) == []


def test_missing_credentials_are_one_line(s3, tmp_path, capsys, monkeypatch):
    """Item 5: with the AWS variables unset and no config file, inspect --run s3://, data.source=s3:// and
    run.dir=s3:// each stop in one line naming the missing credentials (not NoCredentialsError, not 'bucket does
    not exist'), the folder and the bucket as they were; and export --out s3://..., once they are back, a taken or
    missing bucket in one line (item 3's refusals), before the run is read."""
    wd, url = tmp_path, "s3://bkt/u/run"
    monkeypatch.chdir(wd)
    before = _listing(s3, wd)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    for k in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(k, str(wd / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask on this machine
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()  # as in a new process: no filesystem made with the credentials earlier
    what = "no AWS credentials found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY unset"
    for args in (["inspect", "--run", url], ["train", *SMALL, f"data.source={DATA}", "run.dir=r"],
                 ["train", *SMALL, "run.dir=s3://bkt/u/new"]):
        _refused(capsys, args, what)
    monkeypatch.undo()
    monkeypatch.chdir(wd)
    s3.pipe_file("bkt/u/taken/x", b"x")
    before = _listing(s3, wd)
    for fmt in ("orbax", "hf"):
        _refused(capsys, ["export", "--run", "runs/none", "--out", "s3://bkt/u/taken", "--format", fmt],
                 "--out s3://bkt/u/taken exists and is not empty; choose a new directory")
        _refused(capsys, ["export", "--run", "runs/none", "--out", "s3://nobucket/exp", "--format", fmt],
                 "bucket 's3://nobucket' does not exist")
    assert _listing(s3, wd) == before


@pytest.mark.slow
def test_a_run_on_bucket_data_generates_and_exports_and_a_failed_export_writes_nothing(runs, s3, capsys, monkeypatch):
    """Item 6 and the URL rule's other half: a run whose data.tokenizer is an s3:// URL generates text its tokenizer
    decodes (greedy, the same tokens from the run on disk and from the run in the bucket, which inspect and plot take
    too, and train as run.dir, data.source and model.init_from: at its last step, nothing to do) and exports with that
    tokenizer.json; an export that fails (the tokenizer object gone) is one line and writes nothing, so that the
    rerun, the object back, succeeds. (prepare takes URLs both ways in the fixture.)"""
    from tokenizers import Tokenizer

    from trainer.run.generate import completion
    wd, run, url = runs
    monkeypatch.chdir(wd)
    tok_bytes = _cat(s3, "bkt/u/data/tokenizer.json")
    tok = Tokenizer.from_str(tok_bytes.decode())
    a = completion(str(run), "w3 w4", 4, temperature=0, out=io.StringIO())
    b = completion(url, "w3 w4", 4, temperature=0, out=io.StringIO())
    assert a.ids == b.ids and a.prompt_ids[-2:] == tok.encode("w3 w4", add_special_tokens=False).ids[-2:]
    assert a.text == tok.decode(a.ids[:len(a.ids) - a.stopped], skip_special_tokens=False)
    from rich.console import Console

    from trainer import load_config, train
    cfg = load_config(SMALL + [f"run.dir={url}", f"data.source={DATA}", f"model.init_from={url}"])
    done = train(cfg, ONE, Console(file=io.StringIO()))  # `meshtrain train` on one device: nothing left to train
    assert done.start_step == 2 and done.history == []
    assert main(["inspect", "--run", url]) == 0
    assert capsys.readouterr().out.startswith(f"run {url}: 1 checkpoint(s)")
    assert main(["plot", url, "--out", "s3://bkt/u/plot.png"]) == 0
    assert _cat(s3, "bkt/u/plot.png").startswith(b"\x89PNG")
    s3.rm_file("bkt/u/data/tokenizer.json")
    before = _listing(s3, wd)
    try:
        _refused(capsys, ["export", "--run", str(run), "--out", "hf", "--format", "hf"],
                 f"the run's tokenizer '{DATA}tokenizer.json' (data.tokenizer) is missing")
        assert _listing(s3, wd) == before
    finally:
        s3.pipe_file("bkt/u/data/tokenizer.json", tok_bytes)
    assert main(["export", "--run", str(run), "--out", "hf", "--format", "hf"]) == 0
    assert (wd / "hf" / "tokenizer.json").read_bytes() == tok_bytes
    assert sorted(p.name for p in wd.iterdir()) == ["hf"]  # no staging folder left beside it
    shutil.rmtree(wd / "hf")
