"""The mesh axes are listed in one place (meshes/axes.py) and every part asks it: a fourth axis, added in a test-only
configuration of meshes/ and the config section alone, trains as the three-axis run does; a checkpoint written by
5cbc3bb (metadata with three axes) restores; each run lays its arrays out by its own rules; outside meshes/axes.py code
names a mesh axis by its constant (DATA, STAGE, CONTEXT, MODEL), never by a literal (`axis_literals`, its rules and
a case per rule)."""
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
    axes = AXES[:4] + (Axis("extra", "a test-only axis that splits nothing"),) + AXES[4:]
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
    assert list(s4.mesh.shape.items()) == [("data", 2), ("stage", 1), ("expert", 1), ("context", 1), ("extra", 1),
                                           ("model", 4)]
    assert s4.mesh.devices.ravel().tolist() == s3.mesh.devices.ravel().tolist()
    three, four = train_setup(s3), train_setup(s4)
    np.testing.assert_array_equal(four.losses, three.losses)
    np.testing.assert_array_equal(four.grad_norms, three.grad_norms)
    jax.tree.map(np.testing.assert_array_equal, four.params, three.params)
    st3, st4 = strategy_of(cfg, 8), strategy_of(cfg4, 8)
    assert st4.describe().startswith("data=2 stage=1 expert=1 context=1 extra=1 model=4 ZeRO-3") and st4.devices == 8
    dev = get_device("h100-80g")
    p3, p4 = (estimate(s3.model, cfg.train, st, dev, 1, "float32", "cpu") for st in (st3, st4))
    assert (p4.total_bytes, p4.comm_bytes) == (p3.total_bytes, p3.comm_bytes) and p3.total_bytes > 0


def test_the_config_section_has_a_key_per_axis():
    """mesh.NAME for each axis (default 1, -1 allowed), mesh.dcn_NAME for each axis that may span hosts; the
    test-only axis's key is range-checked like the others'."""
    from trainer.config import all_keys, load_config, validate
    from trainer.errors import UserError
    assert all_keys("mesh.") == ["mesh.preset", "mesh.data", "mesh.stage", "mesh.expert", "mesh.context", "mesh.model",
                                 "mesh.dcn_data", "mesh.dcn_stage", "mesh.dcn_context"]
    axes, extended = four_axes()
    cfg4 = extended(load_config(TINY + ["mesh.data=-1", "mesh.model=2"]), extra=2)
    assert [f.name for f in dataclasses.fields(cfg4.mesh)] == ["preset", "data", "stage", "expert", "context",
                                                                "extra", "model", "dcn_data", "dcn_stage", "dcn_context"]
    assert validate(cfg4, 8).as_dict() == {"data": 2, "stage": 1, "expert": 1, "context": 1, "extra": 2, "model": 2}
    with pytest.raises(UserError, match=r"^mesh.extra=0 must be -1 \(the rest\) or >= 1"):
        validate(dataclasses.replace(cfg4, mesh=dataclasses.replace(cfg4.mesh, extra=0)), 8)


def test_shapes_by_name():
    """The shape of a mesh: sizes by name in mesh order, -1 filled, a DCN split that does not divide refused, an
    axis a checkpoint lacks read as 1, the layout search's shapes in its order."""
    shape = resolve({"model": 2}, 8, {"data": 2})
    assert shape.as_dict() == {"data": 4, "stage": 1, "expert": 1, "context": 1, "model": 2} and str(shape) == "4x1x1x1x2"
    assert (shape["data"], shape.devices, shape.dcn) == (4, 8, (2, 1, 1, 1, 1))
    assert shape.abstract().axis_names == ("data", "stage", "expert", "context", "model")
    with pytest.raises(MeshError, match=r"^mesh.dcn_stage=2 does not divide mesh.stage=1"):
        resolve({}, 8, {"stage": 2})
    with pytest.raises(MeshError, match=r"2 axes set to -1 \(data, model\)"):
        resolve({"model": -1}, 8)
    with pytest.raises(KeyError, match="'sequence' is not a mesh axis"):
        shape["sequence"]
    axes, _ = four_axes()
    assert recorded({"data": 2, "stage": 2, "model": 2}, [a.name for a in axes]).as_dict() == \
        {"data": 2, "stage": 2, "expert": 1, "context": 1, "extra": 1, "model": 2}
    assert [s.sizes for s in shapes(4, ["data", "stage", "model"])] == \
        [(4, 1, 1, 1, 1), (2, 2, 1, 1, 1), (1, 4, 1, 1, 1), (2, 1, 1, 1, 2), (1, 2, 1, 1, 2),
         (1, 1, 1, 1, 4)]
    assert mesh_shape({"model": 4}).sizes == (1, 1, 1, 1, 4)


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
    assert step == 2 and "(saved on mesh data=2 stage=2 expert=1 context=1 extra=1 model=2 ZeRO-1)" in said[0], said
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


