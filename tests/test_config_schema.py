"""The config schema: every key's range checked by the loader in one line, the closest key to a typo, the warning of
a run that is all warmup, and `--help` and docs/config.md written from the schema (issue 44, items 4-7 and 11)."""
import contextlib
import dataclasses
import importlib.util
import logging
import re
import signal
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest

from trainer.cli import main
from trainer.config import Config, load_config, model_config, replace, validate
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


SCHEMA_KEYS = list(_schema_keys())


def _one_line(e: UserError, key: str):
    msg = str(e)
    assert "\n" not in msg and msg.strip(), msg
    assert key in msg, f"the message does not name {key}: {msg}"


@contextlib.contextmanager
def _deadline(seconds: float, what: str):
    """A TimeoutError naming `what` if the block runs past `seconds`: a hang fails the test instead of stalling it."""
    def fire(*_):
        raise TimeoutError(f"{what} ran past {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _largest(rule: str):
    """The largest value a range rule allows ('... <= 2**31-1' -> 2147483647), to push a legal extreme through."""
    top = re.findall(r"<= (\S+)", rule)
    if not top:
        return None
    m = re.fullmatch(r"2\*\*(\d+)(-1)?", top[-1])
    return 2 ** int(m.group(1)) - bool(m.group(2)) if m else top[-1]


def _downstream(cfg, seen: set, deep: bool):
    """What the commands compute from an accepted config, in process and without compiling: validate, the model,
    `meshtrain plan`'s estimate for 8 devices of this machine's kind, and `meshtrain simulate` up to 64 devices.
    Each returns or refuses with a one-line UserError. A config whose plan-relevant sections were planned already
    is not planned again."""
    from trainer.hardware import get_device
    from trainer.plan.core import estimate, strategy_of
    from trainer.plan.simulate import simulate
    cpu = get_device("cpu")
    planned = repr((cfg.model, cfg.mesh, cfg.train, cfg.plan))
    # a cluster size where mesh.data is -1; clusters of at most 64 devices (the default grows to 16384)
    sim = replace(cfg, sim={"devices": cfg.sim.devices or 8, "max_devices": min(cfg.sim.max_devices, 64)})
    steps = [lambda: validate(cfg, 8), lambda: model_config(cfg)]
    steps += [lambda: simulate(sim, out=lambda *_: None)] if deep else []
    if deep and planned not in seen:
        seen.add(planned)
        steps.append(lambda: estimate(model_config(cfg), cfg.train, strategy_of(cfg, 8), cpu, 1, "float32").step_s)
    for run in steps:
        try:
            with np.errstate(over="raise", invalid="raise"):
                run()
        except UserError as e:
            assert "\n" not in str(e), str(e)


@pytest.mark.parametrize("deep", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fuzz_every_key_is_accepted_or_refused_in_one_line(deep):
    """Every key of the schema gets a wrong type, a negative, zero, a huge value and its own largest legal value
    through the loader: each is accepted (and then the planner and the simulator run on it or refuse it in one
    line) or refused in one line naming the key, never another exception or a hang. The issue's examples land on
    the side they belong to. The default run checks validate and the model config; -m slow also plans (~3 s)."""
    verdicts, broken, planned = {}, [], set()
    for key, kind, f in SCHEMA_KEYS:
        values = ["nonsense", "-1", "0", HUGE] + (["[1, 2]"] if kind is str else [])
        if isinstance(f.metadata.get("allowed"), str) and _largest(f.metadata["allowed"]) is not None:
            values.append(str(_largest(f.metadata["allowed"])))
        for v in values:
            args = [f"{key}={v}"]
            try:
                with _deadline(10, args[0]):
                    cfg = load_config(args)
                    verdicts[f"{key}={v}"] = "accepted"
                    _downstream(cfg, planned, deep)
            except UserError as e:
                _one_line(e, key)
                verdicts[f"{key}={v}"] = "refused"
            except Exception as e:  # noqa: BLE001 - every one is a failure, listed together
                broken.append(f"{' '.join(args)}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    assert broken == []
    assert len(verdicts) >= 4 * len(SCHEMA_KEYS) >= 400
    legal = ["mesh.data=-1", "mesh.model=-1", "checkpoint.every=0", "checkpoint.keep=0", "train.grad_clip=0",
             "train.eval_every=0", "train.warmup_steps=0", "train.weight_decay=0", "train.spike_factor=0",
             "model.loss_chunk=0", "train.zero_stage=0", "model.attention_block=0", "train.sync_warmup=0",
             "train.lr=0", "train.steps=9223372036854775807", "model.seq_len=2147483647"]
    refused = ["train.lr=-1", "train.warmup_steps=-1", "train.grad_clip=-1", "train.weight_decay=-1",
               "train.steps=0", "train.microbatches=0", "train.batch_size=0", "train.min_lr_ratio=-1",
               f"train.min_lr_ratio={HUGE}", f"train.zero_stage={HUGE}", "model.d_model=0", "model.n_layers=-1",
               "model.seq_len=0", "model.loss_chunk=-1", "mesh.data=0", "run.log_every=0", "train.seed=-1",
               "train.grad_sync=nonsense", "model.preset=nonsense", "train.steps=nonsense", "run.plugins=nonsense",
               *[f"{k}={HUGE}" for k, kind, _ in SCHEMA_KEYS if kind is int]]
    assert [k for k in legal if verdicts[k] != "accepted"] == []
    assert [k for k in refused if verdicts[k] != "refused"] == []


def test_every_number_has_a_ceiling_within_its_type():
    """Sizes and counts fit the integers XLA and the checkpoints keep them in, and every float stays a finite float32
    (a step computes with them in float32): 2**63 and twice float32's largest are refused by every key."""
    from trainer.config.schema import in_range
    too_big = {int: 2 ** 63, float: 2.0 * float(np.finfo(np.float32).max)}
    unbounded = [k for k, kind, f in SCHEMA_KEYS if kind in too_big and in_range(too_big[kind], f.metadata["allowed"])]
    assert unbounded == []
    for override, message in [("train.lr=1e308", "train.lr=1e+308 must be >= 0 and <= 3.4e38"),
                              ("model.seq_len=2147483648", "model.seq_len=2147483648 must be > 0 and <= 2**31-1"),
                              ("sim.max_devices=1073741824", "sim.max_devices=1073741824 must be >= 1 and <= 2**25")]:
        with pytest.raises(UserError, match=re.escape(message)):
            load_config([override])
    assert load_config(["train.steps=4294967296"]).train.steps == 2 ** 32  # a long run, legal


def test_huge_legal_values_plan_and_simulate_in_one_line_or_run(capsys):
    """The values that hung or raised in the planner and the simulator: a batch whose loss tiles into more vocabulary
    blocks than a loop could count, the most a simulation may draw, a pipeline table past its size."""
    from trainer.plan.command import main as plan
    from trainer.plan.simulate import simulate
    with _deadline(20, "plan train.batch_size=2147483640"):
        assert plan(["model.preset=tiny", "train.batch_size=2147483640", "mesh.data=8"]) == 2  # does not fit
    capsys.readouterr()
    for args, message in [(["sim.steps=33554432"], "simulate would draw 33554432 steps x "),
                          (["sim.max_devices=33554432"], "simulate would draw 64 steps x 33554432 devices"),
                          (["mesh.stage=2", "train.microbatches=262144", "train.batch_size=1048576"],
                           "= 524288 pipeline ops, more than the 262144")]:
        with pytest.raises(UserError, match=re.escape(message)), _deadline(10, str(args)):
            simulate(load_config(["model.preset=tiny", "mesh.data=4", *args]), out=lambda *_: None)


def test_vocab_blocks_are_the_most_that_divide_the_vocabulary_whatever_its_size():
    """models/objectives/cross_entropy.py counted every candidate up to `at_most` (a batch of 10**30 rows never
    returned); its answer against that count, and at sizes the count cannot reach."""
    from models.objectives.cross_entropy import vocab_blocks
    for vocab in range(1, 130):
        for at_most in range(0, 140, 3):
            assert vocab_blocks(vocab, at_most) == max(b for b in range(1, max(1, at_most) + 1) if vocab % b == 0)
    with _deadline(5, "vocab_blocks of huge values"):
        assert vocab_blocks(2 ** 31 - 1, 10 ** 30) == 2 ** 31 - 1  # a prime: itself, or 1
        assert vocab_blocks(2 ** 31 - 1, 2 ** 31 - 2) == 1
        assert vocab_blocks(128256, 10 ** 30) == 128256 and vocab_blocks(128256, 1000) == 768  # 2^8 x 3 x 167


@pytest.mark.parametrize("override,message", [
    # item 4: nonsense settings that trained
    ("train.lr=-0.001", "train.lr=-0.001 must be >= 0 and <= 3.4e38"),
    ("train.warmup_steps=-5", "train.warmup_steps=-5 must be >= 0 and <= 2**63-1"),
    ("train.grad_clip=-1", "train.grad_clip=-1.0 must be >= 0 and <= 3.4e38"),
    ("train.weight_decay=-0.1", "train.weight_decay=-0.1 must be >= 0 and <= 3.4e38"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio=2.0 must be >= 0 and <= 1"),
    ("train.steps=0", "train.steps=0 must be >= 1 and <= 2**63-1"),
    # item 5: a ZeroDivisionError before
    ("train.microbatches=0", "train.microbatches=0 must be >= 1 and <= 2**31-1"),
    ("train.lr=inf", "train.lr=inf is not a finite number"),
    ("train.b2=1", "train.b2=1.0 must be >= 0 and < 1"),
    ("model.n_heads=0", "model.n_heads=0 must be > 0 and <= 2**31-1 or null"),
    ("train.steps=${train.lr}", "config key 'train.steps': While dereferencing interpolation"),
    ("train.lr=${mesh.data}", "train.lr=-1.0 must be >= 0"),  # an interpolated value is checked too
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
        "meshtrain: error: train.steps=0 must be >= 1 and <= 2**63-1: optimizer steps of the run (resuming runs up to "
        "this step)"], \
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
    # an exact name in another section beats a look-alike in the one given
    ("model.batch_size=8", "'train.batch_size'"),
    ("train.vocab_size=8", "'model.vocab_size'"),
    ("mesh.zero_stage=1", "'train.zero_stage'"),
    ("train.log_every=5", "'run.log_every'"),
    ("train.every=5", "'checkpoint.every'"),
    ("checkpoint.eval_every=5", "'train.eval_every'"),
    ("plan.devices=8", "'plan.device'? (or 'sim.devices')"),  # one typo away in its own section: both named
    # other trainers' names
    ("mesh.dp=2", "'mesh.data'"),
    ("tp=2", "'mesh.model'"),
    ("pp=2", "'mesh.stage'"),
    ("train.wd=0.1", "'train.weight_decay'"),
    ("model.num_layers=2", "'model.n_layers'"),
    ("tensor_model_parallel_size=2", "'mesh.model'"),
    ("model.base_emb_dim=64", "'model.d_model'"),
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


def _one_typo(a: str, b: str) -> bool:
    """b is one of the strings one letter changed, added or dropped, or two neighbours swapped, away from a."""
    letters = set(a + b)
    near = {a[:i] + a[i + 1:] for i in range(len(a))} | {a[:i] + c + a[i:] for i in range(len(a) + 1) for c in letters}
    near |= {a[:i] + c + a[i + 1:] for i in range(len(a)) for c in letters}
    near |= {a[:i] + a[i + 1] + a[i] + a[i + 2:] for i in range(len(a) - 1)}
    return a != b and b in near


def test_every_key_put_into_every_other_section_is_answered_with_itself():
    """`model.batch_size` was answered 'model.vocab_size': 38 such cases. Each key under each section that lacks
    its name: the message names the key; first, unless another section has the name too or the section given
    has a key one typo away (then that first, the key after it)."""
    from trainer.config import _closest
    keys = [k for k, _, _ in SCHEMA_KEYS]
    sections = list(dict.fromkeys(k.split(".")[0] for k in keys))
    wrong = []
    for key in keys:
        if key.count(".") > 1:  # a section's own section's (model.lora.rank): answered under its parent
            continue
        section, leaf = key.split(".")
        for other in sections:
            if f"{other}.{leaf}" in keys:
                continue
            msg = _closest(f"{other}.{leaf}")  # what the loader says of an unknown key (tested above)
            named = re.findall(r"'([\w.]+)'", msg.partition("did you mean")[2])
            shared = [k for k in keys if k.split(".")[1] == leaf and k != key and k.count(".") == 1]
            typo = [k for k in keys if k.split(".")[0] == other and _one_typo(leaf, k.split(".")[1])]
            if key not in named or (named[0] != key and not shared and not typo):
                wrong.append(f"{other}.{leaf}: {msg}")
    assert wrong == []


@pytest.mark.parametrize("value,why", [
    ("[nan, 1, 4, 512]", "holds a number that is not finite"),
    ("[inf, 1, 4, 512]", "holds a number that is not finite"),
    ("[8, 4, 1, 512]", "low_freq_factor 4.0 and high_freq_factor 1.0 are not 0 < low < high"),
    ("[8, 1, 1, 512]", "are not 0 < low < high"),  # transformers divides by high - low
    ("[0.5, 1, 4, 512]", "factor 0.5 is below 1"),
    ("[8, 1, 4, 512.5]", "original_max_position_embeddings 512.5 is not a whole number"),
    ("[8, 1, 4, 0.5]", "original_max_position_embeddings 0.5 is not a whole number"),
    ("[8, 1, 4]", "has 3 numbers"),
])
def test_rope_scaling_is_refused_where_transformers_llama3_rules_refuse_it(value, why):
    with pytest.raises(UserError) as e:
        load_config([f"model.rope_scaling={value}"])
    _one_line(e.value, "model.rope_scaling")
    assert why in str(e.value), str(e.value)


def test_rope_scaling_of_llama_3_1_is_accepted():
    cfg = load_config(["model.preset=tiny", "model.rope_scaling=[8, 1, 4, 8192]"])
    assert model_config(cfg).rope_scaling == (8.0, 1.0, 4.0, 8192)


def test_pipeline_repeats_without_a_pipeline_are_refused():
    """Its doc says it needs mesh.stage > 1; with mesh.stage=1 it was accepted and did nothing."""
    with pytest.raises(UserError) as e:
        validate(load_config(["model.preset=tiny", "train.pipeline_repeats=2"]), 8)
    _one_line(e.value, "train.pipeline_repeats=2")
    assert "mesh.stage=1" in str(e.value)


@pytest.mark.parametrize("remat", ["none", "dots", "full", "sublayer"])
@pytest.mark.parametrize("stage", [1, 2])
def test_a_remat_the_pipeline_ignores_is_warned(remat, stage, caplog):
    """Warned exactly where the planner's `executed` (the layout as the trainer runs it) drops the remat policy."""
    from trainer.config import _warn_once
    from trainer.plan.core import strategy_of
    from trainer.plan.types import executed
    _warn_once.cache_clear()  # once per process: another test may have warned first
    cfg = load_config(["model.preset=tiny", f"mesh.stage={stage}", "train.microbatches=2", f"model.remat={remat}"])
    with caplog.at_level(logging.WARNING):
        st = strategy_of(cfg, 8)
    ignored = executed(st).remat != st.remat
    warned = [r.getMessage() for r in caplog.records if f"model.remat={remat} does nothing" in r.getMessage()]
    assert len(warned) == ignored and (stage > 1 and remat in ("dots", "full")) == ignored, warned


def test_a_step_range_in_a_yaml_file_stays_a_range(tmp_path):
    """YAML 1.1 reads an unquoted 5:8 as the base-60 integer 308, which inject_nan_at took for step 308."""
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  inject_nan_at: 5:8\n  profile_steps: 2:3\n  steps: 1_000\n  lr: 1e-3\n")
    t = load_config([str(f)]).train
    assert (t.inject_nan_at, t.profile_steps, t.steps, t.lr) == ("5:8", "2:3", 1000, 0.001)
    f.write_text("train:\n  steps: 1:30\n")  # not 90
    with pytest.raises(UserError) as e:
        load_config([str(f)])
    _one_line(e.value, "train.steps")


def test_a_yaml_error_names_the_problem_and_its_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(UserError) as e:
        load_config([str(f)])
    assert str(e.value) == f"config file '{f}' is not valid YAML: found duplicate key steps (line 3, column 3)"


def test_lr_0_leaves_the_weights_as_they_are():
    """train.lr=0 (an evaluation run, a data check) is legal: every update is 0, weight decay included."""
    import jax
    import jax.numpy as jnp
    from trainer.optim import make_optimizer
    for optimizer in ("adamw", "sgd"):
        tx, _ = make_optimizer(load_config(["train.lr=0", f"train.optimizer={optimizer}"]).train, {"w": True})
        params = {"w": jnp.ones(4)}
        updates, _ = jax.jit(lambda p, s: tx.update({"w": jnp.full(4, 3.0)}, s, p))(params, tx.init(params))
        assert not jnp.any(updates["w"]), (optimizer, updates)


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


@pytest.mark.parametrize("steps,warmup,lr", [(2, 60, 1.5e-3), (30, 60, 1.5e-3), (61, 60, 1.5e-3), (62, 60, 1.5e-3),
                                           (200, 60, 1.5e-3), (2, 1, 1.5e-3), (5, 4, 1.5e-3), (5, 5, 1.5e-3),
                                           (30, 60, 0.0)])
def test_the_warning_is_given_exactly_when_the_warmup_asked_for_fills_the_run(steps, warmup, lr, caplog):
    """Warned exactly when the run's rates are not the warmup asked for (lr x k / warmup_steps at step k, by hand)
    because the run ends first, and the last step's rate is the peak: never when the asked warmup fits in the run
    (warmup_steps=1 of 2 steps: rates 0 then the peak), nor when the rate stays 0 (train.lr=0)."""
    from trainer.optim import make_optimizer, warn_if_no_decay
    t = load_config([f"train.steps={steps}", f"train.warmup_steps={warmup}", f"train.lr={lr}"]).train
    _, schedule = make_optimizer(t, {})
    rates = [float(schedule(k)) for k in range(steps)]
    cut = any(abs(r - lr * k / warmup) > 1e-9 for k, r in enumerate(rates[:warmup]))
    never_decays = lr > 0 and rates[-1] >= lr * (1 - 1e-6)
    warn_if_no_decay(t)
    assert bool(caplog.records) == (cut and never_decays), (rates, caplog.records)


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
    for key, kind, f in SCHEMA_KEYS:
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
        assert meaning and not meaning.startswith(tuple(k for k, _, _ in SCHEMA_KEYS)), (key, lines[i + 1])
    train_help = "\n".join(lines)
    assert "train.lr" in train_help and "> 0" in train_help


def test_simulate_help_lists_the_sim_keys_the_same_way(capsys):
    assert main(["simulate", "--help"]) == 0
    out = capsys.readouterr().out
    for key, _, f in SCHEMA_KEYS:
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
    unnamed = [k for k, _, _ in SCHEMA_KEYS if not re.search(rf"\b{k.split('.')[1]}\b", text)
               and f"{k.split('.')[0]}.*" not in text]  # a key named nowhere, not even as "sim.*"
    assert unnamed == [], f"docs/config.md does not name {unnamed}"
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \|[^|]*\| `([^`]*)` \|", text, re.M)}
    missing = [k for k, _, _ in SCHEMA_KEYS if k not in rows]
    assert missing == [], f"docs/config.md has no row for {missing}"
    assert {k: rows[k] for k, _, f in SCHEMA_KEYS if rows[k] != _default_text(_default(f))} == {}
    assert _docs_script().generated(text) == text, "docs/config.md drifted: run python scripts/config_docs.py"


def test_every_key_declares_its_meaning_and_every_number_its_range():
    """So that a new key arrives with its range and its line of docs: a number without a rule fails here."""
    from trainer.config.schema import in_range
    for key, kind, f in SCHEMA_KEYS:
        assert f.metadata.get("doc"), f"{key} has no meaning"
        if kind in (int, float):
            rule = f.metadata.get("allowed")
            assert isinstance(rule, str), f"{key} is a number without a range"
            default = _default(f)
            assert default is None or in_range(default, rule), f"{key}'s default {default} is outside {rule}"


def test_range_rules_read_as_written():
    from trainer.config.schema import in_range
    assert [in_range(v, "0 (off) or > 1") for v in (0, 0.5, 1, 1.5)] == [True, False, False, True]
    assert [in_range(v, "-1 (the rest) or >= 1") for v in (-2, -1, 0, 1, 7)] == [False, True, False, True, True]
    assert [in_range(v, ">= 0 and < 1") for v in (-0.1, 0, 0.99, 1)] == [False, True, True, False]


def test_aliases_name_real_keys():
    """The other trainers' names point at keys that exist, and none is one of our own leaf names."""
    from trainer.config.sections import ALIASES
    keys = {k for k, _, _ in SCHEMA_KEYS}
    assert {a: k for a, k in ALIASES.items() if k not in keys or a in {k.split(".")[1] for k in keys}} == {}
