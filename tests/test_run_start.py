"""What a training run does before its first step: a seq_len past an HF folder's context refused before anything is
read, a run.dir that holds train.steps already left as it was (nothing compiled), a failed start that leaves run.dir
as it was with no start-up banner before its error, and a model.init_from of other shapes named with its keys."""
import io
import json
import re
from pathlib import Path

import jax
import pytest
from rich.console import Console

from trainer import load_config, train
from trainer.cli import main
from trainer.errors import UserError

FIX = Path(__file__).parent / "fixtures" / "hf"
# d_ff and vocab_size differ from the tiny preset's (128, 256): a mismatch is named by the source's own values
RUN = ["model.preset=tiny", "train.batch_size=8", "train.eval_every=0", "train.memory_check=false",
       "run.progress=false", "data.source=synthetic"]  # no planner: the memory check is not what these test
BASE = RUN + ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=48",
              "model.vocab_size=128", "model.seq_len=16"]
ONE = jax.devices()[:1]


def _tree(root: Path) -> dict:
    """Every path under root (root included): its mtime, and a file's bytes."""
    paths = [root, *sorted(root.rglob("*"))] if root.exists() else []
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in paths}


def _start(args, base=BASE):
    """train() of base + args on one device: (its result or UserError, what it printed)."""
    out = io.StringIO()
    try:
        got = train(load_config(base + args), ONE, Console(file=out, width=400))
    except UserError as e:
        got = e
    return got, out.getvalue()


def finished_run(args: list, devices=None):
    """Write run.dir as a finished 2-step run of config `args` leaves it: checkpoint 2, config.yaml, metrics,
    goodput, TensorBoard."""
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.config import to_yaml
    from trainer.observe.metrics import MetricsWriter
    from trainer.state import init_state, make_setup
    s = make_setup(load_config(args), devices)
    run = Path(s.cfg.run.dir)
    c = Checkpointer(s, run)
    c.save(2, init_state(s))
    c.close()
    (run / "config.yaml").write_text(to_yaml(s.cfg))
    w = MetricsWriter(run)
    for step in (1, 2):
        w.write({"step": step, "loss": 5.5 - step / 10})
    w.write_goodput({"step": 2, "time_total_s": 1.0, "goodput": 0.5})
    w.close()


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("start") / "run"
    finished_run(BASE + ["train.steps=2", f"run.dir={run}"], ONE)
    return run


def test_seq_len_past_an_hf_context_is_refused_before_anything_is_read(tmp_path):
    """Item 3: 1024 on a 512-position folder: one line naming both numbers and the fixes, raised before the data
    (a missing file) or a weight is read; with llama3 RoPE scaling reaching 1024 the folder is accepted."""
    folder = FIX / "head_dim_long_f32"
    positions = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    assert positions == 512
    run = tmp_path / "run"
    got, said = _start([f"model.init_from={folder}", "model.seq_len=1024", "data.source=/nonexistent/corpus.txt",
                        f"run.dir={run}"], RUN)
    msg = str(got)
    assert isinstance(got, UserError) and "\n" not in msg, got
    assert "model.seq_len=1024" in msg and "512 positions" in msg and "max_position_embeddings" in msg, msg
    assert "model.seq_len<=512" in msg and "model.rope_scaling=[2,1,4,512]" in msg, msg
    assert not run.exists() and "meshtrain model" not in said, said

    from trainer.ckpt.sources import resolve
    ok = resolve(load_config(["model.preset=tiny", f"model.init_from={folder}", "model.seq_len=1024",
                              "model.rope_scaling=[2,1,4,512]"]))
    assert list(ok.model.rope_scaling) == [2, 1, 4, 512] and ok.model.d_model == 64  # the folder's shapes kept
    with pytest.raises(UserError, match=r"factor x original = 768 positions, fewer than model.seq_len=1024"):
        resolve(load_config(["model.preset=tiny", f"model.init_from={folder}", "model.seq_len=1024",
                             "model.rope_scaling=[1.5,1,4,512]"]))


@pytest.fixture
def no_compile(monkeypatch):
    def refuse(s):
        raise AssertionError("the train step was compiled")
    monkeypatch.setattr("trainer.run.context.jit_train_step", refuse)


def test_resume_at_the_checkpoint_compiles_and_writes_nothing(done, no_compile):
    """Item 8: train.steps equal to the checkpoint's step: one line, no compile, run.dir byte for byte and mtime
    for mtime as it was; the result holds the checkpoint's state."""
    before = _tree(done)
    got, said = _start(["train.steps=2", f"run.dir={done}"])
    assert not isinstance(got, BaseException), got
    assert got.start_step == 2 and got.history == [] and int(got.state["step"]) == 0, got
    assert said.splitlines() == [f"run.dir {done} holds step 2 >= train.steps=2: nothing to train, nothing "
                                 "written; raise train.steps above 2 to continue"], said
    assert _tree(done) == before


