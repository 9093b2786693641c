"""Configs and presets load; batches are a pure function of (seed, step); a run writes its files."""
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, corpus
from meshes import preset_names
from models.batch import DTYPES, FIELDS
from trainer import load_config, train
from trainer.config import validate
from trainer.data.batches import Batches, _split_files, stdlib_files


@pytest.mark.parametrize("name", preset_names())
def test_every_mesh_preset_loads(name):
    moe = ["model.family=mixtral", "model.n_experts=8"] if "expert" in name else []  # an expert axis needs experts
    cfg = load_config([f"mesh.preset={name}", "model.preset=7b", "train.batch_size=512"] + moe)
    from meshes import AXES
    sizes = {a.name: getattr(cfg.mesh, a.name) for a in AXES}
    assert validate(cfg, int(np.prod(list(sizes.values())))).as_dict() == sizes


def test_required_presets_exist():
    assert {"single", "cpu-8-dp", "cpu-8-fsdp", "cpu-8-2x2x2", "h100x8-tp8", "v5p-256-fsdp"} <= set(preset_names())


def test_fsdp_preset_sets_zero3_and_overrides_win():
    assert load_config(["mesh.preset=cpu-8-fsdp"]).train.zero_stage == 3
    assert load_config(["mesh.preset=cpu-8-fsdp", "train.zero_stage=1"]).train.zero_stage == 1


def test_yaml_files_layer_in_order(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("train: {steps: 7, lr: 0.5}\n")
    b.write_text("train: {steps: 9}\n")
    cfg = load_config([str(a), str(b), "train.lr=0.25"])
    assert (cfg.train.steps, cfg.train.lr) == (9, 0.25)


def _windows(rows: dict) -> np.ndarray:
    """The (B, T+1) token windows of a batch's fields."""
    return np.concatenate([rows["tokens"], rows["targets"][:, -1:]], axis=1)


def test_batches_are_a_pure_function_of_seed_and_step():
    c = corpus()
    b1, b2 = Batches(c, 3, 8, 32, 256), Batches(c, 3, 8, 32, 256)
    assert np.array_equal(_windows(b1.train(5)), _windows(b2.train(5)))
    assert not np.array_equal(_windows(b1.train(5)), _windows(b1.train(6)))
    assert not np.array_equal(_windows(b1.train(5)), _windows(Batches(c, 4, 8, 32, 256).train(5)))
    rows = [Batches(c, 3, 8, 32, 256, p, 4).train(5) for p in range(4)]
    for f in b1.train(5):  # processes build disjoint rows of every field
        assert np.array_equal(np.concatenate([r[f] for r in rows]), b1.train(5)[f]), f


def test_a_batch_is_named_fields_with_targets_shifted_once():
    b = Batches(corpus(), 3, 8, 32, 256).train(5)
    assert sorted(b) == sorted(FIELDS) and all(b[f].shape == (8, 32) for f in FIELDS)
    assert {f: b[f].dtype for f in FIELDS} == DTYPES
    np.testing.assert_array_equal(b["targets"][:, :-1], b["tokens"][:, 1:])  # each target is the next input
    # the window's bytes, read from the corpus by hand: tokens are its first T, targets its last T
    text, row = corpus().train, b["tokens"][0]
    at = np.asarray(text, np.uint8).tobytes().find(row.astype(np.uint8).tobytes())  # a window of the corpus
    np.testing.assert_array_equal(b["targets"][0], text[at + 1:at + 33])
    assert (b["loss_weight"] == 1).all() and (b["segment_ids"] == 1).all()  # every target counted, one document
    np.testing.assert_array_equal(b["positions"], np.tile(np.arange(32), (8, 1)))


def test_heldout_files_are_disjoint_and_stable():
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    tr, he = _split_files(files, root, 0.05)
    assert he and set(tr).isdisjoint(he) and len(tr) + len(he) == len(files)
    assert 0.02 < len(he) / len(files) < 0.1


def test_train_api_writes_run_files(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(TINY + ["mesh.data=8", "train.steps=4", "run.log_every=2", "train.eval_every=4",
                              "train.eval_batches=2", f"run.dir={run}"])
    result = train(cfg)
    assert (run / "config.yaml").exists()
    assert load_config([str(run / "config.yaml")]) == cfg  # the written config resolves to the same
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    goodput = [json.loads(l) for l in (run / "goodput.jsonl").read_text().splitlines()]
    assert len(goodput) == 1 and goodput[0]["step"] == 4 and "goodput" in goodput[0]  # one line per session
    assert [l["step"] for l in lines] == [2, 4] and all("loss" in l for l in lines)  # steps only
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "mfu"):
        assert key in lines[0]
    assert lines[0]["mfu"] is not None and 0 < lines[0]["mfu"] < 1
    assert "eval_loss" in lines[-1] and result.eval_loss == lines[-1]["eval_loss"]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def _offsets(rows: np.ndarray, data: bytes) -> set:
    """The file offsets every row covers; random bytes make each (T+1)-byte window occur once."""
    covered = set()
    for row in _windows(rows):
        w = bytes(row.astype(np.uint8))
        at = data.find(w)
        assert at >= 0 and data.find(w, at + 1) < 0, "a window not found once in the file"
        covered.update(range(at, at + len(w)))
    return covered


@pytest.mark.parametrize("layout", ["one-file-folder", "small-file"])
def test_eval_reads_only_bytes_no_training_batch_reads(layout, tmp_path):
    from trainer.data.batches import load_corpus
    data = np.random.default_rng(0).integers(0, 256, 600, dtype=np.uint8).tobytes()  # 5% = 30 < one window
    path = tmp_path / "only.txt"
    if layout == "one-file-folder":
        path = tmp_path / "folder" / "only.txt"
        path.parent.mkdir()
    path.write_bytes(data)
    b = Batches(load_corpus(str(path.parent if layout == "one-file-folder" else path)), 0, 8, 32, 256)
    train = set().union(*(_offsets(b.train(s), data) for s in range(300)))
    held = set().union(*(_offsets(b.eval(i), data) for i in range(8)))
    assert held and train.isdisjoint(held), sorted(train & held)[:5]
    assert min(held) == 600 - 34 and len(train) > 500  # the tail, one window + 1 (5% is less); the rest trains


def test_too_little_data_for_train_and_eval_is_refused_unless_nothing_evaluates(tmp_path):
    from trainer.data.batches import load_corpus
    from trainer.errors import UserError
    (tmp_path / "small.txt").write_bytes(bytes(range(50)))
    c = load_corpus(str(tmp_path / "small.txt"))
    with pytest.raises(UserError, match=r"has 50 bytes, too few for model.seq_len=32 .* at least 68 bytes"):
        Batches(c, 0, 8, 32, 256)
    b = Batches(c, 0, 8, 32, 256, evaluates=False)  # train.eval_every=0: it trains and never evaluates
    assert b.train(0)["tokens"].shape == (8, 32)
    with pytest.raises(ValueError):
        b.eval(0)
