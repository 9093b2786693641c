"""Leaves split over `data` by a rule, and collectives that reach the layer (issue 46).

A toy Mixture-of-Experts family, registered here only: Llama's attention, then an MLP of EXPERTS experts whose
weights carry a logical `experts` axis that the run's rules map to `data` (each data rank holds its slice). Each
layer sends every token's hidden state to the rank holding its expert (token t: expert t % EXPERTS) by the
all_to_all of LayerCall's collectives, runs its own experts on what it received and sends the results back. It
trains as on one device on every layout below; in the compiled program that leaf is never gathered or reduced
over `data`; the planner counts it per device as XLA holds it.
"""
import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SGD, TINY, corpus, fresh_state, max_rel
from jax.sharding import PartitionSpec as P

from meshes import RULES
from models import ModelSpec, Param, register
from models.layers import rms_norm
from models.families.llama import llama_inventory
from models.transformer import attention_half

EXPERTS = 8
EP_RULES = RULES.replace(experts="data")  # the run's rules: experts over `data`
X, D, F = ("batch", "seq", "embed"), "embed", "mlp"


def experts_inventory(c):
    """Llama's, with the SwiGLU MLP replaced by EXPERTS GELU experts of width d_ff."""
    inv = llama_inventory(c)
    layers = {k: v for k, v in inv["layers"].items() if k not in ("w_gate", "w_up", "w_down")}
    layers.update(w_in=Param((EXPERTS, c.d_model, c.d_ff), ("experts", D, F), "normal", True),
                  w_out=Param((EXPERTS, c.d_ff, c.d_model), ("experts", F, D), "residual", True))
    return {**inv, "layers": layers}


def dispatch(coll, x_BTD, w_in, w_out):
    """One rank's part: its tokens to the ranks holding their experts and back. w_in, w_out: this rank's experts
    (El of them: rank r holds experts r*El .. r*El + El - 1); routing by position, so every rank knows it."""
    k, me, El = coll.axis_size("experts"), coll.axis_index("experts"), w_in.shape[0]
    if El * k != EXPERTS:  # a rank holding the whole leaf (gathered over `data`) where it should hold its slice
        raise ValueError(f"{El} experts on each of {k} ranks, not {EXPERTS}")
    expert_T = jnp.arange(x_BTD.shape[1]) % (El * k)
    to_KT = expert_T // El == jnp.arange(k)[:, None]  # token t goes to rank expert_T[t] // El
    send_KBTD = jnp.where(to_KT[:, None, :, None], x_BTD[None], 0)
    got_KBTD = coll.all_to_all(send_KBTD, "experts", 0, 0)  # block j: rank j's tokens for my experts
    mine_ET = (expert_T == me * El + jnp.arange(El)[:, None]).astype(x_BTD.dtype)
    a_KBTEF = jax.nn.gelu(jnp.einsum("kbtd,edf->kbtef", got_KBTD, w_in))
    y_KBTD = coll.psum(jnp.einsum("kbtef,efd,et->kbtd", a_KBTEF, w_out, mine_ET), "mlp")  # fully manual: TP sum
    back_KBTD = coll.all_to_all(y_KBTD, "experts", 0, 0)  # block j: my tokens' outputs from rank j
    return jnp.sum(jnp.where(to_KT[:, None, :, None], back_KBTD, 0), axis=0)


def moe_half(c, p, x, call, over):
    """x + the experts of norm(x), in a region manual over `over` (None: every mesh axis)."""
    h = rms_norm(x, p["mlp_norm"].astype(x.dtype), c.norm_eps)
    run = call.collectives.region(functools.partial(dispatch, call.collectives),
                                  (X, ("experts", D, F), ("experts", F, D)), X, over=over)
    return call.constrain(x + run(h, p["w_in"].astype(x.dtype), p["w_out"].astype(x.dtype)), X)


