"""Expert parallelism (train.expert_parallel): an MoE's experts split over `data`, each rank's tokens sent to the
ranks holding their experts (dropless: gathered and the results reduce-scattered; with a capacity: all-to-all in
per-row slots). Every layout against one device (SGD, no clipping; loss, grad_norm, aux/... and moe/dropped,
parameters); the compiled program (no expert weight gathered or reduced over `data`; each rank holds 1/data of
them); the one-line errors."""
import jax
import numpy as np
import pytest
from conftest import SGD, TINY, fresh_state
from test_moe import _train, same_as_one_device

E = 8  # experts: divisible by every mesh.data below
MOE = SGD + ["model.family=mixtral", f"model.n_experts={E}", "model.expert_d_ff=32", "model.router_aux_loss=0.1",
             "model.router_z_loss=0.01"]
CAPACITY = ("model.capacity_factor=1.0",)
ONE = ("mesh.data=1", "mesh.stage=1", "mesh.model=1")
ZERO3 = ("mesh.data=4", "mesh.stage=1", "mesh.model=2", "train.zero_stage=3")
# (4,1,2) ZeRO-3 dropless runs by default at a moderate router scale (test_the_router_gradient_...), x20 under -m slow
LAYOUTS = {
    "(2,4,1) 1F1B capacity": (CAPACITY + ("model.n_layers=4",),
                              ("mesh.data=2", "mesh.stage=4", "mesh.model=1", "train.microbatches=4",
                               "train.pipeline_schedule=1f1b")),
}
SLOW = {
    "(4,1,2) ZeRO-3 dropless": ((), ZERO3),
    "(8,1,1) ZeRO-0 dropless": ((), ("mesh.data=8", "mesh.stage=1", "mesh.model=1")),
    "(8,1,1) ZeRO-0 capacity": (CAPACITY, ("mesh.data=8", "mesh.stage=1", "mesh.model=1")),
    "(4,1,2) ZeRO-3 capacity": (CAPACITY, ZERO3),
    "(2,4,1) 1F1B dropless": (("model.n_layers=4",), LAYOUTS["(2,4,1) 1F1B capacity"][1]),
    "(2,2,2) interleaved V=2 dropless": (("model.n_layers=4",),
                                         ("mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.microbatches=2",
                                          "train.pipeline_schedule=interleaved_1f1b", "train.pipeline_repeats=2")),
    "(2,2,2) interleaved V=2 capacity": (CAPACITY + ("model.n_layers=4",),
                                         ("mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.microbatches=2",
                                          "train.pipeline_schedule=interleaved_1f1b", "train.pipeline_repeats=2")),
    "(4,1,2) psum M=2 dropless": ((), ("mesh.data=4", "mesh.stage=1", "mesh.model=2", "train.grad_sync=psum",
                                       "train.microbatches=2")),
    "(4,1,2) psum M=2 capacity": (CAPACITY, ("mesh.data=4", "mesh.stage=1", "mesh.model=2", "train.grad_sync=psum",
                                             "train.microbatches=2")),
    "(8,1,1) ring ZeRO-1 dropless": ((), ("mesh.data=8", "mesh.stage=1", "mesh.model=1", "train.grad_sync=ring",
                                          "train.zero_stage=1")),
    "(2,1,4) ZeRO-2 remat full capacity": (CAPACITY + ("model.remat=full",),
                                           ("mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=2")),
    "(4,1,2) remat dots M=4 dropless": (("model.remat=dots",), ("mesh.data=4", "mesh.stage=1", "mesh.model=2",
                                                                 "train.microbatches=4")),
}
ROUTER_SCALE = 20.0  # the router's weights x20: top-k margins far above the layouts' float differences


