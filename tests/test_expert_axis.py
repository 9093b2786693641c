"""An expert-parallel degree of its own (mesh.expert): the batch split over data x expert, an MoE's experts over
`expert` alone, ZeRO sharding them over `data`; dropless tokens sent to their experts' ranks by all-to-all in buffers
of model.dispatch_factor x the balanced share (the exact path, a ring of experts, where one overflows: moe/overflow).

Every layout against one device (SGD, no clipping; loss, grad_norm, aux/..., moe/dropped, moe/overflow and every
parameter, the router's and the experts' included, 1e-5), the router at a moderate scale (x4) and no z-loss, so that
a wrong router gradient shows; the compiled step's all-to-all bytes against the planner's and against the expert
degree; checkpoints across expert degrees."""
import jax
import numpy as np
import pytest
from conftest import SGD, TINY, fresh_state
from test_moe import _train, same_as_one_device

MIXTRAL = SGD + ["model.family=mixtral", "model.n_experts=8", "model.expert_d_ff=32", "model.router_aux_loss=0.1",
                 "model.router_z_loss=0"]
QWEN2_MOE = SGD + ["model.family=qwen2_moe", "model.n_experts=8", "model.expert_d_ff=32", "model.shared_expert_d_ff=48",
                   "model.router_aux_loss=0.1", "model.router_z_loss=0"]
MODERATE = 4.0  # the router's weights x4 (tests/test_expert_parallel.py MODERATE)
CAPACITY = ("model.capacity_factor=1.0",)
E2D4 = ("mesh.data=4", "mesh.expert=2")
E4Z3M2 = ("mesh.data=1", "mesh.expert=4", "mesh.model=2", "train.zero_stage=3")
E2S2 = ("mesh.data=2", "mesh.expert=2", "mesh.stage=2", "train.microbatches=2", "train.pipeline_schedule=1f1b")
LAYERS4 = ("model.n_layers=4",)  # two per stage (the one-device run too)
LAYOUTS = {"expert 2 in data 4, mixtral dropless": (MIXTRAL, (), E2D4),
           "expert 4 ZeRO-3 model 2, qwen2_moe capacity": (QWEN2_MOE, CAPACITY, E4Z3M2)}
SLOW = {"expert 2 in data 4, qwen2_moe capacity": (QWEN2_MOE, CAPACITY, E2D4),
        "expert 4 ZeRO-3 model 2, mixtral dropless": (MIXTRAL, (), E4Z3M2),
        "expert 2 1F1B over 2 stages, mixtral dropless": (MIXTRAL, LAYERS4, E2S2),
        "expert 2 1F1B over 2 stages, qwen2_moe capacity": (QWEN2_MOE, CAPACITY + LAYERS4, E2S2),
        # 64 tokens per rank and microbatch: buffers of 8x the balanced share (a rank's every choice), no overflow
        "expert 8 ZeRO-2 M=2 ring, mixtral dropless": (MIXTRAL, ("model.dispatch_factor=8",),
                                                       ("mesh.data=1", "mesh.expert=8", "train.zero_stage=2",
                                                        "train.microbatches=2", "train.grad_sync=ring")),
        "expert 2 in data 2 model 2 ZeRO-1, qwen2_moe dropless": (QWEN2_MOE, (), ("mesh.data=2", "mesh.expert=2",
                                                                                  "mesh.model=2",
                                                                                  "train.zero_stage=1"))}


