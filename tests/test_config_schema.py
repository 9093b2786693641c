"""The config schema: every key's range checked by the loader in one line, the closest key to a typo, the warning of
a run that is all warmup, and `--help` and docs/config.md written from the schema (issue 44, items 4-7 and 11)."""
import dataclasses
import importlib.util
import re
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from trainer.cli import main
from trainer.config import Config, load_config, model_config, validate
from trainer.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
HUGE = str(10 ** 30)


def _schema_keys(node=Config, prefix=""):
    """(dotted key, type, field) of every key, read from the dataclasses themselves: a new key is fuzzed unasked."""
    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            yield from _schema_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            t = hints[f.name]
            args = [a for a in typing.get_args(t) if a is not type(None)]
            yield f"{prefix}{f.name}", (args[0] if typing.get_origin(t) is typing.Union else t), f


KEYS = list(_schema_keys())


def _one_line(e: UserError, key: str):
    msg = str(e)
    assert "\n" not in msg and msg.strip(), msg
    assert key in msg, f"the message does not name {key}: {msg}"


def test_fuzz_every_key_is_accepted_or_refused_in_one_line():
    """Every key of the schema gets a wrong type, a negative, zero and a huge value through the loader: each is
    accepted (and then validate and model_config pass or refuse in one line) or refused in one line naming the key,
    never another exception. The issue's examples land on the side they belong to."""
    t0 = time.perf_counter()
    verdicts = {}
    for key, kind, _ in KEYS:
        values = ["nonsense", "-1", "0", HUGE] + (["[1, 2]"] if kind is str else [])
        for v in values:
            try:
                cfg = load_config([f"{key}={v}"])
            except UserError as e:
                _one_line(e, key)
                verdicts[f"{key}={v}"] = "refused"
                continue
            verdicts[f"{key}={v}"] = "accepted"
            for check in (lambda: validate(cfg, 8), lambda: model_config(cfg)):
                try:
                    check()
                except UserError as e:
                    assert "\n" not in str(e), str(e)
    assert len(verdicts) >= 4 * len(KEYS) >= 400
    legal = ["mesh.data=-1", "mesh.model=-1", "checkpoint.every=0", "checkpoint.keep=0", "train.grad_clip=0",
             "train.eval_every=0", "train.warmup_steps=0", "train.weight_decay=0", "train.spike_factor=0",
             "model.loss_chunk=0", "train.zero_stage=0", "model.attention_block=0", "train.sync_warmup=0"]
    refused = ["train.lr=-1", "train.lr=0", "train.warmup_steps=-1", "train.grad_clip=-1", "train.weight_decay=-1",
               "train.steps=0", "train.microbatches=0", "train.batch_size=0", "train.min_lr_ratio=-1",
               f"train.min_lr_ratio={HUGE}", f"train.zero_stage={HUGE}", "model.d_model=0", "model.n_layers=-1",
               "model.seq_len=0", "model.loss_chunk=-1", "mesh.data=0", "run.log_every=0", "train.seed=-1",
               "train.grad_sync=nonsense", "model.preset=nonsense", "train.steps=nonsense", "run.plugins=nonsense"]
    assert [k for k in legal if verdicts[k] != "accepted"] == []
    assert [k for k in refused if verdicts[k] != "refused"] == []
    assert time.perf_counter() - t0 < 20  # ~1.5 s here; a loader that got slow shows up


