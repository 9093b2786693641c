"""Pipeline parallelism over `stage` trains exactly like one device; schedule length, bubble, memory;
checkpoints move between schedules."""
import jax
import numpy as np
import pytest

from conftest import SGD, TINY, fresh_state, max_rel, run_steps, single_device
from test_dpo import synth  # noqa: F401 (the fixture: prepared pairs and a reference)
from trainer.ckpt.checkpoint import Checkpointer
from trainer.ckpt.store import list_steps
from trainer.config import load_config
from trainer.parallel.schedules import describe
from trainer.parallel.schedules import build, idle_fraction
from trainer.state import make_setup
from trainer.step import jit_train_step

EIGHT = ["model.n_layers=8", "train.lr=3e-3"]
ADAMW = []  # the default optimizer, with clipping
# SGD without clipping where a wrong gradient scale must show; AdamW where its sharded moments do
LAYOUTS = [
    ("1,2,1", SGD + ["mesh.data=1", "mesh.stage=2", "train.microbatches=4"]),
    ("1,4,1", SGD + ["mesh.data=1", "mesh.stage=4", "train.microbatches=4"]),
    ("1,8,1", SGD + ["mesh.data=1", "mesh.stage=8", "train.microbatches=8"]),
    ("2,2,2", ADAMW + ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.zero_stage=1", "train.microbatches=2"]),
    ("4,2,1", ADAMW + ["mesh.data=4", "mesh.stage=2", "train.zero_stage=3", "train.microbatches=2"]),
    ("1,4,1", SGD + ["mesh.data=1", "mesh.stage=4", "train.microbatches=4", "train.pipeline_repeats=2"]),
    ("1,4,1", SGD + ["mesh.data=1", "mesh.stage=4", "train.microbatches=4", "train.pipeline_schedule=1f1b"]),
    ("1,4,1", SGD + ["mesh.data=1", "mesh.stage=4", "train.microbatches=8", "train.pipeline_schedule=1f1b"]),
    ("2,2,2", SGD + ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.zero_stage=1", "train.microbatches=2",
                     "train.pipeline_schedule=1f1b"]),
    ("1,2,1", SGD + ["mesh.data=1", "mesh.stage=2", "train.microbatches=4", "train.pipeline_repeats=2",
                     "train.pipeline_schedule=interleaved_1f1b"]),
    # the stage body (two layers) with each layer half recomputed in the backward tick
    ("1,4,1", SGD + ["mesh.data=1", "mesh.stage=4", "train.microbatches=4", "train.pipeline_schedule=1f1b",
                     "model.remat=sublayer"]),
    # the vocabulary split over model 4: stage 0's embedding gathers its shard inside the tick's branch
    ("1,2,4", SGD + ["mesh.data=1", "mesh.stage=2", "mesh.model=4", "train.zero_stage=3", "train.microbatches=2",
                     "train.pipeline_repeats=2", "train.pipeline_schedule=interleaved_1f1b"]),
]