def experts_layer(over):
    def layer(c, p, x, call):
        x = call.half(functools.partial(attention_half, c, call=call))(p, x)
        return call.half(functools.partial(moe_half, c, call=call, over=over))(p, x), {}
    return layer


register(ModelSpec("toy_experts", experts_inventory, experts_layer(("experts",))))
# the same toy with its experts in a region manual over every mesh axis (as a Pallas/Mosaic kernel needs)
register(ModelSpec("toy_experts_manual", experts_inventory, experts_layer(None)))
TOY = TINY + SGD + ["model.family=toy_experts"]


def _setup(overrides, rules=EP_RULES):
    from meshes import devices_named
    from trainer.config import load_config
    from trainer.state import make_setup
    cfg = load_config(TOY + list(overrides))
    return make_setup(cfg, jax.devices()[:devices_named(cfg.mesh)], rules)


class Trained(NamedTuple):
    losses: np.ndarray
    params: dict
    grad_norms: np.ndarray
    hlo: str  # the compiled step's
    arguments: int  # its argument bytes per device (memory_analysis)
    setup: object


@functools.lru_cache(maxsize=None)
def _train(overrides: tuple, steps=3) -> Trained:
    """`steps` steps of the toy on a layout, its step compiled once (run and read)."""
    from trainer.data.batches import Batches
    from trainer.plan.verify import abstract_inputs
    from trainer.step import jit_train_step
    s = _setup(overrides)
    state = fresh_state(s)
    b = Batches(corpus(), s.cfg.train.seed, s.cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
    losses, norms = [], []
    with jax.set_mesh(s.mesh):
        step = jit_train_step(s).lower(*abstract_inputs(s)).compile()
        for i in range(steps):
            state, m = step(state, jax.device_put(b.global_train(i), s.batch_sharding()))
            losses.append(float(m["loss"]))
            norms.append(float(m["grad_norm"]))
    return Trained(np.array(losses), jax.tree.map(np.asarray, state["params"]), np.array(norms), step.as_text(),
                   step.memory_analysis().argument_size_in_bytes, s)


def _one_device() -> Trained:
    return _train(("mesh.data=1", "mesh.stage=1", "mesh.model=1"))


def _leaf_shapes(s) -> set[tuple]:
    """The expert weights' shapes as any device may hold them: whole or split over `data` and `model`, with or
    without the layers axis. No other leaf has any of them (checked)."""
    k, tp, c = s.mesh.shape["data"], s.mesh.shape["model"], s.model
    out = {(e, d, f) for e in {EXPERTS, EXPERTS // k} for d in {c.d_model} for f in {c.d_ff, c.d_ff // tp}}
    out |= {(e, f, d) for e, d, f in out}
    out |= {(c.n_layers,) + sh for sh in out}
    others = {tuple(x.shape[i:]) for path, x in jax.tree_util.tree_leaves_with_path(s.param_shapes)
              if "w_in" not in str(path) and "w_out" not in str(path) for i in (0, 1)}
    assert not out & others, out & others
    return out


def data_collectives_on(text: str, s) -> list[str]:
    """The all-gathers, all-reduces and reduce-scatters over `data` (their replica groups span it) of an array of
    one of the expert weights' shapes: lines of the HLO."""
    from trainer.plan.hlo import collective_ops
    from trainer.plan.verify import table_weights
    shapes = _leaf_shapes(s)
    bad = []
    for kind, axes, _, line in collective_ops(text, dict(s.mesh.shape), *table_weights(s)):
        result = line.split(f" {kind}", 1)[0]  # the result's type(s), before the op
        dims = {tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"\[([\d,]*)\]", result)}
        if kind in ("all-gather", "all-reduce", "reduce-scatter") and "data" in axes and dims & shapes:
            bad.append(line.strip()[:200])
    return bad


def _check(overrides) -> Trained:
    r = _train(tuple(overrides))
    losses, params, norms, text, _, s = r
    ref_losses, ref_params, ref_norms = _one_device()[:3]
    assert s.mesh.shape["data"] >= 2
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    assert max_rel(params, ref_params) < 1e-5
    assert ref_losses[-1] < ref_losses[0]
    assert data_collectives_on(text, s) == []
    assert s.reduction.leaves["layers"]["w_in"].kind == "none"  # the decision read: never reduced over `data`
    return r


SLOW = pytest.mark.slow
ZERO3_RING = ["mesh.data=8", "train.zero_stage=3", "train.grad_sync=ring"]
LAYOUTS = [
    ("zero0-psum", ["mesh.data=2", "train.grad_sync=psum"], SLOW),
    ("zero0-compiler", ["mesh.data=2"], SLOW),
    ("zero1-compiler", ["mesh.data=4", "train.zero_stage=1"], SLOW),
    ("zero2-psum", ["mesh.data=2", "train.zero_stage=2"], SLOW),
    ("zero3-psum-2x1x2", ["mesh.data=2", "mesh.model=2", "train.zero_stage=3", "train.grad_sync=psum"], SLOW),
    ("zero3-ring-8x1x1", ZERO3_RING, ()),
    ("zero1-ring-m2", ["mesh.data=2", "train.zero_stage=1", "train.grad_sync=ring", "train.microbatches=2"], SLOW),
    ("zero0-accumulation-m2", ["mesh.data=2", "train.microbatches=2"], SLOW),
    ("1f1b-2x2x1", ["mesh.data=2", "mesh.stage=2", "mesh.model=1", "train.pipeline_schedule=1f1b",
                    "train.microbatches=2"], SLOW),
    ("1f1b-zero3-ring-2x2x1", ["mesh.data=2", "mesh.stage=2", "mesh.model=1", "train.pipeline_schedule=1f1b",
                               "train.microbatches=2", "train.zero_stage=3", "train.grad_sync=ring"], SLOW),
    # the fully manual region inside the explicit step's shard_map (manual over `data` already: it adds `model`)
    ("fully-manual-zero3-psum-2x1x4", ["mesh.data=2", "mesh.model=4", "model.family=toy_experts_manual",
                                       "train.zero_stage=3", "train.grad_sync=psum", "train.microbatches=2"], SLOW),
]


@pytest.mark.parametrize("overrides", [pytest.param(o, id=n, marks=m) for n, o, m in LAYOUTS])
def test_the_experts_toy_trains_as_on_one_device(overrides):
    """Loss, grad norm and parameters within 1e-5 of one device (SGD, no clipping); the expert weights are never
    all-gathered, all-reduced or reduce-scattered over `data` in the compiled step."""
    _check(overrides)


def test_the_fully_manual_form_writes_out_the_tensor_parallel_sums():
    """Fully manual (2,1,4): the experts' region is manual over `data` and `model` (no collective of the compiler's
    inside it); its psum over `mlp` is an all-reduce over `model` only, the all_to_all one over `data` only."""
    from trainer.plan.hlo import collective_ops
    _, _, _, text, _, s = _check(["mesh.data=2", "mesh.model=4", "model.family=toy_experts_manual"])
    kinds = {(kind, axes) for kind, axes, _, _ in collective_ops(text, dict(s.mesh.shape))}
    assert ("all-to-all", ("data",)) in kinds and ("all-reduce", ("model",)) in kinds, kinds


def test_zero_leaves_a_leaf_split_by_its_rule_split_and_adds_data_to_the_rest():
    """ZeRO adds `data` only to leaves not already split over it (no duplicate), at every stage."""
    from jax.sharding import PartitionSpec as P
    for zero in range(4):
        s = _setup(["mesh.data=2", "mesh.model=4", f"train.zero_stage={zero}"])
        sh = s.shardings["params"]["layers"]
        assert sh["w_in"].spec == P("stage", "data", None, "model"), (zero, sh["w_in"].spec)
        assert s.layout.data_dim((2, EXPERTS, 64, 128), ("layers", "experts", D, F)) is None
        assert ("data" in str(sh["wq"].spec)) == (zero >= 3), (zero, sh["wq"].spec)
        manual = s.reduction.manual_specs("param", {"data"})["layers"]
        assert manual["w_in"] == P(None, "data", None, None), manual["w_in"]


def _plan(s):
    import dataclasses

    from trainer.hardware import get_device
    from trainer.plan.core import estimate, strategy_of
    st = dataclasses.replace(strategy_of(s.cfg, s.mesh.size), rules=EP_RULES)
    return estimate(s.model, s.cfg.train, st, get_device("h100-80g"), 1, "float32")


def _xla_state_bytes(r: Trained) -> int:
    """The compiled step's arguments less the batch and the step counter: parameters and optimizer state."""
    s = r.setup
    batch = sum(f.size * f.dtype.itemsize for f in jax.tree.leaves(s.abstract_batch())) // s.mesh.shape["data"]
    return r.arguments - batch - 4


def test_the_planner_counts_the_split_leaf_per_device_as_xla_holds_it():
    """(8,1,1), ZeRO-3 (the default layout above, compiled once): the planner's parameter (and SGD momentum)
    bytes per device within 1% of XLA's arguments, the expert weights (most of the model) 1/8 on each device, as
    every other leaf."""
    r = _check(ZERO3_RING)
    plan, xla = _plan(r.setup), _xla_state_bytes(r)
    assert abs(plan.params_bytes + plan.opt_state_bytes - xla) <= 0.01 * xla, (plan.params_bytes, xla)
    whole = sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(r.setup.param_shapes))
    assert plan.params_bytes < 0.2 * whole


@pytest.mark.slow
def test_the_planner_counts_the_split_leaf_per_device_below_zero_3_and_leaves_its_gradient_unreduced():
    """(8,1,1), ZeRO 0, AdamW: only the experts are split (1/8 on each device, their AdamW moments too): parameter
    and optimizer-state bytes within 1% of XLA's; the gradient traffic over `data` within 5% of the HLO's (the
    experts' none; the layer's own all-to-alls are the family's, not the planner's)."""
    from trainer.plan.hlo import collective_bytes
    r = _train(("mesh.data=8", "train.optimizer=adamw"))
    plan = _plan(r.setup)
    xla = _xla_state_bytes(r)
    assert abs(plan.params_bytes + plan.opt_state_bytes - xla) <= 0.01 * xla, (plan.params_bytes, xla)
    whole = sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(r.setup.param_shapes))
    assert plan.params_bytes < 0.4 * whole
    hlo = sum(b for (kind, axes), b in collective_bytes(r.hlo, dict(r.setup.mesh.shape)).items()
              if "data" in axes and kind != "all-to-all")
    assert abs(plan.axis_bytes("data") - hlo) <= 0.05 * hlo, (plan.transfers, hlo)


