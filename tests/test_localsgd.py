"""Local SGD / DiLoCo: H=1 reproduces synchronous training; replicas sync every H steps, and only then."""
import functools
import re

import jax
import numpy as np
import pytest

from conftest import TINY, corpus, fresh_state, max_rel
from trainer.cli import main

LINEAR = ["mesh.data=8", "train.optimizer=sgd", "train.grad_clip=0", "train.lr=0.3"]  # update linear in g
DILOCO_1 = ["train.sync=diloco", "train.sync_every=1", "train.outer_lr=1", "train.outer_momentum=0"]


def _replicas(params):
    return [jax.tree.map(lambda x: x[r], params) for r in range(8)]


@functools.lru_cache(maxsize=None)
def _trajectory(overrides: tuple, steps: int = 3):
    """(losses, parameters after each step, DiLoCo's outer parameters after each step or None): one
    compile per configuration, shared by the tests."""
    from trainer.config import load_config
    from trainer.data.batches import Batches
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    s = make_setup(load_config(TINY + list(overrides)))
    state, step = fresh_state(s), jit_train_step(s)
    b = Batches(corpus(), s.cfg.train.seed, s.cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
    losses, params, outer = [], [], []
    with jax.set_mesh(s.mesh):
        for i in range(steps):
            state, m = step(state, jax.device_put(b.global_train(i), s.batch_sharding()))
            losses.append(float(m["loss"]))
            params.append(jax.tree.map(np.asarray, state["params"]))
            outer.append(jax.tree.map(np.asarray, state["outer"]["params"]) if "outer" in state else None)
    return np.array(losses), params, outer


def test_diloco_h1_outer_lr1_no_momentum_equals_every_step_sync():
    ref_losses, ref_params, _ = _trajectory(tuple(LINEAR))
    losses, params, outer = _trajectory(tuple(LINEAR + DILOCO_1))
    # Same parameters at every step, but two different programs: XLA may order the float32 sums differently
    # (an AVX2 CPU gave 4.80161238 vs 4.8016119 at step 3), so equal to rounding, not bit for bit.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for p in _replicas(params[-1]) + [outer[-1]]:
        assert max_rel(p, ref_params[-1]) < 1e-6  # float32 rounding of mean vs sum order
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.slow
def test_sync_warmup_averages_every_step_then_every_h():
    """With train.sync_warmup=2 and H=8, DiLoCo (outer lr 1, no momentum, linear updates) is
    synchronous SGD for steps 1-2; step 3 is local, so the replicas differ after it."""
    ref_params = _trajectory(tuple(LINEAR))[1][1]
    warm = LINEAR + ["train.sync=diloco", "train.sync_every=8", "train.sync_warmup=2", "train.outer_lr=1",
                     "train.outer_momentum=0"]
    _, params, outer = _trajectory(tuple(warm))
    for p in _replicas(params[1]) + [outer[1]]:
        assert max_rel(p, ref_params) < 1e-6
    reps = _replicas(params[2])
    assert max_rel(reps[1], reps[0]) > 1e-4  # step 3 was taken apart, on different rows


@pytest.mark.slow
@pytest.mark.parametrize("extra,same", [(["train.sync=local_sgd", "train.sync_every=1"], True),
                                        (["train.optimizer=adamw", "train.grad_clip=1"] + DILOCO_1, False)])
def test_h1_local_sgd_matches_and_adamw_does_not(extra, same):
    """Local SGD H=1 is synchronous SGD; with AdamW the mean of per-replica Adam updates is not Adam's update."""
    over = LINEAR + extra
    ref = _trajectory(tuple(o for o in over if not o.startswith(("train.sync", "train.outer"))))[1][-1]
    params = _trajectory(tuple(over))[1][-1]
    assert (max(max_rel(p, ref) for p in _replicas(params)) < 1e-6) == same


def _all_reduce_bytes(hlo: str):
    """(bytes per step, bytes in the sync branch) of the all-reduces in a compiled module."""
    every, sync = 0, 0
    for line in hlo.splitlines():
        if " all-reduce(" not in line and " all-reduce-start(" not in line:
            continue
        result = line.split(" = ", 1)[1].split(" all-reduce", 1)[0]
        n = sum(4 * int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"f32\[([\d,]*)\]", result))
        if "/cond/" in line:
            sync += n
        else:
            every += n
    return every, sync