def _close(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


# behind -m slow (keeps the default run short): GPipe at S=2 and S=8, on (2,2,2) with ZeRO-1, ZeRO-3 over
# (4,2,1), circular GPipe at S=4, 1F1B at M=4, M=8 and on (2,2,2), interleaved 1F1B on (1,2,1) and (1,2,4) (one executor
# runs every schedule); the default run keeps GPipe at S=4 and 1F1B with sub-layer remat
# (tests/test_pipeline_sync.py: ZeRO-3 and ring sync over pipelines; tests/test_tiled_loss.py: (2,2,2);
# tests/test_loss_mean.py: interleaved 1F1B on (2,2,2) with uneven loss weights;
# test_circular_checkpoint_restores_onto_any_schedule: circular GPipe at V=2 and V=4 against data parallelism)
SLOW = {0, 2, 3, 4, 5, 6, 7, 8, 9, 11}
CASES = [pytest.param(n, ov, marks=[pytest.mark.slow] if i in SLOW else [],
                      id="-".join(o for o in ov if not o.startswith("train.grad_clip")))
         for i, (n, ov) in enumerate(LAYOUTS)]


def assert_matches_single_device(name, over):
    """3 steps on mesh `name` ("d,s,m"): losses, grad_norm and parameters within 1e-5 of one device's."""
    ref_losses, ref_params, ref_norms = single_device(over)
    r = run_steps(over)
    assert tuple(r.setup.mesh.shape[a] for a in ("data", "stage", "model")) == tuple(int(x) for x in name.split(","))
    assert _close(r.losses, ref_losses) < 1e-5, (r.losses, ref_losses)
    assert _close(r.grad_norms, ref_norms) < 1e-5, (r.grad_norms, ref_norms)
    assert max_rel(r.params, ref_params) < 1e-5
    assert ref_losses[-1] != ref_losses[0]  # the parameters moved


@pytest.mark.parametrize("name,overrides", CASES)
def test_pipeline_matches_single_device(name, overrides):
    assert_matches_single_device(name, EIGHT + overrides)


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


def _simulated_schedule(S, M, V):
    """(ticks, idle stage-ticks) of an event simulation of the circular schedule, independent of
    pipeline.py: microbatch m passes stages 0..S-1 V times in a row, one stage per tick, and may
    enter the next stage the tick after it left the last; each stage runs one waiting item per
    tick, earlier repeats first."""
    waiting = {(0, m): 0 for m in range(M)}  # (hop, microbatch) -> first tick it may run
    busy, t = [0] * S, 0
    while waiting:
        for s in range(S):
            ready = [(h // S, m, h) for (h, m), at in waiting.items() if h % S == s and at <= t]
            if ready:
                _, m, h = min(ready)
                del waiting[h, m]
                busy[s] += 1
                if h + 1 < S * V:
                    waiting[h + 1, m] = t + 1
        t += 1
    assert busy == [M * V] * S
    return t, S * t - sum(busy)


@pytest.mark.parametrize("S,M,V", [(2, 4, 1), (4, 4, 1), (4, 4, 2), (2, 6, 2)])
def test_schedule_length_and_bubble_match_a_simulation(S, M, V):
    cfg = load_config(TINY + EIGHT + ["mesh.data=1", f"mesh.stage={S}", f"train.microbatches={M}",
                                      f"train.pipeline_repeats={V}", "train.batch_size=24"])
    s = make_setup(cfg, jax.devices()[:S])
    batch = s.abstract_batch(24)
    with jax.set_mesh(s.mesh):
        jaxpr = jax.make_jaxpr(lambda st, b: jit_train_step(s)(st, b))(s.shapes, batch).jaxpr
    ticks, idle = _simulated_schedule(S, M, V)
    # the program's tick scan: the forward's ticks, then as many for the backward (GPipe's table)
    assert 2 * ticks in _scan_lengths(jaxpr), (ticks, _scan_lengths(jaxpr))
    table = build("gpipe", S, M, V)
    assert len(table) == 2 * ticks
    frac = idle_fraction(table)
    assert frac == pytest.approx(idle / (S * ticks), rel=1e-12)
    assert f"bubble {100 * frac:.1f}%" in describe(S, M, V)


def test_circular_schedule_shrinks_bubble():
    (t1, idle1), (t2, idle2) = _simulated_schedule(4, 8, 1), _simulated_schedule(4, 8, 2)
    assert idle2 / t2 < idle1 / t1
    assert idle_fraction(build("gpipe", 4, 8, 2)) < idle_fraction(build("gpipe", 4, 8, 1))


@pytest.mark.parametrize("S,V", [(4, 2), (2, 3), (4, 3)])
def test_circular_blocks_give_stage_s_blocks_s_plus_multiples_of_S(S, V):
    """Stored (L, ...) in contiguous stage slices -> stage s runs blocks s, s+S, ...; gradients go back."""
    from jax.sharding import PartitionSpec as P
    from meshes import build_mesh
    from trainer.parallel.circular import circular_blocks
    L, blk = 2 * S * V, 2
    mesh = build_mesh(jax.devices()[:S], data=1, stage=S)
    f = jax.jit(jax.shard_map(lambda w: circular_blocks(w, S, V), mesh=mesh, in_specs=P("stage"),
                              out_specs=P("stage"), axis_names={"stage"}, check_vma=False))
    w = np.arange(L * 3, dtype=np.float32).reshape(L, 3)
    coef = np.random.default_rng(0).normal(size=(S, V, blk, 3)).astype(np.float32)
    got = np.asarray(f(w)).reshape(S, V, blk, 3)
    grad = np.asarray(jax.grad(lambda w: (f(w).reshape(S, V, blk, 3) * coef).sum())(w)).reshape(S * V, blk, 3)
    blocks = w.reshape(S * V, blk, 3)
    for s in range(S):
        for u in range(V):
            assert np.array_equal(got[s, u], blocks[s + u * S]), (s, u)
            assert np.array_equal(grad[s + u * S], coef[s, u]), (s, u)


def _arg_bytes(overrides, n):
    s = make_setup(load_config(TINY + EIGHT + overrides), jax.devices()[:n])
    batch = s.abstract_batch(16)
    with jax.set_mesh(s.mesh):
        c = jit_train_step(s).lower(s.shapes, batch).compile()
    layers = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s.shapes["params"]["layers"]))
    return c.memory_analysis().argument_size_in_bytes, layers, s


@pytest.mark.slow
def test_stage_holds_a_quarter_of_the_layer_stack():
    one, layers, _ = _arg_bytes(["mesh.data=1", "train.microbatches=4"], 1)
    four, _, s = _arg_bytes(["mesh.data=1", "mesh.stage=4", "train.microbatches=4"], 4)
    # parameters, Adam mu and nu of the layer stack: each device keeps 1/4 of all three
    assert one - four == 3 * layers * 3 // 4
    st = fresh_state(s)
    for leaf in jax.tree.leaves(st["params"]["layers"]):
        assert leaf.addressable_shards[0].data.size * 4 == leaf.size


def _bitwise_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    return all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y, equal_nan=True)
               for x, y in zip(map(np.asarray, la), map(np.asarray, lb)))


