"""The table-driven pipelines with every data-parallel sync: train.grad_sync and ZeRO 0-3 match one device,
and the compiled step syncs over `data` once per step, as many bytes as the stage's share of a
no-pipeline step."""
import jax
import numpy as np
import pytest

from conftest import SGD, TINY, max_rel, run_steps, single_device
from trainer.config import load_config
from trainer.plan.hlo import collective_ops
from trainer.state import make_setup
from trainer.step import jit_train_step

EIGHT = ["model.n_layers=8", "train.lr=3e-3"]
ONE_F = ["train.pipeline_schedule=1f1b"]
# (name, overrides): issue 19's equivalence layouts; each runs with SGD (scale-sensitive) and AdamW
LAYOUTS = [
    ("1,4,1", ONE_F + ["mesh.data=1", "mesh.stage=4", "train.microbatches=4"]),
    ("1,4,1", ONE_F + ["mesh.data=1", "mesh.stage=4", "train.microbatches=8"]),
    ("2,2,2", ONE_F + ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.zero_stage=1", "train.microbatches=2"]),
    ("2,4,1", ONE_F + ["mesh.data=2", "mesh.stage=4", "train.zero_stage=3", "train.microbatches=4"]),
    ("1,2,4", ONE_F + ["mesh.data=1", "mesh.stage=2", "mesh.model=4", "train.grad_sync=ring", "train.microbatches=2"]),
    ("4,2,1", ONE_F + ["mesh.data=4", "mesh.stage=2", "train.grad_sync=ring", "train.microbatches=2"]),
    ("1,4,1", ["train.pipeline_schedule=interleaved_1f1b", "train.pipeline_repeats=2", "mesh.data=1", "mesh.stage=4",
               "train.microbatches=8"]),
]
# the default run keeps the two layouts that sync over `data` by hand (ZeRO-3 reduce-scatter, the ring)
# with SGD; the rest (and tests/test_pipeline.py's 1f1b cases) run with -m slow
DEFAULT = {(3, "sgd"), (5, "sgd")}
CASES = [pytest.param(name, ov, opt, marks=[] if (i, opt) in DEFAULT else [pytest.mark.slow],
                      id=f"{opt}-{name.replace(',', 'x')}-" + "-".join(o.split(".")[-1] for o in ov[1:]))
         for i, (name, ov) in enumerate(LAYOUTS) for opt in ("sgd", "adamw")]


def _close(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("name,overrides,opt", CASES)
def test_table_pipeline_with_data_sync_matches_single_device(name, overrides, opt):
    over = EIGHT + overrides + (SGD if opt == "sgd" else [])
    ref_losses, ref_params, ref_norms = single_device(over)
    r = run_steps(over)
    assert tuple(r.setup.mesh.shape.values()) == tuple(int(x) for x in name.split(","))
    assert _close(r.losses, ref_losses) < 1e-5, (r.losses, ref_losses)
    assert _close(r.grad_norms, ref_norms) < 1e-5, (r.grad_norms, ref_norms)
    assert max_rel(r.params, ref_params) < 1e-5
    assert ref_losses[-1] != ref_losses[0]  # the parameters moved


def _data_sync(overrides, n):
    """{collective kind: bytes one device sends over `data` per step} and the count of such ops per step."""
    s = make_setup(load_config(TINY + EIGHT + overrides), jax.devices()[:n])
    batch = jax.ShapeDtypeStruct((16, s.model.seq_len + 1), np.int32, sharding=s.batch_sharding())
    with jax.set_mesh(s.mesh):
        text = jit_train_step(s).lower(s.shapes, batch).compile().as_text()
    out = {}
    for kind, axes, sent, _ in collective_ops(text, dict(s.mesh.shape)):
        if "data" in axes:
            out[kind] = out.get(kind, 0) + sent
    return out, s


def _bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("zero", [1, 3])
def test_data_sync_once_per_step_and_the_stage_share(zero):
    """(2,4,1) 1F1B syncs over `data` the bytes a (2,1,1) step syncs for the embedding and head plus a
    quarter of the layers' (the stage's layers), and the same at M=4 and M=8: once per step, not per tick."""
    base = ["mesh.model=1", f"train.zero_stage={zero}"]
    ref, s = _data_sync(base + ["mesh.data=2", "mesh.stage=1", "train.microbatches=1"], 2)
    pipe = {m: _data_sync(base + ONE_F + ["mesh.data=2", "mesh.stage=4", f"train.microbatches={m}"], 8)[0]
            for m in (4, 8)}
    assert pipe[4] == pipe[8], pipe
    # the ring bus factor of every kind is (K-1)/K or 2(K-1)/K of the array: the same split works per kind
    p = s.param_shapes
    share = (_bytes({n: v for n, v in p.items() if n != "layers"}) + _bytes(p["layers"]) / 4) / _bytes(p)
    total = lambda d: sum(d.values())  # noqa: E731
    assert total(pipe[4]) == pytest.approx(share * total(ref), rel=1e-6), (pipe[4], ref, share)
    kinds = {"all-reduce"} if zero < 2 else {"all-gather", "reduce-scatter"}
    assert set(pipe[4]) <= kinds | {"all-reduce"} and kinds <= set(pipe[4]), pipe[4]
