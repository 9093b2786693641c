"""train.memory_check on an accelerator's terms, here on CPU: the planner held only by a wide margin, then the
compiled step's own figures (XLA's memory analysis) against the device's limit, before any token, loss mask,
checkpoint or weight file is opened. MESHTRAIN_TEST_DEVICE_BYTES (test-only) sets the limit and that policy.

Which files a run opens is read from the kernel (inotify), so numpy's maps and Orbax's tensorstore reads count
too; which program the run compiles and steps with, from a wrapper around the jitted train step."""
import ctypes
import dataclasses
import importlib.util
import io
import json
import os
import re
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from rich.console import Console

from trainer import load_config, train
from trainer.cli import main
from trainer.errors import UserError
from trainer.run import memory_check

FIX = Path(__file__).parent / "fixtures" / "hf" / "head_dim_long_f32"  # a 2-layer Llama, vocab 384
ONE = jax.devices()[:1]
# warmup_steps=1: a 3-step run is not warned that its warmup fills it (a line that may precede a refusal)
RUN = ["model.seq_len=32", "train.batch_size=8", "model.remat=full", "train.optimizer=sgd", "train.grad_clip=0",
       "train.eval_every=0", "train.warmup_steps=1", "run.progress=false",
       "data.tokenizer_check=false"]  # the data's 300-token BPE on the folder's 384-token model: meant here
IN_OPEN, IN_ISDIR = 0x20, 0x40000000


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """A prepared .bin of prompt/completion records (tokens, loss mask, document index; a 300-token BPE) and a copy
    of an HF folder (the fixture's own may be read by tests running beside this one)."""
    import shutil
    tmp = tmp_path_factory.mktemp("mem")
    rng = np.random.default_rng(0)
    with open(tmp / "pc.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": " ".join(f"q{i}_{w}" for w in rng.integers(0, 30, 20)),
                                "completion": " ".join(f"a{i}_{w}" for w in rng.integers(0, 30, 30))}) + "\n")
    out = tmp / "d.bin"
    assert main(["prepare", str(tmp / "pc.jsonl"), "--out", str(out), "--train-tokenizer", "300",
                 "--no-progress"]) == 0
    return out, Path(shutil.copytree(FIX, tmp / "hf"))


def _read_files(data: Path, hf: Path) -> list[Path]:
    """What a run reads after its memory check: the tokens, the mask, the document index, the HF weights."""
    side = json.loads(data.with_name(data.name + ".json").read_text())
    files = [data, data.parent / side["loss_mask"]["path"], data.parent / side["document_index"]["path"],
             hf / "model.safetensors"]
    assert all(f.is_file() for f in files), files
    return files


class Opened:
    """The files that anything in this process opens under `paths` (files, or folders watched with every folder
    below them), as the kernel reports them (inotify): Python, numpy's maps and tensorstore alike."""

    def __init__(self, *paths: Path):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.where = {}
        for p in paths:
            for q in [p, *(x for x in p.rglob("*") if x.is_dir())] if p.is_dir() else [p]:
                wd = self.libc.inotify_add_watch(self.fd, bytes(q), IN_OPEN)
                assert wd >= 0, (q, os.strerror(ctypes.get_errno()))
                self.where[wd] = q

    def files(self) -> set[Path]:
        """Every file opened since the last call (folders listed are left out)."""
        got = set()
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return got
            i = 0
            while i < len(buf):
                wd, mask, _, n = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16:i + 16 + n].rstrip(b"\0").decode()
                i += 16 + n
                if mask & IN_OPEN and not mask & IN_ISDIR:
                    got.add(self.where[wd] / name if name else self.where[wd])

    def close(self):
        os.close(self.fd)


class Counted:
    """A compiled train step that counts its calls."""

    def __init__(self, compiled):
        self.compiled, self.calls = compiled, 0

    def __call__(self, *args):
        self.calls += 1
        return self.compiled(*args)

    def __getattr__(self, name):
        return getattr(self.compiled, name)


