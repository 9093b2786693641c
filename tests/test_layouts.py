"""Every data / ZeRO / tensor-parallel layout trains exactly like one device.

Most layouts run plain SGD without clipping (conftest.SGD): AdamW with clipping is nearly invariant
to a constant gradient scale, so a missing 1/k or 1/m would pass there (test_wrong_scale_is_seen
shows both); the grad norm, compared too, sees it with either optimizer. AdamW stays on a few
layouts that shard its (mu, nu) state.
"""
import jax
import numpy as np
import pytest

from conftest import SGD, max_rel, run_steps, single_device

ADAMW = []  # TINY's default: AdamW, clipping at 1
# the default run keeps one layout of each family: data, data+model, model (and tests/test_loss_mean.py
# runs the compiler's (8,1,1) with SGD, on uneven loss weights)
SLOW = pytest.mark.slow
LAYOUTS = [
    ("8,1,1", ["mesh.data=8", "train.zero_stage=0"] + SGD, SLOW),
    ("8,1,1", ["mesh.data=8", "train.zero_stage=1"] + ADAMW, ()),
    ("8,1,1", ["mesh.data=8", "train.zero_stage=2"] + SGD, SLOW),  # test_zero2_with_accumulation: ZeRO-2
    ("8,1,1", ["mesh.data=8", "train.zero_stage=3"] + ADAMW, SLOW),  # ZeRO-3: 4,1,2 below; test_multihost
    ("4,1,2", ["mesh.data=4", "mesh.model=2", "train.zero_stage=0"] + SGD, SLOW),
    ("4,1,2", ["mesh.data=4", "mesh.model=2", "train.zero_stage=3"] + SGD, ()),
    ("2,1,4", ["mesh.data=2", "mesh.model=4"] + SGD, SLOW),
    ("1,1,8", ["mesh.data=1", "mesh.model=8", "model.n_kv_heads=8"] + ADAMW, ()),
]


def mismatches(losses, params, norms, ref, rtol=1e-5) -> list[str]:
    """Which of loss, grad_norm, params differ from ref = (losses, params, norms) by more than rtol
    (largest relative difference; params per tensor)."""
    ref_losses, ref_params, ref_norms = ref
    out = []
    if np.abs(losses - ref_losses).max() > rtol * np.abs(ref_losses).max():
        out.append("loss")
    if np.abs(norms - ref_norms).max() > rtol * np.abs(ref_norms).max():
        out.append("grad_norm")
    if max_rel(params, ref_params) > rtol:
        out.append("params")
    return out


def _id(name, overrides):
    return f"{name}-{'-'.join(o for o in overrides[1:] if o not in SGD)}-{'sgd' if SGD[0] in overrides else 'adamw'}"


@pytest.mark.parametrize("name,overrides", [pytest.param(n, o, id=_id(n, o), marks=m) for n, o, m in LAYOUTS])
def test_layout_matches_single_device(name, overrides):
    ref = single_device(overrides)
    r = run_steps(overrides)
    assert tuple(r.setup.mesh.shape[a] for a in ("data", "stage", "model")) == tuple(int(x) for x in name.split(","))
    assert mismatches(r.losses, r.params, r.grad_norms, ref) == [], (r.losses, ref[0], r.grad_norms, ref[2])
    assert ref[0][-1] < ref[0][0]  # it learns: the comparison is not between two no-ops


def test_zero2_with_accumulation_matches_single_device():
    """2 microbatches of 8 rows, accumulated sharded, train like the whole batch of 16 on one device."""
    r = run_steps(["mesh.data=8", "train.zero_stage=2", "train.microbatches=2"] + SGD)
    assert mismatches(r.losses, r.params, r.grad_norms, single_device(SGD)) == []


def test_wrong_scale_is_seen(monkeypatch):
    """Gradients left k = 2 times too large on the manual (ZeRO-2) path, as if the 1/k were missing: with
    SGD the loss, grad norm and parameters all differ from one device; with AdamW and clipping only the
    grad norm does (loss and parameters would pass)."""
    from trainer import step
    manual = step._manual_grads

    def unscaled(s, params, batch, scale):
        loss, g = manual(s, params, batch, scale)
        return loss, jax.tree.map(lambda x: x * s.mesh.shape["data"], g)
    monkeypatch.setattr(step, "_manual_grads", unscaled)  # the 1-device reference takes the compiler path
    layout = ["mesh.data=2", "train.zero_stage=2"]  # 2 devices: the cheapest manual path
    for opt, seen in ((SGD, ["loss", "grad_norm", "params"]), (ADAMW, ["grad_norm"])):
        r = run_steps(layout + opt)
        assert mismatches(r.losses, r.params, r.grad_norms, single_device(layout + opt)) == seen, opt
