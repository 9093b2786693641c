"""The mesh axes are listed in one place (meshes/axes.py) and every part asks it: a fourth axis, added in a test-only
configuration of meshes/ and the config section alone, trains as the three-axis run does; a checkpoint written by
5cbc3bb (metadata with three axes) restores; each run lays its arrays out by its own rules."""
import ast
import dataclasses
import functools
import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import SGD, TINY, corpus, train_setup
from meshes import AXES, RULES, Axis, MeshError, mesh_shape, recorded, resolve, shapes

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "ckpt_5cbc3bb"
# The run the fixture was saved from (tests/fixtures/ckpt_5cbc3bb/README.md), on one device
OLD = ["model.preset=tiny", "model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=32",
       "model.seq_len=16", "model.tie_embeddings=true", "train.batch_size=8", "train.steps=3",
       "train.warmup_steps=1", "train.lr=0.01", "train.optimizer=sgd", "train.grad_clip=0", "train.eval_every=0",
       "train.microbatches=2", "train.zero_stage=1", "run.progress=false", "mesh.data=1"]


def four_axes():
    """A test-only configuration: the mesh axes with one more, `extra`, before `model` (where `context` went), and
    the config whose mesh section is made from them (trainer/config/sections.py)."""
    from trainer.config.sections import Config, mesh_section
    axes = AXES[:3] + (Axis("extra", "a test-only axis that splits nothing"),) + AXES[3:]
    section = mesh_section(axes)

    @dataclasses.dataclass(frozen=True)
    class Config4(Config):
        mesh: section = dataclasses.field(default_factory=section)

    def extended(cfg, **sizes):
        rest = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "mesh"}
        return Config4(**rest, mesh=section(**dataclasses.asdict(cfg.mesh), **sizes))
    return axes, extended


def test_a_fourth_axis_of_size_one_trains_as_three_axes():
    """(2,1,4) ZeRO-3 with a fourth axis of size 1: the mesh has it, in its place; losses, gradient norms and
    parameters after 3 steps equal the three-axis run's, bit for bit; the planner plans it alike."""
    from trainer.config import load_config
    from trainer.plan.core import estimate, strategy_of
    from trainer.hardware import get_device
    from trainer.state import make_setup
    axes, extended = four_axes()
    cfg = load_config(TINY + ["mesh.data=2", "mesh.model=4", "train.zero_stage=3"] + SGD)
    cfg4 = extended(cfg, extra=1)
    s3, s4 = make_setup(cfg), make_setup(cfg4)
    assert list(s4.mesh.shape.items()) == [("data", 2), ("stage", 1), ("context", 1), ("extra", 1), ("model", 4)]
    assert s4.mesh.devices.ravel().tolist() == s3.mesh.devices.ravel().tolist()
    three, four = train_setup(s3), train_setup(s4)
    np.testing.assert_array_equal(four.losses, three.losses)
    np.testing.assert_array_equal(four.grad_norms, three.grad_norms)
    jax.tree.map(np.testing.assert_array_equal, four.params, three.params)
    st3, st4 = strategy_of(cfg, 8), strategy_of(cfg4, 8)
    assert st4.describe().startswith("data=2 stage=1 context=1 extra=1 model=4 ZeRO-3") and st4.devices == 8
    dev = get_device("h100-80g")
    p3, p4 = (estimate(s3.model, cfg.train, st, dev, 1, "float32", "cpu") for st in (st3, st4))
    assert (p4.total_bytes, p4.comm_bytes) == (p3.total_bytes, p3.comm_bytes) and p3.total_bytes > 0