@pytest.fixture
def compiles(monkeypatch) -> list:
    """Every train step a run compiles (trainer/run/context.py's jit_train_step(...).lower(...).compile()),
    each wrapped to count the steps it runs; a call of the jitted step itself (an implicit compile) fails."""
    import trainer.run.context as ctx
    got, real = [], ctx.jit_train_step

    class Jitted:
        def __init__(self, s):
            self.jitted = real(s)

        def lower(self, *args):
            lowered = self.jitted.lower(*args)

            class Lowered:
                def compile(self, *a):
                    got.append(Counted(lowered.compile(*a)))
                    return got[-1]
            return Lowered()

        def __call__(self, *args):
            raise AssertionError("the train step ran without its ahead-of-time compile")

    monkeypatch.setattr(ctx, "jit_train_step", Jitted)
    return got


def _xla(compiled) -> dict:
    """XLA's own memory analysis of a compiled program, bytes per device."""
    m = compiled.memory_analysis()
    return {"arguments": m.argument_size_in_bytes, "temp": m.temp_size_in_bytes, "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes,
            "total": m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes}


def _plan(args: list, devices):
    """The planner's figures for a run of `args` on `devices`."""
    from trainer.ckpt.sources import resolve
    from trainer.plan.core import estimate, strategy_of
    from trainer.state import make_setup
    s = make_setup(resolve(load_config(args), tensors=False), devices)
    row, _ = memory_check.device_memory()
    return estimate(s.model, s.cfg.train, strategy_of(s.cfg, s.mesh.size), row, 1, s.dtype.name,
                    s.placement.platform)


def _limit(b: float, exact: bool) -> memory_check.Limit:
    """`b` bytes held against, with the planner's total as it is (exact: CPU's policy) or only by its margin."""
    row, _ = memory_check.device_memory()
    return memory_check.Limit(dataclasses.replace(row, hbm=b), "the test's limit", exact)


UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def said(line: str) -> dict:
    """The figures a refusal names, in bytes ('total', 'arguments', 'temp', 'outputs', 'aliased', 'limit'), and the
    term it calls the largest ('largest')."""
    m = re.search(r"needs ([\d.]+) (\w+) per device \(XLA: arguments ([\d.]+) (\w+) \+ temp ([\d.]+) (\w+) \+ "
                  r"outputs ([\d.]+) (\w+) - aliased ([\d.]+) (\w+); (.+?) the largest\) but .* is ([\d.]+) (\w+);",
                  line)
    assert m, line
    g = m.groups()
    names = ("total", "arguments", "temp", "outputs", "aliased")
    out = {n: float(g[2 * i]) * UNITS[g[2 * i + 1]] for i, n in enumerate(names)}
    out["limit"], out["largest"] = float(g[11]) * UNITS[g[12]], g[10]
    return out


def _close(figures: dict, xla: dict):
    """Every figure of a refusal is XLA's, to the 3 significant digits it prints."""
    for k in ("total", "arguments", "temp", "outputs", "aliased"):
        assert figures[k] == pytest.approx(xla[k], rel=5e-3), (k, figures, xla)


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in [root, *sorted(root.rglob("*"))]}


def _refused(args: list, capsys) -> str:
    """`meshtrain train ARGS` on all 8 devices: exit 2 and its one line."""
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtrain: error: the compiled train step needs "), err
    return err[0]