def test_replicas_train_apart_and_all_reduce_parameters_only_every_h_steps():
    from trainer.config import load_config
    from trainer.data.batches import Batches
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    s = make_setup(load_config(TINY + ["mesh.data=8", "train.sync=local_sgd", "train.sync_every=2"]))
    state = fresh_state(s)
    b = Batches(corpus(), 0, 16, s.model.seq_len, s.model.vocab_size)
    batch = lambda i: jax.device_put(b.global_train(i), s.batch_sharding())  # noqa: E731
    with jax.set_mesh(s.mesh):
        step = jit_train_step(s).lower(state, batch(0)).compile()
        every, sync = _all_reduce_bytes(step.as_text())
        param_bytes = 4 * sum(x.size for x in jax.tree.leaves(s.shapes["params"])) // 8
        # per step: the loss sum, the counted tokens and the grad norm; every H: the parameters
        assert every == 12 and sync == param_bytes
        for i in range(5):  # step 0 has learning rate 0 (warm-up)
            state, _ = step(state, batch(i))
            reps = _replicas(jax.tree.map(np.asarray, state["params"]))
            spread = max(max_rel(r, reps[0]) for r in reps[1:])
            # after a sync every replica holds the one all-reduced result: bit for bit the same
            assert (spread == 0) if i % 2 else (i == 0 or spread > 1e-4), (i, spread)


@pytest.mark.parametrize("args,says", [
    (["train.sync=gossip"], "train.sync='gossip' is unknown"),
    (["train.sync=diloco", "train.zero_stage=1"], "set train.zero_stage=0 and mesh.stage=1"),
    (["train.sync=local_sgd", "train.sync_every=0"], "train.sync_every=0 must be >= 1"),
    (["train.optimizer=lion"], "train.optimizer='lion' is unknown"),
])
def test_bad_sync_settings(args, says, capsys, tmp_run):
    assert main(["train"] + TINY + ["mesh.data=8", f"run.dir={tmp_run}"] + args) == 2
    assert says in capsys.readouterr().err


# ----------------------------------------------------------------------------- one set of parameters downstream

FIXTURE = __import__("pathlib").Path(__file__).parent / "fixtures" / "localsgd_hf"


def _scripts():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import make_localsgd_fixture
    return make_localsgd_fixture


def _saved_state(config, run):
    """The run's newest checkpoint as its own layout restores it (stacked replicas, DiLoCo's outer)."""
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.config import load_config
    from trainer.state import make_setup
    s = make_setup(load_config(config + [f"run.dir={run}"]), jax.devices()[:2])
    c = Checkpointer(s, run)
    state, _ = c.restore()
    c.close()
    return jax.tree.map(np.asarray, state)


@pytest.fixture(scope="module")
def local_sgd_run(tmp_path_factory):
    """tests/fixtures/localsgd_hf's run retrained here (2 replicas that never synced), exported to HF."""
    fx, tmp = _scripts(), tmp_path_factory.mktemp("localsgd")
    out = fx.export_run(tmp / "run", tmp / "hf")
    return fx.CONFIG, tmp / "run", out


def _params_of(path):
    from trainer.ckpt.params import load_params
    return jax.tree.map(np.asarray, load_params(path, None, jax.sharding.SingleDeviceSharding(jax.devices()[0]))[0])