def _circular_run(tmp_path):
    """A circular (S=2, V=2) run of 2 steps through the train API: (run dir, its base overrides, its state)."""
    from trainer.run.loop import train
    run = tmp_path / "run"
    base = TINY + EIGHT + ["train.microbatches=4", "train.eval_every=0", f"run.dir={run}"]
    r = train(load_config(base + ["mesh.data=1", "mesh.stage=2", "train.pipeline_repeats=2", "train.steps=2"]),
              jax.devices()[:2])
    assert list_steps(run) == [2]
    return run, base, jax.tree.map(np.asarray, r.state)


CIRCULAR_TARGETS = (["mesh.data=2", "mesh.stage=1"], ["mesh.data=1", "mesh.stage=2", "train.pipeline_repeats=4"])


@pytest.mark.slow  # the default run restores onto other meshes in tests/test_checkpoint.py
def test_circular_checkpoint_restores_onto_any_schedule(tmp_path):
    """A circular (S=2, V=2) checkpoint restores bit for bit as plain data parallel and as circular V=4."""
    run, base, saved = _circular_run(tmp_path)
    for over in CIRCULAR_TARGETS:
        c = Checkpointer(make_setup(load_config(base + over + ["train.steps=3"]), jax.devices()[:2]), run)
        state, at = c.restore()
        c.close()
        assert at == 2 and _bitwise_equal(state, saved), over


