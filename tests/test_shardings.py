"""Where the state lives: per-device shard shapes, collectives in the HLO, memory per device."""
import functools
import re

import jax
import pytest

from conftest import TINY
from trainer.config import load_config
from trainer.state import init_state, make_setup
from trainer.step import jit_train_step


@functools.lru_cache(maxsize=None)
def _setup(overrides: tuple):
    """(setup, initial state) of a layout, shared by the tests below (none changes them)."""
    s = make_setup(load_config(TINY + list(overrides)))
    return s, init_state(s)


def _fraction(x):
    return x.addressable_shards[0].data.size / x.size


def _adam(opt_state):
    """The (mu, nu) trees of adamw inside the chain's state."""
    for part in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")):
        if hasattr(part, "mu"):
            return part.mu, part.nu
    raise AssertionError("no adam state found")


def test_zero1_optimizer_state_is_one_eighth():
    s, st = _setup(("mesh.data=8", "train.zero_stage=1"))
    for tree in _adam(st["opt_state"]):
        assert all(_fraction(x) == 1 / 8 for x in jax.tree.leaves(tree))
    assert all(_fraction(x) == 1.0 for x in jax.tree.leaves(st["params"]))  # params replicated


def test_zero3_parameters_are_one_eighth():
    s, st = _setup(("mesh.data=8", "train.zero_stage=3"))
    assert all(_fraction(x) == 1 / 8 for x in jax.tree.leaves(st["params"]))
    for tree in _adam(st["opt_state"]):
        assert all(_fraction(x) == 1 / 8 for x in jax.tree.leaves(tree))


def test_zero0_everything_replicated():
    s, st = _setup(("mesh.data=8", "train.zero_stage=0"))
    assert all(_fraction(x) == 1.0 for x in jax.tree.leaves(st))


def test_tensor_parallel_megatron_split():
    s, st = _setup(("mesh.data=4", "mesh.model=2"))
    p = {k: v.addressable_shards[0].data.shape for k, v in st["params"]["layers"].items()}
    full = {k: v.shape for k, v in st["params"]["layers"].items()}
    L, D, H, E = full["wq"]
    K, F = full["wk"][2], full["w_gate"][2]
    assert p["wq"] == (L, D, H // 2, E)  # column split: heads
    assert p["wk"] == (L, D, K // 2, E) and p["wv"] == (L, D, K // 2, E)
    assert p["wo"] == (L, H // 2, E, D)  # row split: heads on the input side
    assert p["w_gate"] == (L, D, F // 2) and p["w_up"] == (L, D, F // 2)  # column
    assert p["w_down"] == (L, F // 2, D)  # row
    assert p["attn_norm"] == full["attn_norm"]  # norms replicated
    V = st["params"]["embed"].shape[0]
    assert st["params"]["embed"].addressable_shards[0].data.shape == (V // 2, D)  # vocab split


@functools.lru_cache(maxsize=None)
def _compiled(overrides: tuple):
    """The compiled train step of a layout: one compile per layout, shared by the tests below."""
    s, st = _setup(overrides)
    batch = s.abstract_batch()
    with jax.set_mesh(s.mesh):
        return jit_train_step(s).lower(st, batch).compile()


@pytest.mark.parametrize("zero", [2, 3])
def test_zero23_gradients_are_reduce_scattered(zero):
    hlo = _compiled(("mesh.data=8", f"train.zero_stage={zero}")).as_text()
    assert re.search(r"reduce-scatter\(", hlo), "no reduce-scatter in the compiled step"


def test_zero0_gradients_are_all_reduced_not_scattered():
    hlo = _compiled(("mesh.data=8", "train.zero_stage=0")).as_text()
    assert re.search(r"all-reduce(-start)?\(", hlo) and not re.search(r"reduce-scatter\(", hlo)


def test_argument_bytes_fall_with_zero_stage():
    arg = {z: _compiled(("mesh.data=8", f"train.zero_stage={z}")).memory_analysis().argument_size_in_bytes
           for z in (0, 1, 3)}
    assert arg[0] > arg[1] > arg[3], arg
