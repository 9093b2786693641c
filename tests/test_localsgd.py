"""Local SGD / DiLoCo: H=1 reproduces synchronous training; replicas sync every H steps, and only then."""
import functools
import re

import jax
import numpy as np
import pytest

from conftest import TINY, corpus, max_rel
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
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step
    s = make_setup(load_config(TINY + list(overrides)))
    state, step = init_state(s), jit_train_step(s)
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
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step
    s = make_setup(load_config(TINY + ["mesh.data=8", "train.sync=local_sgd", "train.sync_every=2"]))
    state = init_state(s)
    b = Batches(corpus(), 0, 16, s.model.seq_len, s.model.vocab_size)
    batch = lambda i: jax.device_put(b.global_train(i), s.batch_sharding())  # noqa: E731
    with jax.set_mesh(s.mesh):
        step = jit_train_step(s).lower(state, batch(0)).compile()
        every, sync = _all_reduce_bytes(step.as_text())
        param_bytes = 4 * sum(x.size for x in jax.tree.leaves(s.shapes["params"])) // 8
        assert every == 8 and sync == param_bytes  # per step: loss + grad norm; every H: the parameters
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
