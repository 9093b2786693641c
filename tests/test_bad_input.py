"""Every bad input gets one line naming the problem and the fix, a non-zero exit, no traceback, and
leaves the files already in run.dir byte for byte as they were."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.cli import main

BASE = ["model.preset=tiny", "train.steps=1", "run.progress=false"]

CASES = {
    "mesh-product": (["mesh.data=3"], "mesh data=3 stage=1 expert=1 context=1 model=1 has 3 devices but 8 are available"),
    "mesh-rest-not-dividing": (["mesh.context=3"], "mesh data=-1 stage=1 expert=1 context=3 model=1 cannot fill 8 devices: 8 "
                               "is not divisible by 3"),
    "document-mask-without-documents": (["data.document_mask=true"],
                                        "data.document_mask=true needs documents, and synthetic data has none"),
    "two-minus-one": (["mesh.data=-1", "mesh.model=-1"], "set at most one axis to -1"),
    "attention-impl": (["model.attention=flash"], "model.attention='flash' is unknown; choose one of auto, manual"),
    "heads-vs-model": (["mesh.data=1", "mesh.model=8", "model.n_heads=4", "model.n_kv_heads=4"],
                       "model.n_heads=4 is not divisible by mesh.model=8"),
    "kv-heads-vs-model": (["mesh.data=2", "mesh.model=4", "model.d_model=96", "model.n_heads=12", "model.n_kv_heads=6"],
                          "model.n_kv_heads=6 and mesh.model=4 must divide one another"),
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
    "pipeline-schedule-unknown": (["train.pipeline_schedule=zigzag"], "train.pipeline_schedule='zigzag' is unknown"),
    "interleaved-without-repeats": (["mesh.data=4", "mesh.stage=2", "train.microbatches=2",
                                     "train.pipeline_schedule=interleaved_1f1b"], "needs train.pipeline_repeats > 1"),
    "microbatches-below-stages": (["mesh.data=2", "mesh.stage=4", "train.microbatches=2", "model.n_layers=4"],
                                  "train.microbatches=2 is less than mesh.stage=4"),
    "microbatch-vs-data": (["mesh.data=4", "mesh.stage=2", "train.batch_size=8", "train.microbatches=4"],
                           "each microbatch of batch_size/microbatches rows is split over mesh.data"),
    "unknown-key": (["train.zero_stag=1"], "did you mean 'train.zero_stage'"),
    "wrong-type": (["train.steps=many"], "'train.steps'"),
    "missing-data": (["data.source=/nonexistent/corpus.txt"], "does not exist"),
    "zero-stage-range": (["train.zero_stage=4"], "train.zero_stage=4 must be >= 0 and <= 3"),
    "mesh-preset-unknown": (["mesh.preset=nope"], "unknown mesh preset 'nope'; choose one of"),
    # config
    "yaml-python-tag": (["{F}/evil.yaml"], "meshtrain reads plain YAML only (no Python tags)"),
    "override-python-tag": (['train.seed=!!python/object/apply:os.system ["true"]'], "could not determine a constructor"),
    "yaml-syntax": (["{F}/broken.yaml"], "is not valid YAML"),
    "yaml-not-a-mapping": (["{F}/list.yaml"], "must hold a mapping of sections"),
    "config-file-missing": (["{F}/missing.yaml"], "does not exist; give the path of a YAML file"),
    "override-without-key": (["=5"], "has no key; write key=value"),
    "option-not-key-value": (["--steps", "5"], "unknown option '--steps'; give YAML files and key=value pairs"),
    "model-preset-unknown": (["model.preset=huge"], "model.preset='huge' is unknown"),
    "grad-sync-unknown": (["train.grad_sync=nccl"], "train.grad_sync='nccl' is unknown"),
    "log-every-zero": (["run.log_every=0"], "run.log_every=0 must be > 0"),
    "profile-steps-form": (["train.profile_steps=5"], "is not A:B"),
    "on-nan-unknown": (["train.on_nan=ignore"], "train.on_nan='ignore' is unknown; choose one of skip, rollback, stop"),
    "max-bad-steps-zero": (["train.max_bad_steps=0"], "train.max_bad_steps=0 must be >= 1"),
    "spike-factor-below-one": (["train.spike_factor=0.5"], "must be 0 (off) or > 1"),
    "inject-nan-form": (["train.inject_nan_at=5:2"], "is not STEP or A:B"),
    "checkpoint-every-negative": (["checkpoint.every=-1"], "checkpoint.every=-1 must be >= 0"),
    "on-unreadable-unknown": (["checkpoint.on_unreadable=ignore"], "checkpoint.on_unreadable='ignore' is unknown"),
    # data files
    "bin-odd-bytes": (["data.source={F}/odd.bin"], "not a whole number of uint16 tokens"),
    "bin-dtype-unknown": (["data.source={F}/tokens.bin", "data.bin_dtype=int8"], "data.bin_dtype='int8' is unknown"),
    "bin-ids-above-vocab": (["data.source={F}/tokens.bin"], "token ids up to 299 but model.vocab_size=256"),
    "text-shorter-than-seq-len": (["data.source={F}/short.txt"], "too few for model.seq_len=32"),
    "empty-folder": (["data.source={F}/emptydir"], "is empty (no tokens to train on)"),
    "empty-file": (["data.source={F}/empty.txt"], "is empty (no tokens to train on)"),
    # checkpoints
    "resume-other-shapes": (["model.d_ff=256"], "parameter 'layers.w_down' has shape (2, 128, 64) there but (2, 256, 64)"),
}
# Other commands (full argv); {RUN} is the populated run.dir.
COMMANDS = {
    "unknown-command": (["bogus"], "argument command: invalid choice: 'bogus'"),
    "flag-missing": (["export", "--run", "{RUN}"], "export: the following arguments are required: --out"),
    "flag-wrong-type": (["generate", "--run", "{RUN}", "--tokens", "many"], "argument --tokens: invalid int value"),
    "export-step-missing": (["export", "--run", "{RUN}", "--step", "5", "--out", "{F}/x"], "existing steps: 2"),
    "export-corrupt-step": (["export", "--run", "{F}/corrupt", "--step", "2", "--out", "{F}/y"],
                            "is incomplete or corrupt"),
    "generate-tokens-zero": (["generate", "--run", "{RUN}", "--tokens", "0"], "--tokens"),
    "generate-no-checkpoints": (["generate", "--run", "{F}/emptydir"], "give the run.dir of"),
    "inspect-no-checkpoints": (["inspect", "--run", "{F}/emptydir"], "has no complete checkpoints"),
    "init-from-nothing": (["train", *BASE, "run.dir={F}/fresh", "model.init_from={F}/emptydir"],
                          "is neither an export (meshtrain export --out) nor a run.dir with checkpoints"),
    "run-dir-is-a-file": (["train", *BASE, "run.dir={F}/short.txt"], "is not writable"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad files to point at, and a run.dir as a run leaves it: config, metrics, TensorBoard, a checkpoint."""
    import shutil
    from test_run_start import finished_run
    f = tmp_path_factory.mktemp("bad")
    (f / "evil.yaml").write_text(f'train:\n  steps: !!python/object/apply:os.system ["touch {f}/pwned"]\n')
    (f / "broken.yaml").write_text("train: [1, 2\n")
    (f / "list.yaml").write_text("- train.steps=3\n")
    (f / "odd.bin").write_bytes(b"abc")
    np.arange(300, dtype=np.uint16).tofile(f / "tokens.bin")
    (f / "short.txt").write_text("too short")
    (f / "empty.txt").write_text("")
    (f / "emptydir").mkdir()
    run = f / "run"
    finished_run(BASE + [f"run.dir={run}"])
    shutil.copytree(run, f / "corrupt")
    for data in (f / "corrupt" / "checkpoints" / "2" / "state" / "ocdbt.process_0" / "d").iterdir():
        data.write_bytes(bytes(b ^ 0x5A for b in data.read_bytes()))  # every byte of every array file
    return f


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _check(argv, expected, files, capsys):
    argv = [a.replace("{F}", str(files)).replace("{RUN}", str(files / "run")) for a in argv]
    before = {d: _snapshot(files / d) for d in ("run", "corrupt")}
    code = main(argv)
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert code == 2, (code, err)
    assert lines and lines[-1].startswith("meshtrain: error:"), err  # the error: one line, the last
    assert all(ln.startswith("meshtrain model ") for ln in lines[:-1]), err  # before it at most the run header
    assert expected.replace("{F}", str(files)) in lines[-1], err
    assert "Traceback" not in err and not (files / "pwned").exists()
    for d, snap in before.items():
        assert _snapshot(files / d) == snap, f"{argv} changed {d}/"


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_one_line_error(name, files, capsys):
    args, expected = CASES[name]
    _check(["train", *BASE, "data.source=synthetic", "run.dir={RUN}", *args], expected, files, capsys)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_bad_command_one_line_error(name, files, capsys):
    _check(*COMMANDS[name], files, capsys)


