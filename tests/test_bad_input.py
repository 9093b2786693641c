"""Every bad input gets one line naming the problem and the fix, a non-zero exit, no traceback."""
import os
import subprocess
import sys

import pytest

from trainer.cli import main

BASE = ["model.preset=tiny", "train.steps=1", "run.progress=false"]

CASES = {
    "mesh-product": (["mesh.data=3"], "has 3 devices but 8 are available"),
    "two-minus-one": (["mesh.data=-1", "mesh.model=-1"], "set at most one axis to -1"),
    "heads-vs-model": (["mesh.data=1", "mesh.model=8", "model.n_heads=4", "model.n_kv_heads=4"],
                       "model.n_heads=4 is not divisible by mesh.model=8"),
    "kv-heads-vs-model": (["mesh.data=1", "mesh.model=8"], "model.n_kv_heads=4 is not divisible by mesh.model=8"),
    "d_ff-vs-model": (["mesh.data=1", "mesh.model=8", "model.n_kv_heads=8", "model.d_ff=100"],
                      "model.d_ff=100 is not divisible by mesh.model=8"),
    "vocab-vs-model": (["mesh.data=1", "mesh.model=8", "model.n_kv_heads=8", "model.vocab_size=260"],
                       "model.vocab_size=260 is not divisible by mesh.model=8"),
    "batch-vs-data-micro": (["mesh.data=8", "train.batch_size=16", "train.microbatches=4"],
                            "train.batch_size=16 is not divisible by mesh.data x train.microbatches"),
    "layers-vs-stage": (["mesh.data=4", "mesh.stage=2", "model.n_layers=3"],
                        "model.n_layers=3 is not divisible by mesh.stage=2"),
    "layers-vs-stage-x-repeats": (["mesh.data=4", "mesh.stage=2", "train.microbatches=2", "model.n_layers=2",
                                   "train.pipeline_repeats=2"],
                                  "model.n_layers=2 is not divisible by mesh.stage x train.pipeline_repeats"),
    "microbatches-below-stages": (["mesh.data=2", "mesh.stage=4", "train.microbatches=2", "model.n_layers=4"],
                                  "train.microbatches=2 is less than mesh.stage=4"),
    "microbatch-vs-data": (["mesh.data=4", "mesh.stage=2", "train.batch_size=8", "train.microbatches=4"],
                           "each microbatch of batch_size/microbatches rows is split over mesh.data"),
    "unknown-key": (["train.zero_stag=1"], "did you mean 'train.zero_stage'"),
    "wrong-type": (["train.steps=many"], "'train.steps'"),
    "missing-data": (["data.source=/nonexistent/corpus.txt"], "does not exist"),
    "zero-stage-range": (["train.zero_stage=4"], "outside 0..3"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_one_line_error(name, tmp_path, capsys):
    args, expected = CASES[name]
    code = main(["train", *BASE, f"run.dir={tmp_path / 'run'}", *args])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert err.startswith("meshtrain: error:") and len(err.splitlines()) == 1, err
    assert expected in err, err
    assert "Traceback" not in err


def test_empty_corpus(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    code = main(["train", *BASE, f"run.dir={tmp_path / 'run'}", f"data.source={empty}"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "is empty" in err and len(err.splitlines()) == 1


def test_cli_process_exit_code_and_no_traceback(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    p = subprocess.run([sys.executable, "-m", "trainer.cli", "train", *BASE, "train.zero_stag=2",
                        f"run.dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == 2
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert lines == ["meshtrain: error: unknown config key 'train.zero_stag' (command line); "
                     "did you mean 'train.zero_stage'?"], p.stderr