def test_the_compiled_step_decides_and_a_refusal_reads_nothing(data, tmp_path, monkeypatch, compiles, capsys):
    """One device: a limit 3% under the planner's total (which the CPU policy refuses) but above XLA's trains, with
    the one program it compiled. 8 devices, through the command line: a limit under XLA's total but over the plan's
    margin stops in one line naming XLA's figures, before the .bin, its mask and index or the HF weights are
    opened (a fresh run.dir is not created) and, resuming the first run, before any checkpoint file is opened (its
    tree byte for byte and mtime for mtime as it was)."""
    (data, hf), run = data, tmp_path / "run"
    reads, common = _read_files(data, hf), RUN + [f"model.init_from={hf}", f"data.source={data}"]
    args = common + [f"run.dir={run}"]
    plan = _plan(args, ONE)
    limit = 0.97 * plan.total_bytes
    with pytest.raises(UserError, match=r"^the plan needs"):  # CPU's policy: the planner's total as it is
        memory_check.check_plan(plan, _limit(limit, exact=True))
    monkeypatch.setenv(memory_check.TEST_LIMIT, str(limit))
    watch = Opened(*reads)
    got = train(load_config(args + ["train.steps=1"]), ONE, Console(file=io.StringIO()))
    assert watch.files() == set(reads), "a file the run reads was not seen opened"
    assert len(compiles) == 1 and compiles[0].calls == 1 and got.history[-1]["step"] == 1  # one program, stepped
    assert _xla(compiles[0])["total"] <= limit < plan.total_bytes
    assert (run / "checkpoints" / "1").is_dir()

    plan8 = _plan(args, None)
    exact = plan8.params_bytes + plan8.opt_state_bytes
    monkeypatch.setenv(memory_check.TEST_LIMIT, str(0.9 * exact))  # the plan's exact part alone does not fit
    assert main(["train", *common, "train.steps=3", f"run.dir={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtrain: error: the plan needs at least "), err
    assert len(compiles) == 1 and watch.files() == set()  # refused before compiling
    limit = exact + (plan8.total_bytes - exact) / 2  # the plan passes: only a tenth of its estimate is held
    monkeypatch.setenv(memory_check.TEST_LIMIT, str(limit))
    fresh = tmp_path / "fresh"
    line = _refused(common + ["train.steps=3", f"run.dir={fresh}"], capsys)
    assert len(compiles) == 2 and compiles[1].calls == 0
    xla, figures = _xla(compiles[1]), said(line)
    _close(figures, xla)
    assert xla["total"] > limit and figures["limit"] == pytest.approx(limit, rel=5e-3)
    assert figures["largest"] == max(("arguments", xla["arguments"]), ("temp", xla["temp"]),
                                     ("outputs not written into an argument", xla["outputs"] - xla["aliased"]),
                                     key=lambda kv: kv[1])[0]
    assert watch.files() == set() and not fresh.exists()

    before = _tree(run)
    watch.close()
    watch = Opened(*reads, run / "checkpoints")
    _close(said(_refused(common + ["train.steps=3", f"run.dir={run}"], capsys)), _xla(compiles[2]))
    assert watch.files() == set() and _tree(run) == before
    from trainer.ckpt.store import read_meta
    read_meta(run, 1)  # the watch sees a checkpoint read
    assert {p.relative_to(run).parts[:2] for p in watch.files()} == {("checkpoints", "1")}
    watch.close()


@pytest.mark.slow  # XLA:TPU compiles the step in 15-25 s here
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (it installs on Linux x86_64: pip install -e '.[tpu]')")
def test_xla_tpu_figures_reach_the_same_verdicts():
    """The step compiled ahead of time for 4 v5p chips (ZeRO-3, tiled loss; the planner +99% over XLA:TPU): at
    5% over XLA:TPU's total the planner's total is refused by the CPU policy, passed by the accelerator's, and the
    compiled figures fit; at 10% under, the plan's margin passes and the compiled check stops in one line naming
    XLA:TPU's figures."""
    from trainer.plan.aot import compile_for
    c = compile_for(load_config(["model.preset=small", "model.d_model=512", "model.n_heads=4", "model.n_kv_heads=2",
                                 "model.d_ff=1024", "model.vocab_size=2048", "model.seq_len=128", "model.n_layers=2",
                                 "train.batch_size=16", "train.dtype=bfloat16", "mesh.data=4", "train.zero_stage=3",
                                 "model.loss_chunk=64"]), "v5p:2x2x1")
    m, plan = c.measured, c.plan
    assert m.platform == "tpu" and plan.device.name == "tpu-v5p"
    xla = {"arguments": m.argument_bytes, "temp": m.temp_bytes, "outputs": m.output_bytes, "aliased": m.alias_bytes,
           "total": m.argument_bytes + m.temp_bytes + m.output_bytes - m.alias_bytes}

    def limit(b, exact):
        return memory_check.Limit(dataclasses.replace(plan.device, hbm=b), "the test's limit", exact)

    fits = 1.05 * xla["total"]
    assert plan.total_bytes > fits
    with pytest.raises(UserError, match=r"^the plan needs"):
        memory_check.check_plan(plan, limit(fits, exact=True))
    memory_check.check_plan(plan, limit(fits, exact=False))
    memory_check.check_compiled(m, limit(fits, exact=False))

    short = 0.9 * xla["total"]
    memory_check.check_plan(plan, limit(short, exact=False))
    with pytest.raises(UserError) as e:
        memory_check.check_compiled(m, limit(short, exact=False))
    line = str(e.value)
    assert "\n" not in line and line.startswith("the compiled train step needs "), line
    _close(said(line), xla)