@functools.lru_cache(maxsize=None)
def _parse(path: Path, mtime_ns: int) -> ast.AST:
    return ast.parse(path.read_text())


def parsed(path: Path) -> ast.AST:
    """A file's syntax tree, parsed once per version of the file for this module's checks."""
    return _parse(path, path.stat().st_mtime_ns)


def _name(node) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def spelled_axes(root: Path = ROOT) -> list[str]:
    """Where code of trainer/ and models/ spells the mesh axes out itself instead of asking meshes/: a literal of
    the three names, a tuple of three values named after them (`(st.data, st.stage, st.model)`), a shape unpacked
    into them (`data, stage, model = shape`), or axis types repeated per axis (`(AxisType.Auto,) * 3`)."""
    bad = []
    for f in sorted(p for pkg in ("trainer", "models") for p in (root / pkg).rglob("*.py")):
        for node in ast.walk(parsed(f)):
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


PACKAGES = ("meshes", "models", "trainer")


# --- A mesh axis is named by its constant (meshes/axes.py DATA, STAGE, CONTEXT, MODEL), never by a literal ---
# Each rule is one place where a string names a mesh axis; a literal mesh-axis name there, in meshes/, models/ or
# trainer/ outside meshes/axes.py, is reported. A literal counts where it is a mesh axis's name, "data,context" (a
# transfer over two axes) or an f-string with such a part, alone or inside a tuple, list or set. Elsewhere the same
# words mean something else and pass: the config's sections (cfg.model, "model.family", a JSON key), log words, and
# the logical axes (embed, heads, experts, seq, ...), none of which is spelled like a mesh axis.
AXIS_NAMES = frozenset(a.name for a in AXES)
COLLECTIVES = {"psum": 1, "pmean": 1, "pmax": 1, "pmin": 1, "all_gather": 1, "psum_scatter": 1, "all_to_all": 1,
               "ppermute": 1, "pshuffle": 1, "axis_index": 0, "axis_size": 0}  # jax.lax's: its axis argument
AXIS_KEYWORDS = ("axis_name", "axis_names", "manual")  # shard_map's, jax.lax's, Layout.constrainer's
SHAPE_MAKERS = ("mesh_shape", "resolve", "recorded", "shape_of", "shapes", "build_mesh", "validate")  # meshes/, config


def _callee(node) -> str | None:
    return _name(node.func) if isinstance(node, ast.Call) else None


def _spec(node):
    """`P(...)` / `PartitionSpec(...)`: each entry (a tuple entry's names too)."""
    return node.args if _callee(node) in ("P", "PartitionSpec") else []


def _mesh_shape(node):
    """A jax Mesh's size by name: `mesh.shape[NAME]`, `mesh.shape.get(NAME, 1)` (an array's shape takes ints)."""
    if isinstance(node, ast.Subscript) and _name(node.value) == "shape" and isinstance(node.value, ast.Attribute):
        return [node.slice]
    f = getattr(node, "func", None)
    if _callee(node) == "get" and isinstance(f, ast.Attribute) and _name(f.value) == "shape" and node.args:
        return node.args[:1]
    return []


def _collective(node):
    """A jax.lax collective's positional axis argument: psum(x, NAME), ppermute(x, NAME, pairs), axis_index(NAME)
    (its `axis_name=` is the axis keyword rule's)."""
    i = COLLECTIVES.get(_callee(node), -1)
    return node.args[i:i + 1] if i >= 0 else []


