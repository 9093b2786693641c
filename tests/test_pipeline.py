"""Pipeline parallelism over `stage` trains exactly like one device; schedule length, bubble, memory."""
import jax
import numpy as np
import pytest

from conftest import TINY, max_rel, run_steps, single_device
from trainer.config import load_config
from trainer.pipeline import bubble_fraction, describe, num_ticks
from trainer.state import init_state, make_setup
from trainer.step import jit_train_step

EIGHT = ["model.n_layers=8", "train.lr=3e-3"]
LAYOUTS = [
    ("1,2,1", ["mesh.data=1", "mesh.stage=2", "train.microbatches=4"]),
    ("1,4,1", ["mesh.data=1", "mesh.stage=4", "train.microbatches=4"]),
    ("1,8,1", ["mesh.data=1", "mesh.stage=8", "train.microbatches=8"]),
    ("2,2,2", ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.zero_stage=1", "train.microbatches=2"]),
    ("4,2,1", ["mesh.data=4", "mesh.stage=2", "train.zero_stage=3", "train.microbatches=2"]),
    ("1,4,1", ["mesh.data=1", "mesh.stage=4", "train.microbatches=4", "train.pipeline_repeats=2"]),
]


@pytest.mark.parametrize("name,overrides", LAYOUTS, ids=["-".join(o[1:]) for _, o in LAYOUTS])
def test_pipeline_matches_single_device(name, overrides):
    over = EIGHT + overrides
    ref_losses, ref_params, _ = single_device(over)
    losses, params, s, _, _ = run_steps(over)
    assert tuple(s.mesh.shape.values()) == tuple(int(x) for x in name.split(","))
    assert np.abs(losses - ref_losses).max() / np.abs(ref_losses).max() < 1e-5, (losses, ref_losses)
    assert max_rel(params, ref_params) < 1e-5
    assert ref_losses[-1] != ref_losses[0]  # the parameters moved


def _scan_lengths(jaxpr):
    """Lengths of every scan in a jaxpr, nested ones included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out.append(eqn.params["length"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    out += _scan_lengths(sub)
    return out


@pytest.mark.parametrize("S,M,V", [(2, 4, 1), (4, 4, 1), (4, 4, 2), (2, 6, 2)])
def test_schedule_runs_mv_plus_s_minus_1_ticks(S, M, V):
    cfg = load_config(TINY + EIGHT + [f"mesh.data=1", f"mesh.stage={S}", f"train.microbatches={M}",
                                      f"train.pipeline_repeats={V}", "train.batch_size=24"])
    s = make_setup(cfg, jax.devices()[:S])
    batch = jax.ShapeDtypeStruct((24, s.model.seq_len + 1), np.int32, sharding=s.batch_sharding())
    with jax.set_mesh(s.mesh):
        jaxpr = jax.make_jaxpr(lambda st, b: jit_train_step(s)(st, b))(s.shapes, batch).jaxpr
    lengths = _scan_lengths(jaxpr)
    assert M * V + S - 1 in lengths, lengths
    assert num_ticks(S, M, V) == M * V + S - 1
    frac = bubble_fraction(S, M, V)
    assert frac == (S - 1) / (M * V + S - 1)
    assert f"bubble {100 * frac:.1f}%" in describe(S, M, V)


def test_circular_schedule_shrinks_bubble():
    assert bubble_fraction(4, 8, 2) < bubble_fraction(4, 8, 1)
    assert bubble_fraction(4, 8, 2) == 3 / 19 and bubble_fraction(4, 8, 1) == 3 / 11


def _arg_bytes(overrides, n):
    s = make_setup(load_config(TINY + EIGHT + overrides), jax.devices()[:n])
    batch = jax.ShapeDtypeStruct((16, s.model.seq_len + 1), np.int32, sharding=s.batch_sharding())
    with jax.set_mesh(s.mesh):
        c = jit_train_step(s).lower(s.shapes, batch).compile()
    layers = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s.shapes["params"]["layers"]))
    return c.memory_analysis().argument_size_in_bytes, layers, s


def test_stage_holds_a_quarter_of_the_layer_stack():
    one, layers, _ = _arg_bytes(["mesh.data=1", "train.microbatches=4"], 1)
    four, _, s = _arg_bytes(["mesh.data=1", "mesh.stage=4", "train.microbatches=4"], 4)
    # parameters, Adam mu and nu of the layer stack: each device keeps 1/4 of all three
    assert one - four == 3 * layers * 3 // 4
    st = init_state(s)
    for leaf in jax.tree.leaves(st["params"]["layers"]):
        assert leaf.addressable_shards[0].data.size * 4 == leaf.size
