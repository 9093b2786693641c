"""init_state's values do not depend on the layout, bit for bit. tests/conftest.py's `fresh_state` rests on this: it
makes a state's values once per model, seed, optimizer and state structure and puts them into each layout's
shardings, where init_state traces and compiles one program per layout (a quarter of a layout test's time)."""
import jax
import numpy as np
import pytest
from conftest import SGD, TINY, fresh_state, state_key

from trainer.config import load_config
from trainer.state import init_state, make_setup

MOE = ["model.family=mixtral", "model.n_experts=8", "model.n_experts_per_token=2", "model.expert_d_ff=64"]
# (one device's overrides, the layout's): ZeRO over data, tensor parallelism, both with Adam's moments, experts split
# over data, a pipeline, local SGD's replicated copies
LAYOUTS = {
    "8x1x1-zero3": ([], ["mesh.data=8", "train.zero_stage=3"]),
    "2x1x4-zero1-adamw": (["train.optimizer=adamw"], ["mesh.data=2", "mesh.model=4", "train.zero_stage=1"]),
    "moe-2x1x4-zero3": (MOE, ["mesh.data=2", "mesh.model=4", "train.zero_stage=3"]),
    "2x2x2-1f1b": ([], ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.pipeline_schedule=1f1b",
                        "train.microbatches=2"]),
}


def _setup(overrides, n):
    return make_setup(load_config(TINY + SGD + overrides), jax.devices()[:n])


def _values(state):
    return jax.tree.map(np.asarray, state)


@pytest.mark.parametrize("name", LAYOUTS)
def test_init_state_on_a_layout_equals_one_device(name):
    common, layout = LAYOUTS[name]
    one, s = _setup(common + ["mesh.data=1", "mesh.stage=1", "mesh.model=1"], 1), _setup(common + layout, 8)
    assert state_key(s) == state_key(one), "the layout changed the state's structure: fresh_state would not share it"
    want, got = _values(init_state(one)), init_state(s)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(_values(got)), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # and fresh_state gives the layout its own shardings, with the values one device made
    fresh = fresh_state(s)
    assert jax.tree.map(lambda x: x.sharding, fresh) == jax.tree.map(lambda x: x.sharding, got)
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(want)))


def test_diloco_replicas_start_equal():
    """mesh.data=4 with DiLoCo: one copy of params per replica, stacked, and the outer copy, all equal; against one
    device's values within 1e-6 but not bit for bit (this program's init rounds a few values one ulp apart, seen at
    7.5e-9 on the embedding), which is why fresh_state keys by the state's structure: this one makes its own."""
    want = _values(init_state(_setup(["mesh.data=1"], 1)))["params"]
    got = _values(init_state(_setup(["train.sync=diloco", "train.sync_every=2", "mesh.data=4"], 4)))
    for a, b, c in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(want), jax.tree.leaves(got["outer"]["params"])):
        assert a.shape == (4, *b.shape) and all(np.array_equal(x, c) for x in a)
        np.testing.assert_allclose(c, b, rtol=0, atol=1e-6 * float(np.abs(b).max()))