def _axis_keyword(node):
    """`axis_name=`, `axis_names=`, `manual=` of any call (shard_map, a collective, a constrainer), and a variable
    of one of those names."""
    if isinstance(node, ast.Call):
        return [k.value for k in node.keywords if k.arg in AXIS_KEYWORDS]
    if isinstance(node, ast.Assign):
        return [node.value] if any(_name(t) in AXIS_KEYWORDS for t in node.targets) else []
    return []


def _rules_entry(node):
    """The logical -> mesh table: a `Rules({...})` display's values and a `rules.replace(experts=NAME)` entry."""
    if _callee(node) == "Rules" and node.args and isinstance(node.args[0], ast.Dict):
        return node.args[0].values
    f = getattr(node, "func", None)
    if _callee(node) == "replace" and isinstance(f, ast.Attribute) and (_name(f.value) or "").lower().endswith("rules"):
        return [k.value for k in node.keywords]
    return []


def _comparison(node):
    """A name compared (==, !=, in, not in) with anything: a rules entry (`st.rules["experts"] != NAME`), a spec's
    entry (`e == NAME`), a mesh's names (`NAME in mesh.names`). Code of these packages compares no other word spelled
    like an axis (a config section is an attribute, cfg.model)."""
    return [node.left, *node.comparators] if isinstance(node, ast.Compare) else []


def _transfer(node):
    """A planner transfer's axis (trainer/plan/types.py Transfer): its first argument or axis=."""
    if _callee(node) != "Transfer":
        return []
    return node.args[:1] + [k.value for k in node.keywords if k.arg == "axis"]


def _shape_lookup(node):
    """A MeshShape's size by name (`shape[NAME]`, `st.mesh[NAME]`, `recorded(...)[NAME]`) and the axes or sizes by
    name a mesh shape is made from (`mesh_shape({NAME: 2})`, `shapes(n, [NAME, ...])`)."""
    if isinstance(node, ast.Subscript):
        v = node.value
        named = isinstance(v, ast.Name) and v.id.lower().endswith(("shape", "mesh")) or \
            isinstance(v, ast.Attribute) and v.attr == "mesh" or _callee(v) in SHAPE_MAKERS
        return [node.slice] if named else []
    if _callee(node) in SHAPE_MAKERS:
        args = node.args + [k.value for k in node.keywords]
        return [k for a in args if isinstance(a, ast.Dict) for k in a.keys if k is not None] + \
            [a for a in args if isinstance(a, (ast.List, ast.Tuple, ast.Set))]
    return []


AXIS_RULES = {"spec": _spec, "mesh shape": _mesh_shape, "collective": _collective, "axis keyword": _axis_keyword,
              "rules entry": _rules_entry, "comparison": _comparison, "transfer": _transfer,
              "shape lookup": _shape_lookup}