def test_the_config_section_has_a_key_per_axis():
    """mesh.NAME for each axis (default 1, -1 allowed), mesh.dcn_NAME for each axis that may span hosts; the
    test-only axis's key is range-checked like the others'."""
    from trainer.config import all_keys, load_config, validate
    from trainer.errors import UserError
    assert all_keys("mesh.") == ["mesh.preset", "mesh.data", "mesh.stage", "mesh.context", "mesh.model",
                                 "mesh.dcn_data", "mesh.dcn_stage", "mesh.dcn_context"]
    axes, extended = four_axes()
    cfg4 = extended(load_config(TINY + ["mesh.data=-1", "mesh.model=2"]), extra=2)
    assert [f.name for f in dataclasses.fields(cfg4.mesh)] == ["preset", "data", "stage", "context", "extra",
                                                                "model", "dcn_data", "dcn_stage", "dcn_context"]
    assert validate(cfg4, 8).as_dict() == {"data": 2, "stage": 1, "context": 1, "extra": 2, "model": 2}
    with pytest.raises(UserError, match=r"^mesh.extra=0 must be -1 \(the rest\) or >= 1"):
        validate(dataclasses.replace(cfg4, mesh=dataclasses.replace(cfg4.mesh, extra=0)), 8)


def test_shapes_by_name():
    """The shape of a mesh: sizes by name in mesh order, -1 filled, a DCN split that does not divide refused, an
    axis a checkpoint lacks read as 1, the layout search's shapes in its order."""
    shape = resolve({"model": 2}, 8, {"data": 2})
    assert shape.as_dict() == {"data": 4, "stage": 1, "context": 1, "model": 2} and str(shape) == "4x1x1x2"
    assert (shape["data"], shape.devices, shape.dcn) == (4, 8, (2, 1, 1, 1))
    assert shape.abstract().axis_names == ("data", "stage", "context", "model")
    with pytest.raises(MeshError, match=r"^mesh.dcn_stage=2 does not divide mesh.stage=1"):
        resolve({}, 8, {"stage": 2})
    with pytest.raises(MeshError, match=r"2 axes set to -1 \(data, model\)"):
        resolve({"model": -1}, 8)
    with pytest.raises(KeyError, match="'sequence' is not a mesh axis"):
        shape["sequence"]
    axes, _ = four_axes()
    assert recorded({"data": 2, "stage": 2, "model": 2}, [a.name for a in axes]).as_dict() == \
        {"data": 2, "stage": 2, "context": 1, "extra": 1, "model": 2}
    assert [s.sizes for s in shapes(4, ["data", "stage", "model"])] == \
        [(4, 1, 1, 1), (2, 2, 1, 1), (1, 4, 1, 1), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 1, 4)]
    assert mesh_shape({"model": 4}).sizes == (1, 1, 1, 4)


