"""Every data / ZeRO / tensor-parallel layout trains exactly like one device."""
import pytest

from conftest import max_rel, run_steps, single_device

LAYOUTS = [
    ("8,1,1", ["mesh.data=8", "train.zero_stage=0"]),
    ("8,1,1", ["mesh.data=8", "train.zero_stage=1"]),
    ("8,1,1", ["mesh.data=8", "train.zero_stage=2"]),
    ("8,1,1", ["mesh.data=8", "train.zero_stage=3"]),
    ("4,1,2", ["mesh.data=4", "mesh.model=2", "train.zero_stage=0"]),
    ("4,1,2", ["mesh.data=4", "mesh.model=2", "train.zero_stage=3"]),
    ("2,1,4", ["mesh.data=2", "mesh.model=4"]),
    ("1,1,8", ["mesh.data=1", "mesh.model=8", "model.n_kv_heads=8"]),
]


@pytest.mark.parametrize("name,overrides", LAYOUTS, ids=[f"{n}-{'-'.join(o[1:])}" for n, o in LAYOUTS])
def test_layout_matches_single_device(name, overrides):
    ref_losses, ref_params, _ = single_device(overrides)
    losses, params, s, _, _ = run_steps(overrides)
    assert tuple(s.mesh.shape.values()) == tuple(int(x) for x in name.split(","))
    assert abs(losses - ref_losses).max() / abs(ref_losses).max() < 1e-5, (losses, ref_losses)
    assert max_rel(params, ref_params) < 1e-5
    assert ref_losses[-1] < ref_losses[0]  # it learns: the comparison is not between two no-ops


def test_zero2_with_accumulation_matches_single_device():
    over = ["mesh.data=8", "train.zero_stage=2", "train.microbatches=2"]
    ref_losses, ref_params, _ = single_device(over)
    losses, params, _, _, _ = run_steps(over)
    assert abs(losses - ref_losses).max() / abs(ref_losses).max() < 1e-5
    assert max_rel(params, ref_params) < 1e-5