def test_local_sgd_exports_the_replicas_average_as_an_hf_llama_transformers_agrees_with(local_sgd_run):
    from models import forward
    from trainer.ckpt.safetensors import read_header
    config, run, out = local_sgd_run
    stacked = _saved_state(config, run)["params"]
    assert max_rel(jax.tree.map(lambda x: x[0], stacked), jax.tree.map(lambda x: x[1], stacked)) > 1e-3  # apart
    average = jax.tree.map(lambda x: x.mean(0), stacked)
    assert max_rel(_params_of(out), average) < 1e-6  # the export holds the replicas' average
    mine, fixture = read_header(out / "model.safetensors"), read_header(FIXTURE / "model.safetensors")
    assert sorted(mine) == sorted(fixture)
    for name in mine:  # this export is the fixture's run, retrained
        np.testing.assert_allclose(mine[name].array(), fixture[name].array(), rtol=1e-4, atol=1e-6, err_msg=name)
    ref = np.load(FIXTURE / "reference.npz")  # transformers' logits of the fixture folder
    from trainer.config import model_config
    from trainer.ckpt.params import load_params
    params, cfg = load_params(FIXTURE, None, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    logits = np.asarray(forward(model_config(cfg), params, ref["tokens"]))
    np.testing.assert_allclose(logits, ref["logits"], rtol=1e-4, atol=1e-4)


def test_local_sgd_run_generates_exports_and_starts_a_new_run(local_sgd_run, tmp_path, capsys):
    """generate, export --format orbax, and model.init_from of that export or of the run itself."""
    from trainer.ckpt.initial import initial_state
    from trainer.config import load_config
    from trainer.state import make_setup
    config, run, _ = local_sgd_run
    assert main(["generate", "--run", str(run), "--tokens", "8", "--prompt", "ab"]) == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "orbax")]) == 0
    average = jax.tree.map(lambda x: x.mean(0), _saved_state(config, run)["params"])
    assert max_rel(_params_of(tmp_path / "orbax"), average) < 1e-6
    plain = make_setup(load_config(TINY + ["mesh.data=2", f"model.init_from={tmp_path / 'orbax'}"]), jax.devices()[:2])
    assert max_rel(jax.tree.map(np.asarray, initial_state(plain)["params"]), average) < 1e-6
    again = make_setup(load_config(config + [f"model.init_from={run}"]), jax.devices()[:2])  # local SGD from a run
    stacked = jax.tree.map(np.asarray, initial_state(again)["params"])
    assert all(max_rel(jax.tree.map(lambda x: x[r], stacked), average) < 1e-6 for r in (0, 1))


def test_local_sgd_restore_onto_another_replica_count_is_one_line(local_sgd_run, capsys):
    config, run, _ = local_sgd_run
    code = main(["train", *[c for c in config if not c.startswith(("mesh.data", "train.steps"))], "mesh.data=8",
                 "train.steps=5", f"run.dir={run}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"meshtrain: error: checkpoint {run}/checkpoints/3 holds 2 local_sgd "
                                            "replicas and this run has 8 (mesh.data); resume with mesh.data=2, or "
                                            f"start a new run from its parameters with model.init_from={run}"), err


@pytest.mark.slow
def test_diloco_run_downstream_uses_the_synced_outer_parameters(tmp_path, capsys):
    """DiLoCo: generate, both exports and model.init_from read its outer parameters; a DiLoCo run started
    from them has them as its outer parameters too."""
    from trainer import load_config, train
    from trainer.ckpt.initial import initial_state
    from trainer.state import make_setup
    config = [c for c in _scripts().CONFIG if not c.startswith("train.sync")] + ["train.sync=diloco",
                                                                                 "train.sync_every=2"]
    train(load_config(config + [f"run.dir={tmp_path / 'run'}"]), jax.devices()[:2])
    outer = _saved_state(config, tmp_path / "run")["outer"]["params"]
    assert main(["generate", "--run", str(tmp_path / "run"), "--tokens", "8"]) == 0
    for fmt in ("orbax", "hf"):
        assert main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / fmt), "--format", fmt]) == 0
        assert max_rel(_params_of(tmp_path / fmt), outer) < 1e-6, fmt
    s = make_setup(load_config(config + [f"model.init_from={tmp_path / 'run'}"]), jax.devices()[:2])
    state = jax.tree.map(np.asarray, initial_state(s))
    assert max_rel(state["outer"]["params"], outer) < 1e-6