@pytest.mark.slow  # two more compiles; the default run restores without stepping
def test_circular_checkpoint_trains_on_the_same_way_on_any_schedule(tmp_path):
    """One more step after restoring the circular checkpoint agrees between data parallel and circular V=4."""
    from conftest import corpus
    from trainer.data.batches import Batches
    run, base, saved = _circular_run(tmp_path)
    after = []
    for over in CIRCULAR_TARGETS:
        s = make_setup(load_config(base + over + ["train.steps=3"]), jax.devices()[:2])
        c = Checkpointer(s, run)
        state, at = c.restore()
        c.close()
        b = Batches(corpus(), s.cfg.train.seed, 16, s.model.seq_len, s.model.vocab_size)
        with jax.set_mesh(s.mesh):
            state, m = jit_train_step(s)(state, jax.device_put(b.global_train(2), s.batch_sharding()))
        after.append((float(m["loss"]), float(m["grad_norm"]), jax.tree.map(np.asarray, state["params"])))
    (loss_dp, norm_dp, p_dp), (loss_v4, norm_v4, p_v4) = after
    assert np.isfinite(loss_dp) and abs(loss_v4 - loss_dp) / abs(loss_dp) < 1e-5, (loss_v4, loss_dp)
    assert abs(norm_v4 - norm_dp) / norm_dp < 1e-5, (norm_v4, norm_dp)
    assert max_rel(p_v4, p_dp) < 1e-5 and max_rel(p_dp, saved["params"]) > 0


def _temp_bytes(overrides):
    s = make_setup(load_config(TINY + overrides), jax.devices()[:4])
    batch = s.abstract_batch()
    with jax.set_mesh(s.mesh):
        return jit_train_step(s).lower(s.shapes, batch).compile().memory_analysis().temp_size_in_bytes


# one layer per stage whose backward's working set (~11 stage boundaries of 2 MiB: short sequences,
# 4 query heads on 1 kv head, a narrow MLP) is small beside the 2M boundaries GPipe stores: the stage
# inputs dominate. With d_ff = d_model and 4 kv heads that backward is ~19 boundaries.
PIPE_MEMORY = ["mesh.data=1", "mesh.stage=4", "train.microbatches=16", "model.n_layers=4", "model.seq_len=16",
               "model.d_model=256", "model.d_ff=64", "model.n_heads=4", "model.n_kv_heads=1", "train.batch_size=2048"]


def _planned_temp(overrides):
    """The planner's scratch for the step: activations, gradients and buffers."""
    from trainer.config import model_config
    from trainer.plan.core import estimate, strategy_of
    from trainer.hardware import get_device
    cfg = load_config(TINY + overrides)
    p = estimate(model_config(cfg), cfg.train, strategy_of(cfg, 4), get_device("h100-80g"), 1, "float32")
    return p.activations_bytes + p.grads_bytes + p.buffers_bytes


# model.remat=sublayer recomputes each layer half on its own in the backward, so one tick's working
# set holds one half's internals; XLA's attention (the manual one's backward holds ~2 boundaries more)
SUBLAYER = ["model.remat=sublayer", "model.attention=xla"]


@pytest.mark.slow  # two compiles of (1,4,1); the planner's pipeline memory model runs by default (tests/test_plan.py)
@pytest.mark.parametrize("extra, ratio", [([], 0.45), (SUBLAYER, 0.40)], ids=["none", "sublayer"])
def test_1f1b_needs_far_less_scratch_than_gpipe(extra, ratio):
    """S=4, M=16, one layer per stage, 2 MiB stage boundaries: GPipe keeps every microbatch's stage
    input and loss gradient until the backward (2M boundaries), 1F1B at most S inputs and one
    cotangent; the rest, one tick's working set, is the same for both. The planner predicts both
    within 10%.

    That working set is ~20 boundaries with remat=none (S inputs and a cotangent, the tick's input,
    cotangent and output, one layer's backward), so 1F1B's scratch is 0.43 of GPipe's, not S/M: <= 0.4
    needs a leaner backward than a whole layer's. With sublayer remat (one half's backward) it is 0.38."""
    S, M, n = 4, 16, 2 * 2**20  # n: one stage boundary, (b, T, D) float32
    over = PIPE_MEMORY + extra
    temp = {k: _temp_bytes(over + [f"train.pipeline_schedule={k}"]) for k in ("gpipe", "1f1b")}
    # the difference is the stored boundaries, 2M - S - 1 = 27, and nothing else (measured: 54.0 MiB
    # with remat=none, 56.0 MiB with sublayer)
    assert (2 * M - S - 1) * n <= temp["gpipe"] - temp["1f1b"] <= (2 * M - S) * n, temp
    # measured: none 40.3 MiB vs 94.3 MiB (0.427); sublayer 34.8 MiB vs 90.8 MiB (0.383)
    assert temp["1f1b"] <= ratio * temp["gpipe"], temp
    for k, xla in temp.items():  # measured: none +2.6% (GPipe), +6.0% (1F1B); sublayer +0.1%, +5.9%
        assert abs(_planned_temp(over + [f"train.pipeline_schedule={k}"]) / xla - 1) < 0.10, k


