"""The table-driven pipelines with every data-parallel sync: train.grad_sync and ZeRO 0-3 match one device,
and the compiled step syncs over `data` once per step, as many bytes as the stage's share of a
no-pipeline step."""
import re

import jax
import pytest

from conftest import SGD, TINY
from test_pipeline import assert_matches_single_device
from trainer.config import load_config
from trainer.plan.hlo import collective_bytes, collective_ops
from trainer.plan.verify import table_weights
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
# the default run keeps the ZeRO-3 reduce-scatter over `data` with SGD; the ring over a pipeline's data axis is
# compiled in the default run (tests/test_tpu_compile.py's d2s2m2-1f1b-ring) and compared numerically here
# with -m slow, as are the rest and tests/test_pipeline.py's 1f1b cases
DEFAULT = {(3, "sgd")}
IN_TEST_PIPELINE = {(0, "sgd"), (1, "sgd"), (2, "sgd")}  # tests/test_pipeline.py runs these already
# beyond the issue's list: ZeRO-2's kept-sharded reduce-scatter, ZeRO-3 through the ring with tensor
# parallelism, interleaved with ZeRO-3 (the gathered layers moved into circular blocks), GPipe through the ring
EXTRA = [
    ("2,4,1", ONE_F + ["mesh.data=2", "mesh.stage=4", "train.zero_stage=2", "train.grad_sync=psum",
                       "train.microbatches=4"]),
    ("2,2,2", ONE_F + ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.zero_stage=3", "train.grad_sync=ring",
                       "train.microbatches=2"]),
    ("2,2,2", ["train.pipeline_schedule=interleaved_1f1b", "train.pipeline_repeats=2", "mesh.data=2", "mesh.stage=2",
               "mesh.model=2", "train.zero_stage=3", "train.microbatches=4"]),
    ("2,2,1", ["train.pipeline_schedule=gpipe", "mesh.data=2", "mesh.stage=2", "train.zero_stage=2",
               "train.grad_sync=ring", "train.microbatches=2"]),
]


def _id(opt, name, ov):
    return f"{opt}-{name.replace(',', 'x')}-" + "-".join(o.split(".")[-1].replace("=", "") for o in ov[1:])


CASES = [pytest.param(name, ov, opt, marks=[] if (i, opt) in DEFAULT else [pytest.mark.slow], id=_id(opt, name, ov))
         for i, (name, ov) in enumerate(LAYOUTS) for opt in ("sgd", "adamw") if (i, opt) not in IN_TEST_PIPELINE]
CASES += [pytest.param(name, ov, "sgd", marks=[pytest.mark.slow], id=_id("sgd", name, ov)) for name, ov in EXTRA]


@pytest.mark.parametrize("name,overrides,opt", CASES)
def test_table_pipeline_with_data_sync_matches_single_device(name, overrides, opt):
    assert_matches_single_device(name, EIGHT + overrides + (SGD if opt == "sgd" else []))


def _data_sync(overrides, n):
    """{collective kind: bytes one device sends over `data` per step}, floating-point arrays only (the
    integer ones move the batch, not the training state)."""
    s = make_setup(load_config(TINY + EIGHT + overrides), jax.devices()[:n])
    batch = s.abstract_batch(16)
    with jax.set_mesh(s.mesh):
        text = jit_train_step(s).lower(s.shapes, batch).compile().as_text()
    out = {}
    for kind, axes, sent, line in collective_ops(text, dict(s.mesh.shape), *table_weights(s)):
        result = re.search(r"=\s*\(?([a-z]+)\d*\[", line).group(1)
        if "data" in axes and result in ("f", "bf"):
            out[kind] = out.get(kind, 0) + sent
    return out, s


def _bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("zero", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_data_sync_once_per_step_and_the_stage_share(zero):
    """(2,4,1) 1F1B syncs over `data` what a (2,1,1) step syncs for the embedding and head plus a quarter
    of it for the layers (the stage's share), and the same at M=4 and M=8: once per step, not per tick. Four layers,
    one a stage (the share is the same at eight; each compile takes about half the time)."""
    base = ["model.n_layers=4", "mesh.model=1", f"train.zero_stage={zero}"]
    ref, s = _data_sync(base + ["mesh.data=2", "mesh.stage=1", "train.microbatches=1"], 2)
    pipe = {m: _data_sync(base + ONE_F + ["mesh.data=2", "mesh.stage=4", f"train.microbatches={m}"], 8)[0]
            for m in (4, 8)}
    assert pipe[4] == pipe[8], pipe
    p = s.param_shapes
    held = _bytes({n: v for n, v in p.items() if n != "layers"}) + _bytes(p["layers"]) / 4  # what a stage holds
    # K=2 bus bytes: an all-reduce sends the array once, a reduce-scatter or all-gather half of it
    # (the scalars of the loss and grad norm add < 100 bytes to the all-reduce)
    want = {"all-reduce": held} if zero < 2 else {"reduce-scatter": held / 2, "all-reduce": 0}
    want["all-gather"] = held / 2  # ZeRO-1: the updated parameters; ZeRO-3: the weights, once
    for kind, b in want.items():
        assert pipe[4].get(kind, 0) == pytest.approx(b, rel=1e-3, abs=200), (kind, pipe[4], want)
        assert ref.get(kind, 0) * held / _bytes(p) == pytest.approx(b, rel=1e-3, abs=200), (kind, ref, want)
    assert set(pipe[4]) <= set(want), pipe[4]


def test_hlo_parser_reads_mesh_groups_with_device_ids():
    """XLA writes a data-axis group of a (2,4,1) mesh as mesh[4,2] over device_ids [2,4]T(1,0), {'axis_1'}."""
    line = ("%ar = f32[64]{0} all-reduce(f32[64]{0} %x), replica_groups=mesh['axis_0'=4,'axis_1'=2], "
            "device_ids=([2,4]T(1,0)) {'axis_1'}, use_global_device_ids=true, to_apply=%add")
    hlo = f"HloModule m\n\nENTRY %main (a: f32[64]) -> f32[64] {{\n  {line}\n}}\n"
    assert collective_bytes(hlo, {"data": 2, "stage": 4, "model": 1}) == {("all-reduce", ("data",)): 64 * 4}


@pytest.mark.parametrize("overrides,sync", [
    (["mesh.data=2", "mesh.stage=2", "train.zero_stage=1"], "sync explicit all-reduce, once per step"),
    (["mesh.data=2", "mesh.stage=2", "train.zero_stage=3"], "sync explicit reduce-scatter (ZeRO-2/3), once per step"),
    (["mesh.data=2", "mesh.stage=2", "train.grad_sync=ring"], "sync ring, once per step"),
    (["mesh.data=4", "mesh.stage=1", "train.microbatches=1"], "sync auto (compiler all-reduce) |"),
    (["mesh.data=4", "mesh.stage=1"], "sync explicit all-reduce")])  # accumulation: reduced once, after the loop
def test_start_up_line_names_the_pipelines_sync(overrides, sync):
    """Every pipeline syncs over `data` itself, once per step: the start-up line says so (the compiler's
    all-reduce is only the no-pipeline step's, without accumulation)."""
    from trainer.run.loop import describe
    cfg = load_config(TINY + ["mesh.model=1", "train.microbatches=2"] + overrides)
    s = make_setup(cfg, jax.devices()[:cfg.mesh.data * cfg.mesh.stage])
    assert sync in describe(s), describe(s)