@pytest.mark.parametrize("arg,error", [
    ("train.zero_stag=2", "unknown config key 'train.zero_stag' (command line); did you mean 'train.zero_stage'?"),
    # found out only once the run's checkpointer (and Orbax's background clean-up) has started
    ("model.init_from=/nonexistent/params", "model.init_from='/nonexistent/params' is neither an export"),
], ids=["unknown-key", "init-from-missing"])
def test_cli_process_exit_code_and_no_traceback(tmp_path, arg, error):
    # the tests' XLA_FLAGS (conftest.py: 8 devices, LLVM at -O0): a missing init_from is refused after the step's
    # compile, which takes half the time at -O0
    p = subprocess.run([sys.executable, "-m", "trainer.cli", "train", *BASE, arg, f"run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("meshtrain model ")]
    assert len(lines) == 1 and lines[0].startswith(f"meshtrain: error: {error}"), p.stderr


def test_data_too_small_to_hold_out_an_eval_part(files, capsys):
    (files / "fifty.txt").write_bytes(bytes(range(50)))  # 47 bytes train, 3 held out: too few to evaluate on
    _check(["train", *BASE, "run.dir={RUN}", "data.source={F}/fifty.txt"],
           "data.source '{F}/fifty.txt' has 50 bytes, too few for model.seq_len=32 to both train and hold out an "
           "eval part (34 bytes each); use at least 68 bytes of data, a shorter model.seq_len, or train.eval_every=0",
           files, capsys)


def test_a_plan_larger_than_the_device_stops_before_compiling(tmp_path, capsys):
    """model.seq_len=1000000: the planner's activations exceed any host; one line naming both figures."""
    run = tmp_path / "run"
    code = main(["train", *BASE, "model.seq_len=1000000", f"run.dir={run}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert re.match(r"meshtrain: error: the plan needs [\d.]+ GB per device but this host's available memory "
                    r"(/ 8 local devices )?is [\d.]+ GB \(activations [\d.]+ GB the largest\); reduce it with "
                    r"model\.remat=full, .*train\.memory_check=false", err[0]), err[0]
    assert not run.exists()  # nothing compiled, nothing written: not even run.dir


def test_an_out_of_memory_error_from_xla_is_one_line(tmp_path, capsys):
    """Past the check (train.memory_check=false), XLA's own allocation fails: one line, no checkpoint saved."""
    run = tmp_path / "run"
    code = main(["train", *BASE, "model.seq_len=100000", "train.memory_check=false", "train.steps=2",
                 "checkpoint.every=1", f"run.dir={run}"])
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("meshtrain: error")]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("meshtrain: error: out of memory while running the train steps (reported at step ") \
        and "Out of memory allocating" in err[0], err[0]
    assert not list((run / "checkpoints").glob("[0-9]*")), "a state that ran out of memory was saved"


class _Compiled(Exception):
    """Raised where the run would compile its step: its start-up is over."""


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tuple[Path, int, int]:
    """Data prepared with a trained tokenizer whose vocabulary 8 does not divide: (its .bin, the vocabulary, the
    next multiple of 8 by hand)."""
    import json
    import math
    d = tmp_path_factory.mktemp("bpe")
    (d / "words.txt").write_text(" ".join(f"w{i % 97}x{i % 13}" for i in range(4000)))
    assert main(["prepare", str(d / "words.txt"), "--train-tokenizer", "301", "--out", str(d / "bpe.bin")]) == 0
    vocab = json.loads((d / "bpe.bin.json").read_text())["vocab_size"]
    assert vocab % 8, f"the trained vocabulary ({vocab}) must not divide by 8 for these tests"
    return d / "bpe.bin", vocab, math.ceil(vocab / 8) * 8


def test_a_trained_vocabulary_is_padded_to_a_multiple_of_mesh_model(bpe, tmp_path, monkeypatch, capsys):
    """Issue 65 item 11: a vocabulary from `prepare --train-tokenizer` that mesh.model does not divide was refused
    (pad it by hand). Now model.vocab_size is the next multiple of mesh.model, said in one line, and the embedding's
    rows are split that way."""
    from trainer.run.context import Run
    data, vocab, padded = bpe
    started = []

    def compiled(self):
        started.append(self.s)
        raise _Compiled
    monkeypatch.setattr(Run, "_compile", compiled)
    capsys.readouterr()
    with pytest.raises(_Compiled):
        main(["train", *BASE, "mesh.data=1", "mesh.model=8", f"data.source={data}", f"run.dir={tmp_path / 'run'}"])
    said = capsys.readouterr().err.splitlines()
    (s,) = started
    embed = s.shardings["params"]["embed"].shard_shape(s.param_shapes["embed"].shape)
    assert s.model.vocab_size == padded and s.param_shapes["embed"].shape[0] == padded and embed[0] == padded // 8
    assert said[0] == (f"meshtrain: warning: model.vocab_size={padded}: the data's vocabulary of {vocab} tokens padded "
                       f"up to a multiple of mesh.model=8 ({padded - vocab} rows no token uses; an explicit "
                       "model.vocab_size overrides)"), said


def test_an_explicit_vocabulary_that_mesh_model_does_not_divide_names_the_padded_size(bpe, files, capsys):
    """An explicit model.vocab_size is used as given: one mesh.model does not divide is refused, the fix naming the
    padded size (the next multiple of mesh.model)."""
    data, vocab, padded = bpe
    _check(["train", *BASE, "run.dir={RUN}", "mesh.data=1", "mesh.model=8", f"data.source={data}",
            f"model.vocab_size={vocab}"],
           f"model.vocab_size={vocab} is not divisible by mesh.model=8; pick a mesh.model that divides {vocab} or "
           f"change model.vocab_size, e.g. model.vocab_size={padded}", files, capsys)