def _same(name, table):
    """The layout against one device; its buffers overflowed nowhere (moe/overflow 0: the all-to-all path ran)."""
    base, model, layout = table[name]
    got = same_as_one_device(model, layout, base=tuple(base), router_scale=MODERATE, split="expert")
    assert [m["moe/overflow"] for m in got] == [0.0, 0.0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_one_device(name):
    _same(name, LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_more_layouts_equal_one_device(name):
    _same(name, SLOW)


@pytest.mark.slow
def test_the_exact_path_where_a_buffer_overflows_equals_one_device():
    """model.dispatch_factor=0.3: every layer's buffers overflow, every rank takes the exact path (moe/overflow 1,
    one device's 0); all else as one device's."""
    want, want_p, _, _ = _train(("model.dispatch_factor=0.3", "mesh.data=1"), base=tuple(MIXTRAL),
                                router_scale=MODERATE)
    got, got_p, over, _ = _train(("model.dispatch_factor=0.3",) + E2D4, base=tuple(MIXTRAL), router_scale=MODERATE)
    assert over == "expert"
    for g, w in zip(got, want):
        assert g["moe/overflow"] == 1.0 and w["moe/overflow"] == 0.0
        assert all(abs(g[k] - w[k]) <= 1e-5 * max(abs(w[k]), 1e-3) for k in w if k != "moe/overflow"), (g, w)
    for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p)):
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))


# ---- the dispatch's bytes

# 2 rows of 128 tokens per rank (N = 256, M = 512 choices): buffers of 2 x 512 / R rows per destination, 128 at R = 8
BYTES = ["model.family=mixtral", "model.n_experts=8", "model.n_experts_per_token=2", "model.expert_d_ff=32",
         "model.seq_len=128", "train.batch_size=16"]


def _dispatch(R: int, factor: float):
    """(the HLO's all-to-all and all-gather bytes over `expert` one device sends per step, the planner's
    all-to-all bytes, the plan) at expert degree R (data 8/R), model.dispatch_factor=factor."""
    from test_plan import _plan
    from trainer.plan.verify import measure
    cfg, plan = _plan(BYTES + [f"mesh.expert={R}", f"mesh.data={8 // R}", f"model.dispatch_factor={factor}"])
    m = measure(cfg, grads=False)
    hlo = {kind: sum(b for (k, axes), b in m.collectives.items() if k == kind and axes == ("expert",))
           for kind in ("all-to-all", "all-gather")}
    # the exact path's ring, apart (its named scope): collective-permutes over `expert` in the HLO too
    hlo["exact"] = sum(b for (k, axes), b in m.overflow.items() if k == "collective-permute" and axes == ("expert",))
    return hlo, sum(t.bytes for t in plan.transfers if t.kind == "all-to-all" and t.axis == "expert"), plan


@pytest.mark.slow  # three compiles; the default run holds the planner to the compiled step of experts over data
@pytest.mark.parametrize("R", [2, 4, 8])
def test_all_to_all_bytes_equal_the_planner_and_do_not_grow_with_the_degree(R):
    """Compiled on 8 CPU devices at degree R, 256 tokens per rank: the all-to-all bytes over `expert` equal the
    planner's (1%); the buffers a rank exchanges, (R / (R - 1)) x its sent bytes, are 2 x M x D each way whatever R
    (the bytes it sends grow only by (R - 1) / R, towards that bound); the exact path's collectives are listed
    apart."""
    hlo, planned, plan = _dispatch(R, 2.0)
    assert hlo["all-to-all"] > 0 and abs(planned - hlo["all-to-all"]) <= 0.01 * hlo["all-to-all"], (planned, hlo)
    D, L, M, a = 64, 2, 512, 4  # tiny: d_model 64, 2 layers; float32 on CPU
    # per layer: x and the outputs (D wide), the expert ids (int32) and weights, forward, and the backward's
    # transposes of x, the weights and the outputs
    buffers = L * 2 * M * (2 * D * a + 4 + a + 2 * D * a + a)
    assert abs(hlo["all-to-all"] * R / (R - 1) - buffers) <= 0.01 * buffers, (hlo, buffers)
    assert [t for t in plan.transfers if t.overflow] and plan.overflow_bytes > 0  # the exact path, listed apart
    assert hlo["exact"] > 0  # and counted apart in the HLO


