"""The precomputed DPO reference with 2 processes (jax.distributed on localhost, 4 CPU devices each), each process
reading its own copy of the data folder: the processes decide together whether to read their copies or compute the
log-probabilities once together (trainer/run/reference.py), and train as 1 process x 8 devices does."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from test_dpo import _keys, _train, synth  # noqa: F401  (synth: the pairs and the reference, a module fixture)
from test_multihost import ROOT, free_port, losses

pytestmark = pytest.mark.slow  # three 2-process runs (~2 min)

MESH = ["mesh.data=8"]


def _two_processes(keys: list[str], sources: list[Path], logs: Path, timeout: float = 240) -> list[str]:
    """Run `meshtrain train` as 2 processes, process i reading data.source=sources[i]; their outputs."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=4")
    logs.mkdir(parents=True, exist_ok=True)
    port, procs, files = free_port(), [], [logs / f"{i}.log" for i in range(2)]
    for i, src in enumerate(sources):
        with open(files[i], "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "trainer.cli", "train", *keys, f"data.source={src}",
                 f"dist.coordinator=127.0.0.1:{port}", "dist.num_processes=2", f"dist.process_id={i}"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        raise AssertionError(f"the processes did not finish in {timeout} s (a hang): "
                             + " | ".join(f.read_text()[-1500:] for f in files)) from None
    outs = [f.read_text() for f in files]
    assert codes == [0, 0], (codes, [o[-3000:] for o in outs])
    return outs


def _params(keys: list[str], run: Path) -> list[np.ndarray]:
    """The parameters of a run's last checkpoint, restored in this process onto 8 devices."""
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.config import load_config
    from trainer.state import make_setup
    ckpt = Checkpointer(make_setup(load_config(keys), jax.devices()), run)
    state, _ = ckpt.restore()
    ckpt.close()
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


def _same_as(one, keys: list[str], run: Path, what: str):
    """Losses and parameters of a 2-process run within 1e-5 of 1 process x 8 devices."""
    got = losses(run)
    assert np.allclose([got[i] for i in sorted(got)], one[0], rtol=1e-5), (got, one[0])
    worst = max(float(np.linalg.norm(a - b) / np.linalg.norm(b))
                for a, b in zip(_params(keys, run), jax.tree.leaves(one[2])))
    print(f"{what}: parameters within {worst:.2g} of 1 x 8 (relative)")
    assert worst <= 1e-5


def _copy(data: Path, to: Path, reference: bool) -> Path:
    """A copy of the prepared pairs (with the reference's file or without) in a folder of its own."""
    to.mkdir()
    for f in data.parent.glob(data.name + "*"):
        if reference or ".ref-" not in f.name:
            shutil.copy(f, to / f.name)
    return to / data.name


def test_each_process_with_its_own_folder(synth, tmp_path):  # noqa: F811
    """(a) process 1's copy missing: one precompute by both processes together, written into process 1's folder
    (both copies the same bytes), and a second run reads them on both with no precompute; (b) process 1's copy of
    the right size with other values: computed together again and process 1's copy rewritten with process 0's
    values. Every run's losses and parameters equal 1 process x 8 devices."""
    one = _train(synth, tmp_path / "one", MESH, 8)  # writes the reference's file beside the data
    (ref,) = synth[0].parent.glob(synth[0].name + ".ref-*.f32")
    src = [_copy(synth[0], tmp_path / "p0", True), _copy(synth[0], tmp_path / "p1", False)]
    copies = [s.parent / ref.name for s in src]
    assert copies[0].is_file() and not copies[1].exists()

    keys = _keys(synth, tmp_path / "a1", MESH)
    outs = _two_processes(keys, src, tmp_path / "a1")
    for out in outs:
        assert out.count("reference log-probabilities of every pair computed") == 1, out
        assert "read from" not in out
    assert f"no copy at {copies[1]}" in outs[1] and f"written to {copies[1]}" in outs[1]
    assert copies[1].read_bytes() == copies[0].read_bytes()
    _same_as(one, keys, tmp_path / "a1" / "run", "(a) process 1's copy missing")

    keys = _keys(synth, tmp_path / "a2", MESH)
    for i, out in enumerate(_two_processes(keys, src, tmp_path / "a2")):
        assert f"reference log-probabilities read from {copies[i]}" in out and "computed" not in out, out
    _same_as(one, keys, tmp_path / "a2" / "run", "(a) the second run, reading")

    first = copies[0].read_bytes()
    other = np.fromfile(copies[1], np.float32) - 1.0  # the right name and size, other values
    other.tofile(copies[1])
    keys = _keys(synth, tmp_path / "b", MESH)
    outs = _two_processes(keys, src, tmp_path / "b")
    for out in outs:
        assert "another process's copy" in out and "read from" not in out, out
    assert f"written to {copies[1]}" in outs[1]
    assert copies[0].read_bytes() == first == copies[1].read_bytes()
    _same_as(one, keys, tmp_path / "b" / "run", "(b) process 1's copy of other values")