def _literal_axes(node) -> list[tuple[ast.AST, str]]:
    """(literal, name) of each mesh-axis name a node spells as a literal: a name, "a,b" of names, an f-string's
    literal parts, or any of these inside a tuple, list, set or starred item."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        parts = [p.strip() for p in node.value.split(",")]
        return [(node, p) for p in parts] if set(parts) <= AXIS_NAMES else []
    if isinstance(node, ast.JoinedStr):
        return [(node, p.strip()) for v in node.values if isinstance(v, ast.Constant)
                for p in str(v.value).split(",") if p.strip() in AXIS_NAMES]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts for n in _literal_axes(e)]
    if isinstance(node, ast.Starred):
        return _literal_axes(node.value)
    return []


def axis_literals(root: Path = ROOT) -> list[tuple[str, int, int, str, str]]:
    """(path, line, column, rule, name) of every literal mesh-axis name in an axis position (AXIS_RULES) in meshes/,
    models/ and trainer/, meshes/axes.py aside."""
    out = set()
    for f in sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")):
        rel = str(f.relative_to(root))
        if rel == "meshes/axes.py":
            continue
        for node in ast.walk(parsed(f)):
            if not isinstance(node, (ast.Call, ast.Subscript, ast.Assign, ast.Compare)):
                continue
            for rule, where in AXIS_RULES.items():
                for lit, name in (hit for e in where(node) for hit in _literal_axes(e)):
                    out.add((rel, lit.lineno, lit.col_offset, rule, name))
    return sorted(out)


def test_no_mesh_axis_is_named_by_a_literal():
    """Import DATA, STAGE, CONTEXT or MODEL from meshes where one of these is reported."""
    assert [f"{f}:{line}:{col} {rule}: {name}" for f, line, col, rule, name in axis_literals()] == []


# Per rule, code that names an axis there by a literal: each line one hit, reported under the rule with the names
LITERAL_CASES = {
    "spec": [('P(None, ("data", MODEL))', "data"), ('PartitionSpec("stage")', "stage")],
    "mesh shape": [('mesh.shape["stage"]', "stage"), ('s.mesh.shape.get("context", 1)', "context")],
    "collective": [('jax.lax.ppermute(y, "stage", pairs)', "stage"), ('jax.lax.psum(x, ("data", *axes))', "data"),
                   ('jax.lax.axis_index("model")', "model")],
    "axis keyword": [('jax.shard_map(f, mesh=m, in_specs=s, out_specs=s, axis_names={"data"})', "data"),
                     ('layout.constrainer(manual={"stage", *axes})', "stage"), ('manual = {"context"}', "context"),
                     ('jax.lax.pmean(x, axis_name="data")', "data")],
    "rules entry": [('Rules({"heads": "model", "seq": None})', "model"), ('RULES.replace(experts="data")', "data"),
                    ('st.rules.replace(seq="context")', "context")],
    "comparison": [('st.rules["experts"] != "data"', "data"), ('e == "model"', "model"),
                   ('"context" in self.mesh.names', "context")],
    "transfer": [('Transfer("context", "all-gather", "K and V", 1.0)', "context"),
                 ('Transfer(f"{over},model", "all-reduce", "", 1)', "model"),
                 ('Transfer(axis="data,context", kind="all-reduce", what="", bytes=1)', "data context")],
    "shape lookup": [('shape["data"]', "data"), ('st.mesh["model"]', "model"),
                     ('recorded(meta["mesh"])["data"]', "data"), ('mesh_shape({"model": 4})', "model"),
                     ('shapes(8, ["data", "model"])', "data model")],
}
# The same words where they are no mesh axis, and the axes by their constants: nothing reported
NOT_AXES = ['cfg.model.family', 'config_dict(cfg)["model"]', 'saved.get("model", {})', 'd["data"]["source"]',
            'keys = ["model.family", "data.source"]', 'run.goodput.timed("data", feed)', 'log("model")',
            'x.shape[0]', 'collectives.psum(x, "mlp")', 'RULES.replace(experts=DATA)', 'P(DATA, (STAGE, MODEL))',
            'Transfer(CONTEXT, "all-gather", "over context", 1.0)', 'jax.lax.psum(x, (STAGE, *axes))',
            'shape[DATA]', 'mesh.shape.get(CONTEXT, 1)', 'manual = {STAGE, *axes}', 'st.rules["experts"] == DATA',
            'row = {"data": data, "model": 1}', 'f"mesh.{name}"', 'section == "models"']


@pytest.mark.parametrize("rule", AXIS_RULES)
def test_the_axis_check_sees_a_literal_in_each_position(tmp_path, rule):
    """A file in trainer/ with each case of the rule on its own line: each line reported under the rule, with the
    names it spells; the same lines in meshes/axes.py are not (the one place that spells them)."""
    for pkg in ("meshes", "models", "trainer"):
        (tmp_path / pkg).mkdir()
    code = "".join(line + "\n" for line, _ in LITERAL_CASES[rule])
    (tmp_path / "trainer" / "x.py").write_text(code)
    (tmp_path / "meshes" / "axes.py").write_text(code)
    want = [("trainer/x.py", i, rule, n) for i, (_, names) in enumerate(LITERAL_CASES[rule], 1) for n in names.split()]
    assert sorted((f, line, r, name) for f, line, _, r, name in axis_literals(tmp_path)) == sorted(want)


def test_the_axis_check_passes_other_words_and_the_constants(tmp_path):
    for pkg in ("meshes", "models", "trainer"):
        (tmp_path / pkg).mkdir()
    (tmp_path / "models" / "x.py").write_text("\n".join(NOT_AXES) + "\n")
    assert axis_literals(tmp_path) == []