@pytest.mark.slow  # the default layouts assert moe/overflow 0 too
def test_the_gathered_path_grows_with_the_degree_and_the_routing_overflows_nothing():
    """At degree 4, the gathered path's all-gathers (model.dispatch_factor=0) send at least (R - 1) x N x D per
    layer for the tokens alone, 3x degree 2's (the routed buffers: the test above, whatever R); the routing at these
    shapes (128 rows per destination at R = 8) overflows no buffer: moe/overflow 0 over two steps."""
    R = 4
    gathered, _, _ = _dispatch(R, 0.0)
    D, L, N, a = 64, 2, 256, 4
    assert gathered["all-to-all"] == 0 and gathered["all-gather"] >= (R - 1) * L * N * D * a, gathered
    metrics, _, _, _ = _train((f"mesh.expert={R}", f"mesh.data={8 // R}"), base=tuple(SGD + BYTES))
    assert [m["moe/overflow"] for m in metrics] == [0.0, 0.0]


# ---- checkpoints

def _setup(overrides):
    from meshes import devices_named
    from trainer.config import load_config
    from trainer.state import make_setup
    cfg = load_config(TINY + MIXTRAL + list(overrides))
    return make_setup(cfg, jax.devices()[:devices_named(cfg.mesh)])


@pytest.mark.slow
def test_checkpoints_restore_across_expert_degrees(tmp_path):
    """Saved after step 1 at expert degree 8 (one expert per rank), restored onto degree 4 (ZeRO-3, data 2), 2
    (data 4), back to 8 and onto one device without expert parallelism: the parameters and optimizer state equal
    the saved ones bit for bit, and after one more step equal an uninterrupted run on the target layout (1e-6)."""
    from test_moe_everywhere import Runner
    from trainer.ckpt.checkpoint import Checkpointer
    from test_expert_parallel import saved_after_one_step
    a = _setup(("mesh.data=1", "mesh.expert=8"))
    assert a.layout.rules["experts"] == "expert"
    _, saved = saved_after_one_step(a, tmp_path / "run")
    for layout in (("mesh.data=2", "mesh.expert=4", "train.zero_stage=3"), ("mesh.data=4", "mesh.expert=2"),
                   ("mesh.data=1", "mesh.expert=8"), ("mesh.data=1", "train.expert_parallel=false")):
        b = _setup(layout)
        c = Checkpointer(b, tmp_path / "run")
        restored, at = c.restore()
        c.close()
        assert at == 1 and all(np.array_equal(np.asarray(x), y) for x, y in zip(jax.tree.leaves(restored),
                                                                              jax.tree.leaves(saved))), layout
        run = Runner(b)
        got, _ = run(restored, 1, 2)
        want, _ = run(run(fresh_state(b), 0, 1)[0], 1, 2)  # uninterrupted on the target layout
        for x, y in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(want["params"])):
            x, y = np.asarray(x), np.asarray(y)
            assert np.max(np.abs(x - y)) <= 1e-6 * max(np.max(np.abs(y)), 1e-3), layout


def test_bad_input_is_one_line():
    from trainer.config import load_config, validate
    from trainer.errors import UserError
    for keys, message in [
        (["mesh.data=2", "mesh.expert=4", "model.n_experts=6"],
         r"^mesh.expert=4: model.n_experts=6 is not divisible by mesh.expert=4 \(each expert rank holds n_experts / "
         r"mesh.expert experts\); set mesh.expert to a divisor of model.n_experts, or 1$"),
        (["mesh.data=2", "mesh.expert=4", "train.expert_parallel=false"],
         r"^train.expert_parallel=false with mesh.expert=4, which splits the experts; set mesh.expert=1"),
        (["mesh.data=2", "mesh.expert=4", "train.batch_size=4"],
         r"^train.batch_size=4 is not divisible by mesh.data x mesh.expert x train.microbatches = 8 x 1"),
    ]:
        with pytest.raises(UserError, match=message):
            validate(load_config(TINY + MIXTRAL + keys), 8)
    with pytest.raises(UserError, match=r"^mesh.expert=2: the model has no experts; set mesh.expert to a divisor"):
        validate(load_config(TINY + ["mesh.data=4", "mesh.expert=2"]), 8)