def test_resume_below_the_checkpoint_exits_0_from_the_command_line(done, no_compile, capsys):
    """Item 8 through the CLI with train.steps below the checkpoint's, on all 8 devices (another mesh than the
    checkpoint's): exit 0 and one line, nothing compiled or written."""
    before = _tree(done)
    assert main(["train", *BASE, "train.steps=1", f"run.dir={done}"]) == 0
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "holds step 2 >= train.steps=1: nothing to train" in err, err
    assert _tree(done) == before


def test_a_failed_start_leaves_run_dir_as_it_was(done, tmp_path, capsys):
    """Item 10: a missing model.init_from creates no run.dir (nor its parents) and prints no banner before its one
    line; a failing resume (other shapes) leaves the run's tree as it was, mtimes included."""
    fresh = tmp_path / "a" / "b" / "run"
    assert main(["train", *BASE, "model.init_from=/nonexistent/params", f"run.dir={fresh}"]) == 2
    err = capsys.readouterr().err.strip()
    assert not (tmp_path / "a").exists(), sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert err.splitlines() == [err] and "model.init_from='/nonexistent/params' is neither" in err, err

    before = _tree(done)
    got, said = _start(["model.d_ff=64", f"run.dir={done}"])
    assert isinstance(got, UserError) and re.search(r"has shape \(.*48.*\) there but \(.*64.*\)", str(got)), got
    assert "meshtrain model" not in said, said
    assert _tree(done) == before


@pytest.mark.parametrize("key,value,saved", [("d_ff", 64, 48), ("vocab_size", 256, 128)])
def test_init_from_of_other_shapes_names_the_keys_it_was_saved_with(done, tmp_path, key, value, saved):
    """Item 11: model.init_from (a run) of other shapes: the fix is the source's own key and value, not a new
    run.dir (which holds no checkpoint to be in the way); the new run.dir stays empty."""
    empty = tmp_path / "run"
    empty.mkdir()
    before = _tree(empty)
    got, said = _start([f"model.init_from={done}", f"model.{key}={value}", f"run.dir={empty}"])
    msg = str(got)
    assert isinstance(got, UserError) and "\n" not in msg, got
    assert f"set model.{key}={saved} as it was saved," in msg and "new run.dir" not in msg, msg
    assert "meshtrain model" not in said and _tree(empty) == before, said


@pytest.mark.slow  # ~1 s: HF weights read, a checkpoint saved and exported
def test_a_context_extended_with_rope_scaling_is_exported_with_it(tmp_path):
    """Item 3's way past the context: a 512-position folder at seq_len 1024 with [2,1,4,512], saved and exported
    to HF, has the run's context and scaling in config.json (not the folder's), and imports again at 1024."""
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.ckpt.initial import initial_state
    from trainer.ckpt.sources import resolve
    from trainer.state import make_setup
    run, out = tmp_path / "run", tmp_path / "hf"
    cfg = resolve(load_config(RUN + [f"model.init_from={FIX / 'head_dim_long_f32'}", "model.seq_len=1024",
                                     "model.rope_scaling=[2,1,4,512]", f"run.dir={run}"]))
    s = make_setup(cfg, ONE)
    ck = Checkpointer(s, run)
    ck.save(1, initial_state(s))
    ck.close()
    assert main(["export", "--format", "hf", "--run", str(run), "--out", str(out)]) == 0
    got = json.loads((out / "config.json").read_text())
    assert got["max_position_embeddings"] == 1024, got
    assert {k: got["rope_scaling"][k] for k in ("rope_type", "factor", "original_max_position_embeddings")} == \
        {"rope_type": "llama3", "factor": 2, "original_max_position_embeddings": 512}, got
    again = resolve(load_config(["model.preset=tiny", f"model.init_from={out}", "model.seq_len=1024"]))
    assert list(again.model.rope_scaling) == [2, 1, 4, 512]


def test_an_hf_folder_of_fewer_positions_than_the_preset_still_loads_for_generate(tmp_path):
    """The context check does not refuse `generate`/`export` of a folder whose context (64) is below the default
    preset's seq_len (128): the folder is read at its own context."""
    import shutil
    from trainer.ckpt.params import load_params
    folder = shutil.copytree(FIX / "gqa_untied_f32", tmp_path / "short")
    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 64}))
    _, cfg = load_params(folder)
    assert cfg.model.seq_len == 64