@pytest.mark.slow
@pytest.mark.parametrize("sync", [["mesh.data=2", "train.sync=local_sgd", "train.sync_every=1"],
                                  ["mesh.data=4", "train.sync=diloco", "train.sync_every=1", "train.outer_lr=1",
                                   "train.outer_momentum=0"]], ids=["local-sgd-h1", "diloco-h1"])
def test_local_sgd_keeps_the_split_leaf_one_array_never_averaged(sync):
    """Local SGD and DiLoCo, H=1: a replica of every other leaf per data rank, the experts one array split over
    `data` (each rank its slice, its gradient the replicas' mean, never averaged); trains as on one device."""
    from trainer.parallel.localsgd import owned
    r = _train(tuple(sync))
    s, ref = r.setup, _one_device()
    own = owned(s.tx, s.reduction, s.shapes["opt_state"])["params"]
    assert own["layers"]["w_in"] is False and r.params["layers"]["w_in"].shape == ref.params["layers"]["w_in"].shape
    np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-5)
    assert max_rel(jax.tree.map(lambda x, mine: x[0] if mine else x, r.params, own), ref.params) < 1e-5
    assert data_collectives_on(r.hlo, s) == []
    assert abs(_eval(r) - _eval(ref)) <= 1e-5 * abs(_eval(ref))  # the replicas' mean, the experts as they are