def _same_as_one_device(model, layout):
    same_as_one_device(model, layout, base=tuple(MOE), router_scale=ROUTER_SCALE, split=True)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_one_device(name):
    _same_as_one_device(*LAYOUTS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_more_layouts_equal_one_device(name):
    _same_as_one_device(*SLOW[name])


# the router's weights x4: on TINY's first layer logits of std 0.8 and top-2 weights of 0.52-0.67 (10th to 90th
# percentile), where x20 (ROUTER_SCALE) gives std 3.9 and 0.57-0.97 and weights 20x larger, against which the layouts'
# parameter check measures its 1e-5
MODERATE = 4.0
NO_Z = tuple(m for m in MOE if not m.startswith("model.router_z_loss")) + ("model.router_z_loss=0",)


@pytest.mark.parametrize("routing", ["dropless", pytest.param("capacity", marks=pytest.mark.slow)])
def test_the_router_gradient_equals_one_device_at_a_moderate_scale(routing):
    """(4,1,2) ZeRO-3, experts split over `data`, the router x4 and no z-loss (its gradient would hide the
    combine's): what every layout checks (_same_as_one_device, on the same two runs), and the router's update over
    two SGD steps (the first at lr 0: lr x the momentum of both steps' gradients, the routing weights' share through
    the dispatch and its transpose, and the load-balancing loss's) equal to one device's within 1e-5 of its
    largest element."""
    # lr 1 (the update read at the precision of the weights, about 0.3: float32 rounds them at 3e-8)
    model = (CAPACITY if routing == "capacity" else ()) + ("train.lr=1",)
    same_as_one_device(model, ZERO3, base=NO_Z, router_scale=MODERATE, split=True)
    (_, want_p, _, r0), (_, got_p, _, r0_got) = [_train(model + lay, base=NO_Z, router_scale=MODERATE)
                                                 for lay in (ONE, ZERO3)]  # the same runs (cached)
    assert np.array_equal(r0, r0_got)
    step_want, step_got = r0 - want_p["layers"]["router"], r0 - got_p["layers"]["router"]
    err, top = np.max(np.abs(step_got - step_want)), np.max(np.abs(step_want))
    assert top > 1e-3 * np.max(np.abs(r0)) and err <= 1e-5 * top, (err, top)


@pytest.mark.parametrize("keys,message", [
    (["model.n_experts=6", "mesh.data=4", "mesh.model=2", "train.expert_parallel=true"],
     r"^train.expert_parallel=true: model.n_experts=6 is not divisible by mesh.data=4 \(each data rank holds "
     r"n_experts / mesh.data experts\); set train.expert_parallel=false \(experts replicated\)$"),
    (["mesh.data=8", "train.expert_parallel=true", "train.sync=local_sgd", "train.sync_every=2"],
     r"^train.expert_parallel=true: train.sync=local_sgd keeps a whole replica on every data rank, and an "
     r"expert-parallel rank holds only its experts; set train.expert_parallel=false \(experts replicated\)$"),
])
def test_bad_input_is_one_line(keys, message):
    from trainer.config import load_config, validate
    from trainer.errors import UserError
    with pytest.raises(UserError, match=message):
        validate(load_config(TINY + MOE + keys), 8)


def test_on_by_default_where_the_experts_divide_and_off_with_one_line_where_not(caplog):
    from trainer.config import expert_parallel, load_config
    assert expert_parallel(load_config(TINY + MOE + ["mesh.data=8"]), 8)
    assert not expert_parallel(load_config(TINY + MOE + ["mesh.data=8", "train.expert_parallel=false"]), 8)
    assert not expert_parallel(load_config(TINY + MOE + ["mesh.data=1"]), 1)
    with caplog.at_level("WARNING"):
        assert not expert_parallel(load_config(TINY + MOE + ["model.n_experts=6", "mesh.data=4"]), 4)
    assert "expert parallelism off: model.n_experts=6 is not divisible by mesh.data=4" in caplog.text


# ---- the compiled program (CPU HLO, compiled ahead of time: nothing runs) against the planner

def _compiled(overrides):
    """(XLA's measurement of the step, the plan of it, the pipeline table's weights for reading the HLO)."""
    from test_plan import _plan
    from trainer.plan.verify import measure, table_weights
    from trainer.state import make_setup
    cfg, plan = _plan(MOE + list(overrides))
    return measure(cfg, grads=False), plan, table_weights(make_setup(cfg, jax.devices()[:8]))


def _expert_shapes(m, plan) -> set[tuple]:
    """The expert weights' shapes as a device may hold them: all experts or a data rank's, whole or split over
    `model`, with or without the layers axis; no other leaf has any of them (checked)."""
    from models.families.moe import MoEConfig
    c = plan.model
    assert isinstance(c, MoEConfig)
    k, tp, F = m.mesh_shape["data"], m.mesh_shape["model"], c.expert_d_ff
    out = {(e, c.d_model, f) for e in (E, E // k) for f in (F, F // tp)}
    out |= {(e, f, d) for e, d, f in out}
    out |= {(c.n_layers,) + sh for sh in out}
    assert c.d_model != F
    return out


def expert_collectives(m, plan, weights) -> list[str]:
    """HLO lines of every all-gather, all-reduce or reduce-scatter over `data` of an array of an expert weight's
    shape (the weights or their gradients)."""
    import re

    from trainer.plan.hlo import collective_ops
    shapes, bad = _expert_shapes(m, plan), []
    for kind, axes, _, line in collective_ops(m.text, m.mesh_shape, *weights):
        result = line.split(f" {kind}", 1)[0]
        dims = {tuple(int(d) for d in x.split(",") if d) for x in re.findall(r"\[([\d,]*)\]", result)}
        if kind in ("all-gather", "all-reduce", "reduce-scatter") and "data" in axes and dims & shapes:
            bad.append(line.strip()[:160])
    return bad


def _expert_bytes(plan) -> float:
    """The expert weights' float32 bytes, all of them."""
    c = plan.model
    return 4.0 * c.n_layers * E * 3 * c.d_model * c.expert_d_ff


DISPATCH = {"dropless": (), "capacity": CAPACITY}


@pytest.mark.parametrize("routing", [pytest.param(r, marks=[] if r == "dropless" else [pytest.mark.slow])
                                     for r in DISPATCH])
@pytest.mark.parametrize("zero", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_the_compiled_step_splits_the_experts_and_the_planner_holds_it(zero, routing):
    """(8,1,1): against the experts replicated (train.expert_parallel=false), XLA's arguments (parameters and SGD
    momentum) hold 7/8 of the experts' bytes fewer at ZeRO-0 and the same at ZeRO-3; no all-gather, all-reduce or
    reduce-scatter over `data` of an expert weight or its gradient (the replicated step has them: its gradients'
    all-reduce, ZeRO-3's gathers); the
    planner's state within 1% of XLA's and its dispatch collectives (all-to-all with a capacity; dropless the
    all-to-all of its buffers; the exact path's ring apart on both sides) within 1% of the HLO's, as every
    collective over `data`."""
    layout = ["mesh.data=8", f"train.zero_stage={zero}", *DISPATCH[routing]]
    m, plan, weights = _compiled(layout)
    rep, _, _ = _compiled(layout + ["train.expert_parallel=false"])
    experts = _expert_bytes(plan) * 2  # the weights and SGD's momentum
    saved = rep.params_opt_bytes - m.params_opt_bytes
    assert abs(saved - (7 / 8 * experts if zero == 0 else 0)) <= 0.01 * experts, (saved, experts)
    assert expert_collectives(m, plan, weights) == []
    assert expert_collectives(rep, plan, weights) != []  # replicated: their gradients reduced (ZeRO-3: shards gathered)
    state = plan.params_bytes + plan.opt_state_bytes
    assert abs(state / m.params_opt_bytes - 1) < 0.01, (state, m.params_opt_bytes)
    for kind in ("all-to-all", "all-gather", "reduce-scatter", "all-reduce"):
        xla = m.collectives.get((kind, ("data",)), 0.0)
        mine = sum(t.bytes for t in plan.transfers if t.kind == kind and t.axis == "data" and not t.overflow)
        # (+256 B: the step's scalar sums, the loss's and the aux statistics', which the planner leaves out)
        assert abs(mine - xla) <= 0.01 * xla + 256, (kind, mine, xla)
    assert m.collectives.get(("all-to-all", ("data",)), 0) > 0  # dropless too: the buffers of _experts_routed


@pytest.mark.slow
@pytest.mark.parametrize("name", ["(4,1,2) ZeRO-3 remat full", "(2,4,1) 1F1B", "(2,2,2) interleaved V=2"])
@pytest.mark.parametrize("routing", list(DISPATCH))
def test_the_planner_holds_the_dispatch_on_more_layouts(name, routing):
    """The dispatch's bytes over `data` within 1% of the HLO's where layers are recomputed (remat; a pipeline's
    stage bodies) and under tensor parallelism; no expert weight gathered or reduced over `data`."""
    layout = {"(4,1,2) ZeRO-3 remat full": ["mesh.data=4", "mesh.model=2", "train.zero_stage=3", "model.remat=full"],
              "(2,4,1) 1F1B": ["mesh.data=2", "mesh.stage=4", "model.n_layers=4", "train.microbatches=4",
                               "train.pipeline_schedule=1f1b"],
              "(2,2,2) interleaved V=2": ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "model.n_layers=4",
                                          "train.microbatches=2", "train.pipeline_schedule=interleaved_1f1b",
                                          "train.pipeline_repeats=2"]}[name]
    m, plan, weights = _compiled(layout + list(DISPATCH[routing]))
    assert expert_collectives(m, plan, weights) == []
    kind = "all-to-all"  # dropless: the routed buffers' (the exact path's ring, listed apart, is collective-permutes)
    xla = m.collectives.get((kind, ("data",)), 0.0)
    mine = sum(t.bytes for t in plan.transfers if t.kind == kind and t.axis == "data" and not t.overflow)
    assert xla > 0 and abs(mine - xla) <= 0.01 * xla, (kind, mine, xla)


# ---- checkpoints

def _setup(overrides):
    from meshes import devices_named
    from trainer.config import load_config
    from trainer.state import make_setup
    cfg = load_config(TINY + MOE + list(overrides))
    return make_setup(cfg, jax.devices()[:devices_named(cfg.mesh)])


def saved_after_one_step(a, path):
    """(the state after step 0 on setup a, as numpy) saved as step 1 to `path`."""
    import numpy as np
    from test_moe_everywhere import Runner
    from trainer.ckpt.checkpoint import Checkpointer
    state, _ = Runner(a)(fresh_state(a), 0, 1)
    c = Checkpointer(a, path)
    c.save(1, state)
    c.close()
    return state, jax.tree.map(np.asarray, state)


@pytest.mark.slow
def test_a_checkpoint_of_8x1x1_restores_onto_2x1x4_and_one_device(tmp_path):
    """Saved after step 1 on (8,1,1) (one expert per data rank), restored bit for bit onto (2,1,4) ZeRO-3 (four
    per rank) and onto one device (all of them, replicated); step 2 on each equals the uninterrupted (8,1,1) run's
    (documents with padding: test_moe_everywhere's batches)."""
    import numpy as np
    from conftest import max_rel
    from test_moe_everywhere import Runner
    from trainer.ckpt.checkpoint import Checkpointer
    a = _setup(("mesh.data=8",))
    assert a.layout.rules["experts"] == "data"
    state, saved = saved_after_one_step(a, tmp_path / "run")
    after, (want,) = Runner(a)(state, 1, 2)
    for layout in (("mesh.data=2", "mesh.model=4", "train.zero_stage=3"), ONE):
        b = _setup(layout)
        c = Checkpointer(b, tmp_path / "run")
        restored, at = c.restore()
        c.close()
        assert at == 1 and all(np.array_equal(np.asarray(x), y) for x, y in zip(jax.tree.leaves(restored),
                                                                              jax.tree.leaves(saved)))
        state_b, (got,) = Runner(b)(restored, 1, 2)
        assert all(abs(got[k] - want[k]) <= 1e-5 * max(abs(want[k]), 1e-3) for k in want), (layout, got, want)
        assert max_rel(jax.tree.map(np.asarray, state_b["params"]), jax.tree.map(np.asarray, after["params"])) < 1e-5


def test_the_search_weighs_expert_parallelism():
    """`plan --search` plans each layout with the experts split over `data` (where n_experts divides it) and
    replicated (train.expert_parallel null), and the split one holds 1/data of the experts: at (8,1,1) ZeRO-0 its
    parameters are the replicated one's less 7/8 of the experts'; every expert degree (mesh.expert) splits them over
    `expert`; with train.expert_parallel=false only replicated."""
    from test_plan import H100
    from trainer.config import load_config, model_config
    from trainer.plan.search import strategies
    from trainer.plan.core import estimate
    from trainer.state import rules_by_data
    cfg = load_config(TINY + MOE)
    mc = model_config(cfg)
    tried = strategies(mc, cfg.train.batch_size, 8, rules=rules_by_data(cfg))
    at = {st.rules["experts"] for st in tried if (st.mesh["data"], st.expert, st.stage, st.model, st.zero)
          == (8, 1, 1, 1, 0)}
    assert at == {"data", None}
    assert {st.rules["experts"] for st in tried if st.data == 1} == {None}  # nothing to split over
    # mesh.expert: every degree dividing the 8 experts, the experts over it
    assert {st.expert for st in tried} == {1, 2, 4, 8}
    assert {st.rules["experts"] for st in tried if st.expert > 1} == {"expert"}
    plan = {st.rules["experts"]: estimate(mc, cfg.train, st, H100, 1, "float32") for st in tried
            if (st.mesh["data"], st.expert, st.stage, st.model, st.zero, st.microbatches, st.remat)
            == (8, 1, 1, 1, 0, 1, "none")}
    experts = 4.0 * mc.n_layers * E * 3 * mc.d_model * mc.expert_d_ff
    assert abs(plan[None].params_bytes - plan["data"].params_bytes - 7 / 8 * experts) < 1e-6 * experts
    off = load_config(TINY + MOE + ["train.expert_parallel=false"])
    assert {st.rules["experts"] for st in strategies(mc, 32, 8, rules=rules_by_data(off))} == {None}