def _flops(overrides, n):
    s = make_setup(load_config(TINY + overrides), jax.devices()[:n])
    batch = s.abstract_batch()
    with jax.set_mesh(s.mesh):
        return jit_train_step(s).lower(s.shapes, batch).compile().cost_analysis()["flops"]


def _xla_counts_loop_bodies_once():
    """What cost_analysis does with loops and conditionals: a scan of 10 matmuls counts as one
    matmul (the body once, not per trip), a switch among 0, 1 and 2 matmuls as 2 (its costliest branch)."""
    import jax.numpy as jnp
    x = jnp.ones((64, 64))
    cost = lambda f, *a: jax.jit(f).lower(*a).compile().cost_analysis()["flops"]  # noqa: E731
    one = cost(lambda a: a @ a, x)
    ten = cost(lambda a: jax.lax.scan(lambda c, _: (c @ c, None), a, None, length=10)[0], x)
    pick = cost(lambda i, a: jax.lax.switch(i, [lambda c: c, lambda c: c @ c, lambda c: c @ c @ c], a), 0, x)
    return ten == pytest.approx(one, rel=1e-3) and pick == pytest.approx(2 * one, rel=1e-3)  # + index arithmetic


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def test_head_flops_once_per_step_not_once_per_stage(schedule):
    """Vocabulary 32k, S=4: the FLOPs that grow with the vocabulary (embedding, head and loss,
    forward and backward), per device as cost_analysis counts them. One device without
    microbatches: the head of the whole batch. The pipeline: XLA counts the tick loop's body
    once, so its figure is the head of one microbatch (1/M of the batch), in the step the table
    runs on the last stage only, M times: the head runs once per step. Measured before: 2.0x
    that, both from the head replicated over `stage` outside the loop (GPipe; XLA splits it only
    in part) and from a one-hot embedding matmul on stage 0 as costly as the head (1F1B)."""
    if not _xla_counts_loop_bodies_once():
        pytest.skip("this XLA's cost_analysis counts loop trips; the figures below assume it does not")
    from trainer.parallel.schedules import FWD_LOSS, build, plan
    S, M = 4, 4
    base = SGD + ["mesh.data=1", "model.n_layers=4", "model.loss_chunk=0"]

    def vocab_flops(over, n):
        return _flops(base + over + ["model.vocab_size=32768"], n) - _flops(base + over + ["model.vocab_size=16384"], n)

    whole = vocab_flops(["mesh.stage=1", "train.microbatches=1"], 1)
    tokens, d = 16 * 32, 64  # TINY: batch 16, seq_len 32, d_model 64
    assert whole == pytest.approx(6 * tokens * d * 16384, rel=0.1)  # 2*N*D*V forward, twice that backward
    piped = vocab_flops([f"mesh.stage={S}", f"train.microbatches={M}", f"train.pipeline_schedule={schedule}"], S)
    assert 0.9 * whole / M <= piped <= 1.2 * whole / M, (piped, whole / M)  # measured 1.04
    loss_ticks = (plan(build(schedule, S, M)).branch == FWD_LOSS).sum(axis=0)
    assert loss_ticks.tolist() == [0] * (S - 1) + [M]


def embedding_ops(text: str) -> set[str]:
    """The HLO ops that the pipeline's embedding of a microbatch (trainer/parallel/pipeline.py embed_microbatch)
    compiled to, from the stack frame of each op."""
    import re

    from trainer.plan.hlo import _frame_functions
    frames = _frame_functions(text)
    ops = set()
    for line in text.splitlines():
        f = re.search(r"stack_frame_id=(\d+)", line)
        op = re.search(r"=\s*\S+\s+([a-z][\w\-]*)\(", line)
        if f and op and "embed_microbatch" in frames.get(int(f.group(1)), ()):
            ops.add(op.group(1))
    return ops