@pytest.mark.parametrize("override,message", [
    # item 4: nonsense settings that trained
    ("train.lr=-0.001", "train.lr=-0.001 must be > 0"),
    ("train.warmup_steps=-5", "train.warmup_steps=-5 must be >= 0"),
    ("train.grad_clip=-1", "train.grad_clip=-1.0 must be >= 0"),
    ("train.weight_decay=-0.1", "train.weight_decay=-0.1 must be >= 0"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio=2.0 must be >= 0 and <= 1"),
    ("train.steps=0", "train.steps=0 must be >= 1"),
    # item 5: a ZeroDivisionError before
    ("train.microbatches=0", "train.microbatches=0 must be >= 1"),
    ("train.lr=inf", "train.lr=inf is not a finite number"),
    ("train.b2=1", "train.b2=1.0 must be >= 0 and < 1"),
    ("model.n_heads=0", "model.n_heads=0 must be > 0 or null"),
    ("train.steps=${train.lr}", "config key 'train.steps': While dereferencing interpolation"),
    ("train.lr=${train.seed}", "train.lr=0.0 must be > 0"),  # an interpolated value is checked too
])
def test_a_value_out_of_range_is_refused_by_the_loader(override, message):
    with pytest.raises(UserError) as e:
        load_config(["model.preset=tiny", override])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_refusals_through_the_cli_exit_2_in_one_line_and_leave_run_dir_alone(tmp_path, capsys):
    """In-process for several values, and once as a process of its own (exit status, no traceback, no folder)."""
    absent, kept = tmp_path / "absent", tmp_path / "kept"
    kept.mkdir()
    (kept / "config.yaml").write_text("train: {steps: 3}\n")
    for args in (["train.microbatches=0"], ["train.lr=-0.001"], ["modle.preset=tiny"], ["train.min_lr_ratio=2"]):
        for run_dir in (absent, kept):
            assert main(["train", "model.preset=tiny", f"run.dir={run_dir}", *args]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("meshtrain: error: "), err
    assert not absent.exists() and [p.name for p in kept.iterdir()] == ["config.yaml"]
    assert (kept / "config.yaml").read_text() == "train: {steps: 3}\n"
    p = subprocess.run([sys.executable, "-m", "trainer.cli", "train", "model.preset=tiny", "train.steps=0",
                        f"run.dir={absent}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "meshtrain: error: train.steps=0 must be >= 1: optimizer steps of the run (resuming runs up to this step)"], \
        p.stderr
    assert not absent.exists()


@pytest.mark.parametrize("typo,suggested", [
    ("modle.preset=tiny", "'model.preset'"),
    ("trian.steps=10", "'train.steps'"),
    ("train.learning_rate=0.1", "'train.lr'"),
    ("steps=10", "'train.steps'"),
    ("trian=10", "the section 'train'"),
    ("model.hidden_size=64", "'model.d_model'"),
    ("train.max_steps=5", "'train.steps'"),
    ("train.gradient_accumulation_steps=2", "'train.microbatches'"),
    ("train.zero_stag=1", "'train.zero_stage'"),
    ("train.warmup=3", "'train.warmup_steps'"),
    ("train.source=x", "'data.source'"),
    ("optim.lr=0.1", "'train.lr'"),
    ("checkpont.every=5", "'checkpoint.every'"),
    ("mesh.dat=2", "'mesh.data'"),
    ("model.seqlen=64", "'model.seq_len'"),
    ("run.log_evry=5", "'run.log_every'"),
    ("global_batch_size=8", "'train.batch_size'"),
])
def test_the_closest_key_compares_whole_dotted_keys_and_sections(typo, suggested):
    with pytest.raises(UserError) as e:
        load_config([typo])
    msg = str(e.value)
    assert f"did you mean {suggested}" in msg and "\n" not in msg, msg
    assert typo.split("=")[0] in msg  # the key as given, whole


def test_every_unknown_key_of_a_layer_is_named_at_once():
    with pytest.raises(UserError) as e:
        load_config(["modle.preset=tiny", "trian.steps=10", "train.lr=0.1"])
    msg = str(e.value)
    assert "'modle.preset' (did you mean 'model.preset'?)" in msg and "'trian.steps' (did you mean 'train.steps'?)" \
        in msg, msg


class _Compiled(Exception):
    """Raised where the run would compile its step: the start-up is over."""


@pytest.mark.parametrize("steps,warned", [(30, True), (62, False)])
def test_a_run_that_is_all_warmup_is_warned_at_start(steps, warned, tmp_path, monkeypatch, capsys):
    """Default warmup_steps=60: a run of 61 steps or fewer rises to the peak lr and never decays (the schedule says
    so: its last step's rate is the peak); the run says so on stderr at start, before compiling its step."""
    from trainer.run.context import Run

    def compiled(self):
        raise _Compiled
    monkeypatch.setattr(Run, "_compile", compiled)
    with pytest.raises(_Compiled):
        main(["train", "model.preset=tiny", "model.n_layers=1", "mesh.data=-1", "train.batch_size=8",
              f"train.steps={steps}", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    expected = f"meshtrain: warning: train.warmup_steps=60 fills the run of train.steps={steps}"
    assert (expected in err) == warned, f"stderr: {err!r}"
    if warned:
        assert "never decays" in err and "set train.warmup_steps below" in err, err


@pytest.mark.parametrize("steps", [2, 30, 61, 62, 200])
def test_the_warning_is_given_exactly_when_the_schedule_never_decays(steps, caplog):
    from trainer.optim import make_optimizer, warn_if_no_decay
    cfg = load_config([f"train.steps={steps}"])
    _, schedule = make_optimizer(cfg.train, {})
    decays = float(schedule(steps - 1)) < cfg.train.lr * (1 - 1e-6)
    warn_if_no_decay(cfg.train)
    assert decays == (steps > 61) and bool(caplog.records) == (not decays), (steps, caplog.records)


def _default_text(value):
    """How the help and the docs write a default: YAML's spelling."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else "''" if value == "" \
        else str(value)


def _default(f):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_train_help_lists_every_key_with_type_default_allowed_values_and_meaning(capsys):
    """Item 11: `meshtrain train --help` showed bare key names."""
    assert main(["train", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = {int: "int", float: "float", str: "str", bool: "bool"}
    for key, kind, f in KEYS:
        i = next((i for i, ln in enumerate(lines) if ln.split()[:1] == [key]), None)
        assert i is not None, f"{key} is not in the help"
        assert len(lines[i].split()) > 1, f"the help shows the bare key name: {lines[i]!r}"
        head = lines[i].split(None, 1)[1]
        if typing.get_origin(kind) is list:
            assert head.startswith("list of "), (key, lines[i])
        else:
            assert head.split()[0] == names[kind], (key, lines[i])
        assert f"= {_default_text(_default(f))}" in head, (key, lines[i])
        meaning = lines[i + 1].strip()
        assert meaning and not meaning.startswith(tuple(k for k, _, _ in KEYS)), (key, lines[i + 1])
    train_help = "\n".join(lines)
    assert "train.lr" in train_help and "> 0" in train_help


def test_simulate_help_lists_the_sim_keys_the_same_way(capsys):
    assert main(["simulate", "--help"]) == 0
    out = capsys.readouterr().out
    for key, _, f in KEYS:
        if key.startswith("sim."):
            assert re.search(rf"^  {re.escape(key)} .*= {re.escape(_default_text(_default(f)))}", out, re.M), key


def _docs_script():
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "scripts" / "config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_config_md_lists_every_key_as_the_schema_says():
    """Item 11: docs/config.md lacked train.pipeline_schedule. Every key has a row with its default; the table is the
    one the schema writes (python scripts/config_docs.py), so it cannot drift."""
    text = (ROOT / "docs" / "config.md").read_text()
    unnamed = [k for k, _, _ in KEYS if not re.search(rf"\b{k.split('.')[1]}\b", text)
               and f"{k.split('.')[0]}.*" not in text]  # a key named nowhere, not even as "sim.*"
    assert unnamed == [], f"docs/config.md does not name {unnamed}"
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \|[^|]*\| `([^`]*)` \|", text, re.M)}
    missing = [k for k, _, _ in KEYS if k not in rows]
    assert missing == [], f"docs/config.md has no row for {missing}"
    assert {k: rows[k] for k, _, f in KEYS if rows[k] != _default_text(_default(f))} == {}
    assert _docs_script().generated(text) == text, "docs/config.md drifted: run python scripts/config_docs.py"


def test_every_key_declares_its_meaning_and_every_number_its_range():
    """So that a new key arrives with its range and its line of docs: a number without a rule fails here."""
    from trainer.schema import in_range
    for key, kind, f in KEYS:
        assert f.metadata.get("doc"), f"{key} has no meaning"
        if kind in (int, float):
            rule = f.metadata.get("allowed")
            assert isinstance(rule, str), f"{key} is a number without a range"
            default = _default(f)
            assert default is None or in_range(default, rule), f"{key}'s default {default} is outside {rule}"


def test_range_rules_read_as_written():
    from trainer.schema import in_range
    assert [in_range(v, "0 (off) or > 1") for v in (0, 0.5, 1, 1.5)] == [True, False, False, True]
    assert [in_range(v, "-1 (the rest) or >= 1") for v in (-2, -1, 0, 1, 7)] == [False, True, False, True, True]
    assert [in_range(v, ">= 0 and < 1") for v in (-0.1, 0, 0.99, 1)] == [False, True, True, False]


def test_aliases_name_real_keys():
    """The other trainers' names point at keys that exist, and none is one of our own leaf names."""
    from trainer.sections import ALIASES
    keys = {k for k, _, _ in KEYS}
    assert {a: k for a, k in ALIASES.items() if k not in keys or a in {k.split(".")[1] for k in keys}} == {}