def test_a_checkpoint_of_5cbc3bb_restores(tmp_path):
    """The fixture's step 2 (saved on (2,2,2) ZeRO-1 by 5cbc3bb) restores onto one device, in the four-axis
    configuration too: its parameters are those 5cbc3bb read, bit for bit; the next step's loss and gradient norm
    are the old run's step 3."""
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.ckpt.store import read_meta
    from trainer.config import load_config
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    from trainer.data.batches import Batches
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    meta = read_meta(run, 2)
    assert meta["mesh"] == {"data": 2, "stage": 2, "model": 2}
    want = dict(np.load(run / "params_step2.npz"))
    old = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    _, extended = four_axes()
    cfg = load_config(OLD + [f"run.dir={run}"])
    s = make_setup(extended(cfg, extra=1), jax.devices()[:1])
    said = []
    ckpt = Checkpointer(s, run, log=said.append)
    state, step = ckpt.restore()
    ckpt.close()
    assert step == 2 and "(saved on mesh data=2 stage=2 context=1 extra=1 model=2 ZeRO-1)" in said[0], said
    got = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # step 3's batch as 5cbc3bb drew it from the built-in corpus, Python 3.11's standard library: another Python's
    # library is other bytes, other batches (drawn here, they must equal it on 3.11)
    batch = dict(np.load(run / "batch_step3.npz"))
    if sys.version_info[:2] == (3, 11):
        b = Batches(corpus(), cfg.train.seed, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
        drawn = b.global_train(meta["rng"]["data_step"])
        assert sorted(drawn) == sorted(batch) and all(np.array_equal(drawn[k], batch[k]) for k in batch)
    with jax.set_mesh(s.mesh):
        _, m = jit_train_step(s)(state, jax.device_put({k: jax.numpy.asarray(v) for k, v in batch.items()},
                                                       s.batch_sharding()))
    np.testing.assert_allclose([float(m["loss"]), float(m["grad_norm"])], [old[2]["loss"], old[2]["grad_norm"]],
                               rtol=1e-5)


def constraints(jaxpr) -> set:
    """The PartitionSpecs of every sharding constraint in a jaxpr, nested ones (shard_map, scan, remat) included."""
    out = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            out.add(tuple(eqn.params["sharding"].spec))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out |= constraints(inner)
    return out


def test_two_runs_keep_their_own_rules():
    """Two runs in one process: A with the base rules, B splitting `embed` over `model` instead of the heads, MLP
    units and vocabulary. Each gets its own parameter shardings and activation constraints (in the step's shard_map
    over `data` too), checked for both after both are built."""
    from trainer.config import load_config
    from trainer.state import make_setup
    from trainer.step import train_step
    cfg = load_config(TINY + ["mesh.data=2", "mesh.model=4", "train.zero_stage=3"])
    a = make_setup(cfg)
    b = make_setup(cfg, rules=RULES.replace(embed="model", heads=None, kv_heads=None, mlp=None, vocab=None))
    # the expected specs written out: w_up is (layers, embed, mlp); ZeRO-3 adds `data` to embed
    want = {a: (P("stage", "data", "model"), P("model", "data")), b: (P("stage", ("data", "model"), None),
                                                                    P(None, ("data", "model")))}
    for s, (w_up, embed) in want.items():
        assert s.shardings["params"]["layers"]["w_up"].spec == w_up
        assert s.shardings["params"]["embed"].spec == embed
        assert s.layout.tree("param", s.param_shapes, s.logical) == s.shardings["params"]  # asked again: the same
    traced = {}
    for s in (a, b):
        state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), s.shapes, s.shardings)
        with jax.set_mesh(s.mesh):
            traced[s] = constraints(jax.make_jaxpr(functools.partial(train_step, s))(state, s.abstract_batch()).jaxpr)
    # attention's (batch, seq, heads, head_dim) inside the shard_map manual over `data`: heads over model in A only
    assert (None, None, "model", None) in traced[a] and (None, None, "model", None) not in traced[b]
    assert (None, None, None, None) in traced[b]
    assert a.layout.rules is RULES and b.layout.rules["embed"] == "model" and RULES["embed"] is None


THREE = {"data", "stage", "model"}


def _name(node) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def spelled_axes(root: Path = ROOT) -> list[str]:
    """Where code of trainer/ and models/ spells the mesh axes out itself instead of asking meshes/: a literal of
    the three names, a tuple of three values named after them (`(st.data, st.stage, st.model)`), a shape unpacked
    into them (`data, stage, model = shape`), or axis types repeated per axis (`(AxisType.Auto,) * 3`)."""
    bad = []
    for f in sorted(p for pkg in ("trainer", "models") for p in (root / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            hit = False
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                strings = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                hit = THREE <= strings or (isinstance(getattr(node, "ctx", None), ast.Load)
                                           and [_name(e) for e in node.elts] == ["data", "stage", "model"])
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
                hit = [_name(e) for e in node.targets[0].elts] == ["data", "stage", "model"] and \
                    not isinstance(node.value, ast.Tuple)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and isinstance(node.left, ast.Tuple):
                hit = any(isinstance(e, ast.Attribute) and _name(e.value) == "AxisType" for e in node.left.elts)
            if hit:
                bad.append((str(f.relative_to(root)), node.lineno))
    return [f"{f}:{line}" for f, line in sorted(bad)]


def test_the_axes_are_spelled_out_only_in_meshes(tmp_path):
    assert spelled_axes() == []
    for pkg in ("trainer", "models"):
        (tmp_path / pkg).mkdir()
    (tmp_path / "trainer" / "x.py").write_text(
        'AXES = ("data", "stage", "model")\nsizes = (cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model)\n'
        'data, stage, model = validate(cfg, n)\ntypes = (AxisType.Auto,) * 3\n'
        'data, stage, model = shape["data"], shape["stage"], shape["model"]\n')
    assert spelled_axes(tmp_path) == [f"trainer/x.py:{i}" for i in (1, 2, 3, 4)]