def test_eval_runs_through_the_stages_and_equals_one_device():
    """The eval step on (2,2,2) 1F1B ZeRO-3: loss sum and counted tokens of a held-out batch equal one device's
    (1e-5), and in its compiled program nothing crosses `stage` but the forward's hops, counted by hand: each of the
    M + S - 1 ticks of GPipe's forwards, stages 0..S-2 send one microbatch's activations (B/(M x data) rows x T x D,
    float32; (S-1)/S of that on average over the devices), and the sums' scalars. The unpipelined eval it replaces
    moved the stack's weights over `stage` (all-reduces of 297 kB, collective-permutes of 111 kB a device here).
    Stage 0 embeds by a gather of its vocabulary shard (no one-hot matmul)."""
    from conftest import corpus
    from meshes import devices_named
    from trainer.data.batches import Batches
    from trainer.plan.hlo import collective_ops
    from trainer.step import jit_eval_step
    S, M, data = 2, 2, 2
    out = []
    for keys in ([f"mesh.data={data}", f"mesh.stage={S}", "mesh.model=2", f"train.microbatches={M}",
                  "train.zero_stage=3", "train.pipeline_schedule=1f1b"], ["mesh.data=1"]):
        cfg = load_config(TINY + SGD + ["model.n_layers=2", *keys])
        s = make_setup(cfg, jax.devices()[:devices_named(cfg.mesh)])
        b = Batches(corpus(), cfg.train.seed, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size,
                    evaluates=True)
        with jax.set_mesh(s.mesh):
            params, batch = fresh_state(s)["params"], jax.device_put(b.eval(0), s.batch_sharding())
            step = jit_eval_step(s)
            out.append([float(x) for x in step(params, batch)])
            text = step.lower(params, batch).compile().as_text()
        if len(out) == 1:
            ops = collective_ops(text, dict(s.mesh.shape), loop_trips={"eval_loss_step": 1.0})
            B, T, D = cfg.train.batch_size, s.model.seq_len, s.model.d_model
            hops = sum(b for kind, axes, b, _ in ops if axes == ("stage",) and kind == "collective-permute")
            assert hops == (M + S - 1) * (B // (M * data)) * T * D * 4 * (S - 1) / S, hops
            rest = [(kind, axes, b) for kind, axes, b, _ in ops if "stage" in axes and kind != "collective-permute"]
            assert sum(b for *_, b in rest) <= 64, rest
            emb = embedding_ops(text)  # the vocabulary split over model: stage 0 gathers its shard, no matmul
            assert "gather" in emb and not emb & {"dot", "convolution"}, emb
    (got, n_got), (want, n_want) = out
    assert n_got == n_want > 0 and abs(got - want) <= 1e-5 * abs(want), (got, want)



@pytest.mark.slow  # two DPO runs on a prepared pair file
def test_dpo_eval_runs_through_the_stages_and_equals_one_device(synth, tmp_path):
    """train.objective=dpo on (2,4,1) 1F1B, evaluated after 3 SGD steps: eval_loss and each eval metric over the
    held-out pairs equal one device's (1e-5); the pipeline's eval step sums the pairs' statistics on its last stage."""
    from test_dpo import _keys
    from trainer.run.loop import train
    evals = []
    for n, mesh in ((8, ["mesh.data=2", "mesh.stage=4", "train.pipeline_schedule=1f1b", "train.microbatches=4"]),
                    (1, ["mesh.data=1"])):
        keys = _keys(synth, tmp_path / str(n), mesh + ["train.eval_every=3", "train.eval_batches=2"])
        r = train(load_config(keys), jax.devices()[:n])
        evals.append([h for h in r.history if "eval_loss" in h][-1])
    got, want = evals
    names = [k for k in want if k.startswith("eval_") and k != "eval_pairs"]
    assert got["eval_pairs"] == want["eval_pairs"] > 0 and "eval_rewards/accuracies" in names, want
    for k in names:
        assert abs(got[k] - want[k]) <= 1e-5 * max(abs(want[k]), 1e-3), (k, got[k], want[k])