def _eval(r: Trained) -> float:
    """The eval step's loss sum of the trained parameters on the first batch."""
    from trainer.data.batches import Batches
    from trainer.step import jit_eval_step
    s = r.setup
    b = Batches(corpus(), s.cfg.train.seed, s.cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
    with jax.set_mesh(s.mesh):
        params = jax.device_put(r.params, s.shardings["params"])
        return float(jit_eval_step(s)(params, jax.device_put(b.global_train(0), s.batch_sharding()))[0])


def _each_collective(coll, x):
    """Every collective over `experts` (and `mlp`) on one rank's block x of a (4, 8) array ("experts", "mlp")."""
    k = coll.axis_size("experts")
    return {"gather": coll.all_gather(x, "experts", 0),  # the whole column block, on every rank
            "scatter": coll.reduce_scatter(coll.all_gather(x, "experts", 0), "experts", 0),  # k x its block
            "psum": coll.psum(x, "experts"),  # the blocks' sum, on every rank
            "a2a": coll.all_to_all(x, "experts", 0, 0),  # row j of every rank's block, on rank j
            "index": jnp.full((1,), coll.axis_index("experts")) * 10 + k,
            "mlp": coll.psum(x, "mlp") * coll.axis_size("mlp")}  # a sum over `model` where it is manual


OUT = {"gather": (None, "mlp"), "scatter": ("experts", "mlp"), "psum": ("experts", "mlp"), "a2a": ("experts", "mlp"),
       "index": ("experts",), "mlp": ("experts", "mlp")}


@pytest.mark.parametrize("where", ["compiler", "explicit", "fully-manual", "local"])
def test_each_collective_over_a_logical_axis_in_every_context(where):
    """On (2,1,4), experts -> data and mlp -> model: a region over `experts` from the compiler's context (a nested
    shard_map), the same inside a shard_map already manual over `data` (the explicit step's), a region manual over
    every axis, and the local form (one rank): each collective against numpy."""
    from meshes import Collectives, build_mesh
    from models.spec import LOCAL
    mesh = build_mesh(data=2, model=4)
    coll = LOCAL if where == "local" else Collectives(EP_RULES, mesh)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    fn = coll.region(functools.partial(_each_collective, coll), (("experts", "mlp"),), OUT,
                     over=None if where == "fully-manual" else ("experts",))
    if where == "explicit":
        outs = {k: P(*("data" if a == "experts" else None for a in v)) for k, v in OUT.items()}
        fn = jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=outs, axis_names={"data"}, check_vma=False)
    with jax.set_mesh(mesh):
        got = jax.tree.map(np.asarray, jax.jit(fn)(x))
    k, tp = (1, 1) if where == "local" else (2, 4 if where == "fully-manual" else 1)
    blocks = np.split(x, k)
    np.testing.assert_array_equal(got["gather"], x)
    np.testing.assert_array_equal(got["scatter"], k * x)
    np.testing.assert_array_equal(got["psum"], np.concatenate([sum(blocks)] * k))
    np.testing.assert_array_equal(got["a2a"], np.concatenate([np.stack([b[j] for b in blocks]) for j in range(k)])
                                  if k > 1 else x)
    np.testing.assert_array_equal(got["index"], np.arange(k) * 10 + k)
    per = np.split(x, tp, axis=1)  # a sum over the model ranks' column blocks, times their number
    np.testing.assert_array_equal(got["mlp"], np.concatenate([sum(per) * tp] * tp, axis=1))
