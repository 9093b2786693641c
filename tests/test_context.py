"""Context parallelism (mesh.context: each row's tokens split over a fourth mesh axis; models/context_parallel/gather.py): the
all-gather attention over 4 devices against attention written out here on whole rows (output and q, k, v
gradients), balanced and not, with documents across the chunks; training against one device on asymmetric meshes
(SGD, no clipping; loss, grad_norm, parameters, 1e-5); one-line refusals."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import SGD, TINY, fresh_state, max_rel, prepare_documents, run_steps

SLOW = pytest.mark.slow
B, T, H, K, E = 2, 32, 4, 2, 8
# three documents per row, their boundaries inside chunks (8 tokens each over 4 ranks, 4 balanced), then padding
SEGMENTS = np.array([[1] * 5 + [2] * 13 + [3] * 11 + [0] * 3, [1] * 19 + [2] * 12 + [3] * 1], np.float32)


def by_hand(q, k, v, segments=None, window=None, softcap=None, scale=None):
    """Causal grouped-query attention on whole rows, written out: each query against the keys at or before it
    (fewer than `window` before it; in its document), scores scaled (1/sqrt(E) unless given) and soft-capped
    (softcap * tanh(s / softcap)), softmax in float32."""
    kk, vv = (jnp.repeat(a, H // K, axis=2) for a in (k, v))
    s = jnp.einsum("bthe,bshe->bhts", q, kk) * (1 / np.sqrt(E) if scale is None else scale)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    ahead = np.arange(T)[:, None] - np.arange(T)[None, :]
    keep = ((ahead >= 0) & (ahead < (window or T)))[None, None]
    if segments is not None:
        keep = keep & (segments[:, None, :, None] == segments[:, None, None, :])
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshe->bthe", p, vv)


# the ring and the all-gather attend with models/kernels/flash_blocks.py whatever the kernel's implementation (they read
# the kernel's window and block only): their "xla" cases run the "manual" ones' program, so they run under -m slow
@pytest.mark.parametrize("strategy,impl", [(s, i) if (s, i) == ("all_to_all", "xla") or i == "manual" else
                                           pytest.param(s, i, marks=SLOW)
                                           for i in ("manual", "xla") for s in ("all_gather", "all_to_all", "ring")])
@pytest.mark.parametrize("balance,documents,window", [(True, False, None), (False, False, None), (True, True, None),
                                                      (False, True, None), (True, True, 6)])
def test_context_attention_equals_attention_on_whole_rows(strategy, impl, balance, documents, window):
    """4 context ranks, each row reordered as the step does (balanced: rank i holds chunks i and 7-i of 8): the
    output and the q, k, v gradients of a random cotangent, put back in order, equal whole-row attention's
    (float32, 1e-5), with documents and with a sliding window too; all_gather gathers the keys (an all-gather over
    `context` in the program), all_to_all sends each rank's chunk of every head group to its rank (2 kv heads
    repeated to 4 for 4 ranks)."""
    _equals_whole_rows(strategy, impl, balance, SEGMENTS if documents else None, window)


# a chunk (4 tokens, balanced over 4 ranks) holding three documents: row 0's second chunk (tokens 4-7: documents 2, 3
# and 4), row 1's first (7, 8 and 9)
ODD = np.array([[1] * 3 + [2] * 2 + [3] * 2 + [4] * 9 + [5] * 7 + [6] * 5 + [0] * 4, [7] * 2 + [8] + [9] * 29],
               np.float32)


@pytest.mark.parametrize("strategy", ["all_gather", "all_to_all", "ring"])
def test_softcap_scale_and_three_documents_in_a_chunk_equal_whole_rows(strategy):
    """Gemma's soft-cap and a score scale of the family's own (the ring's soft-cap branch: its first test), with
    a window and chunks holding three documents each, balanced over 4 ranks: output and gradients as above."""
    _equals_whole_rows(strategy, "manual", True, ODD, 12, softcap=2.0, scale=0.4)


def _equals_whole_rows(strategy, impl, balance, segments, window, softcap=None, scale=None):
    from meshes import RULES, Collectives, build_mesh
    from models.kernels.attention import attention
    from models.context_parallel.gather import ContextPlan, order
    mesh = build_mesh(jax.devices()[:4], data=1, context=4)
    rules = RULES.replace(seq="context")
    coll = Collectives(rules, mesh)
    perm = order(T, 4, balance)
    assert sorted(perm) == list(range(T)) and (list(perm) != list(range(T))) == balance
    plan = ContextPlan(4, strategy, tuple(int(i) for i in perm))
    kernel = functools.partial(attention, impl=impl, block=4, platform="cpu", window=window)
    rng = np.random.default_rng(0)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
                   ((B, T, H, E), (B, T, K, E), (B, T, K, E), (B, T, H, E)))
    seg = None if segments is None else jnp.asarray(segments)
    options = {k: x for k, x in (("softcap", softcap), ("scale", scale)) if x is not None}
    split = NamedSharding(mesh, P(None, "context"))

    def chunked(q, k, v):
        pos = plan.positions(coll, T)
        args = [jax.lax.with_sharding_constraint(a[:, perm], split) for a in (q, k, v)]
        s = None if seg is None else jax.lax.with_sharding_constraint(seg[:, perm], split)
        o = plan.attention(kernel, coll, pos)(*args, segments=s, **options)
        return jnp.zeros_like(o).at[:, perm].set(o)  # back in row order

    def loss(f, q, k, v):
        return jnp.sum(f(q, k, v) * ct)

    with jax.set_mesh(mesh):
        got = jax.jit(chunked)(q, k, v)
        got_g = jax.jit(jax.grad(functools.partial(loss, chunked), argnums=(0, 1, 2)))(q, k, v)
        hlo = jax.jit(chunked).lower(q, k, v).compile().as_text()
    want = by_hand(q, k, v, seg, window, softcap, scale)
    want_g = jax.grad(functools.partial(loss, lambda *a: by_hand(*a, seg, window, softcap, scale)),
                      argnums=(0, 1, 2))(q, k, v)
    valid = np.ones((B, T), bool) if seg is None else segments > 0  # a padding query's output is never used
    assert float(jnp.abs(got - want)[valid].max()) < 1e-5 * float(jnp.abs(want).max())
    for name, a, b in zip("qkv", got_g, want_g):
        a, b = (x if name != "q" else x[valid] for x in (a, b))
        assert float(jnp.abs(a - b).max()) < 1e-5 * float(jnp.abs(b).max()), name
    assert {"all_gather": "all-gather", "all_to_all": "all-to-all", "ring": "collective-permute"}[strategy] in hlo


# the default run keeps one layout per strategy: all_gather (the default strategy) on (data 2, context 4), balanced,
# runs in test_packed_documents_equal_one_device[all_gather] with document masks (d2c4 here is that path without them:
# -m slow), all_to_all with ZeRO-3 and the ring over 8 here
LAYOUTS = {
    "d2c4": (["mesh.data=2", "mesh.context=4"], SLOW),
    "c2m4": (["mesh.data=1", "mesh.context=2", "mesh.model=4", "model.n_kv_heads=4"], SLOW),
    "c2s2-1f1b": (["mesh.data=1", "mesh.context=2", "mesh.stage=2", "mesh.model=2", "train.microbatches=2",
                   "train.pipeline_schedule=1f1b"], SLOW),
    "d2c2m2-zero3": (["mesh.data=2", "mesh.context=2", "mesh.model=2", "train.zero_stage=3"], SLOW),
    "d2c4-psum-m2": (["mesh.data=2", "mesh.context=4", "train.grad_sync=psum", "train.microbatches=2"], SLOW),
    "d2c4-unbalanced": (["mesh.data=2", "mesh.context=4", "train.context_load_balance=false"], SLOW),
    "d2c4-ring-zero1": (["mesh.data=2", "mesh.context=4", "train.grad_sync=ring", "train.zero_stage=1"], SLOW),
    "c2m4-all_to_all": (["mesh.data=1", "mesh.context=2", "mesh.model=4", "train.context_attention=all_to_all"],
                        SLOW),
    "d2c4-all_to_all-zero3": (["mesh.data=2", "mesh.context=4", "train.context_attention=all_to_all",
                               "train.zero_stage=3"], ()),
    "c8-ring": (["mesh.data=1", "mesh.context=8", "train.context_attention=ring"], ()),
    # a stack whose layers differ in window (Gemma 2's local and global layers) traces the window: the ring took it as
    # a static option of its custom VJP and failed to trace
    "c4-gemma2-ring": (["mesh.data=1", "mesh.context=4", "train.context_attention=ring", "model.family=gemma2",
                        "model.window=8", "model.local_layers=[true,false]", "model.attn_softcap=5.0",
                        "model.final_softcap=8.0", "model.query_scale=32"], ()),
    "c4s2-1f1b-ring": (["mesh.data=1", "mesh.context=4", "mesh.stage=2", "train.microbatches=2",
                        "train.pipeline_schedule=1f1b", "train.context_attention=ring"], SLOW),
    "d2c2m2-ring-zero3-full": (["mesh.data=2", "mesh.context=2", "mesh.model=2", "train.zero_stage=3",
                                "model.remat=full", "train.context_attention=ring"], SLOW),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, (_, m) in LAYOUTS.items()])
def test_layouts_equal_one_device(name):
    """3 SGD steps at T=32: losses, gradient norms and parameters within 1e-5 of one device's; the mesh is the
    one asked for (a swap of axes would show)."""
    keys = LAYOUTS[name][0] + SGD + ["model.seq_len=32"]
    model = [k for k in keys if k.startswith("model.")]
    got = run_steps(keys)
    ref = run_steps(SGD + model + ["mesh.data=1"], 1)
    sizes = {k.split("=")[0][5:]: int(k.split("=")[1]) for k in keys if k.startswith("mesh.")}
    assert {a: got.setup.mesh.shape[a] for a in sizes} == sizes and got.setup.mesh.shape["context"] > 1
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5)
    np.testing.assert_allclose(got.grad_norms, ref.grad_norms, rtol=1e-5)
    assert max_rel(got.params, ref.params) < 1e-5
    assert ref.losses[-1] < ref.losses[0]


@pytest.mark.slow
def test_bfloat16_with_remat_equals_one_device_in_bfloat16():
    """bfloat16 compute (float32 weights), remat dots, (data 2, context 2, model 2): within bfloat16's rounding of the
    one-device bfloat16 run (loss 1e-3, gradient norm and parameters 1e-2)."""
    keys = SGD + ["model.seq_len=32", "train.dtype=bfloat16", "model.remat=dots"]
    got = run_steps(keys + ["mesh.data=2", "mesh.context=2", "mesh.model=2"])
    ref = run_steps(keys + ["mesh.data=1"], 1)
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-3)
    np.testing.assert_allclose(got.grad_norms, ref.grad_norms, rtol=1e-2)
    assert max_rel(got.params, ref.params) < 1e-2


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare_documents(tmp_path_factory.mktemp("docs"))


@pytest.mark.parametrize("strategy", ["all_gather", pytest.param("all_to_all", marks=SLOW),
                                      pytest.param("ring", marks=SLOW)])
def test_packed_documents_equal_one_device(prepared, strategy):
    """data.document_mask=true on prepared documents (boundaries anywhere in the chunks), (data 2, context 4)
    balanced, each strategy: equal to one device; without the mask the losses differ (the mask is exercised)."""
    keys = ["model.vocab_size=320", "data.document_mask=true", "model.seq_len=64"] + SGD
    got = run_steps(keys + ["mesh.data=2", "mesh.context=4", f"train.context_attention={strategy}"], source=prepared)
    ref = run_steps(keys + ["mesh.data=1"], 1, source=prepared)
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5)
    np.testing.assert_allclose(got.grad_norms, ref.grad_norms, rtol=1e-5)
    assert max_rel(got.params, ref.params) < 1e-5
    off = run_steps([k for k in keys if k != "data.document_mask=true"] + ["mesh.data=1"], 1, source=prepared)
    assert np.abs(off.losses - ref.losses).max() > 1e-4 * ref.losses.max(), (off.losses, ref.losses)


BAD = [
    (["mesh.context=4", "model.seq_len=36"], r"^model.seq_len=36 is not divisible by 2 x mesh.context = 8 \(load "
     r"balancing gives each rank 2 of 8 chunks; or set train.context_load_balance=false\); use a multiple of 8$"),
    (["mesh.context=4", "model.seq_len=34", "train.context_load_balance=false"],
     r"^model.seq_len=34 is not divisible by mesh.context = 4; use a multiple of 4$"),
    (["mesh.context=2", "mesh.data=4", "train.sync=local_sgd", "train.sync_every=2"],
     r"^train.sync=local_sgd with mesh.context=2 is not supported: local SGD keeps a replica per data rank"),
    (["mesh.context=2", "model.family=mixtral", "model.n_experts=4", "model.n_experts_per_token=2",
      "model.capacity_factor=1.25"], r"^model.capacity_factor=1.25 with mesh.context=2 is not supported yet"),
    (["mesh.context=3", "mesh.stage=2", "mesh.data=1", "model.seq_len=36", "train.microbatches=2",
      "train.context_attention=ring"], r"^train.context_attention=ring with mesh.stage=2 needs an even mesh.context "
     r"\(got 3\): inside a pipeline the ring's step is two all-gathers within pairs of neighbours", 6),
    (["mesh.data=8", "train.context_attention=all_to_all"],
     r"^train.context_attention=all_to_all needs mesh.context > 1 \(each row split over context ranks\)"),
    (["mesh.context=4", "mesh.model=2", "mesh.data=1", "train.context_attention=all_to_all", "model.n_heads=4"],
     r"^train.context_attention=all_to_all splits each rank's heads over the context ranks: model.n_heads=4 is not "
     r"divisible by mesh.model x mesh.context = 2 x 4"),
]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line(case):
    from trainer import load_config
    from trainer.config import validate
    from trainer.errors import UserError
    keys, message, *devices = case  # on 8 devices unless the case names its count
    with pytest.raises(UserError, match=message) as e:
        validate(load_config(TINY + keys), devices[0] if devices else 8)
    assert "\n" not in str(e.value)


def _steps(s, state, first: int, last: int):
    """Steps first..last-1 of the built-in corpus's batches from `state`: (state, each step's loss)."""
    from conftest import corpus
    from trainer.data.batches import Batches
    from trainer.step import jit_train_step
    b = Batches(corpus(), s.cfg.train.seed, s.cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
    step, out = jit_train_step(s), []
    with jax.set_mesh(s.mesh):
        for i in range(first, last):
            state, m = step(state, jax.device_put(b.global_train(i), s.batch_sharding()))
            out.append(float(m["loss"]))
    return state, out


@pytest.mark.slow
def test_a_checkpoint_of_data2_context4_restores_onto_data8_and_one_device(tmp_path):
    """Saved after step 1 on (data 2, context 4) ZeRO-3 (state sharded over data x context), restored bit for bit
    onto (data 8) ZeRO-1 and onto one device; step 2 on each equals the uninterrupted run's."""
    from meshes import devices_named
    from trainer import load_config
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.state import make_setup

    def setup(*keys):
        cfg = load_config(TINY + SGD + ["model.seq_len=32", *keys])
        return make_setup(cfg, jax.devices()[:devices_named(cfg.mesh)])
    a = setup("mesh.data=2", "mesh.context=4", "train.zero_stage=3")
    assert a.layout.zero_axes == ("data", "context")
    state, _ = _steps(a, fresh_state(a), 0, 1)
    saved = jax.tree.map(np.asarray, state)
    c = Checkpointer(a, tmp_path / "run")
    c.save(1, state)
    c.close()
    after, want = _steps(a, state, 1, 2)
    for keys in (("mesh.data=8", "train.zero_stage=1"), ("mesh.data=1",)):
        b = setup(*keys)
        c = Checkpointer(b, tmp_path / "run")
        restored, at = c.restore()
        c.close()
        assert at == 1 and all(np.array_equal(np.asarray(x), y) for x, y in zip(jax.tree.leaves(restored["params"]),
                                                                              jax.tree.leaves(saved["params"])))
        state_b, got = _steps(b, restored, 1, 2)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        assert max_rel(jax.tree.map(np.asarray, state_b["params"]), jax.tree.map(np.asarray, after["params"])) < 1e-5


MOE_LAYOUTS = {
    "d2c2-zero3": (("mesh.data=2", "mesh.context=2", "train.zero_stage=3"), True),
    "d2c2-zero0": (("mesh.data=2", "mesh.context=2"), True),
    "d2c2s2-1f1b": (("mesh.data=2", "mesh.context=2", "mesh.stage=2", "train.microbatches=2",
                     "train.pipeline_schedule=1f1b"), True),
    "d2c4-replicated": (("mesh.data=2", "mesh.context=4", "train.zero_stage=2", "train.expert_parallel=false"), False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_equals_one_device(name):
    """A dropless MoE (router scaled for wide margins) with each row split over context: loss, grad_norm,
    aux/load_balance (per-row statistics over the whole row, each row counted once), aux/z_loss and parameters
    against one device (1e-5); with the experts split over `data` (their gradients summed over `context` only)
    and replicated."""
    from test_expert_parallel import MOE, ROUTER_SCALE
    from test_moe import same_as_one_device
    layout, split = MOE_LAYOUTS[name]
    same_as_one_device(("model.seq_len=32",), layout, base=tuple(MOE), router_scale=ROUTER_SCALE, split=split)


COMPILED = {
    "d2c4-zero3": ["mesh.data=2", "mesh.context=4", "train.zero_stage=3"],
    "d2c2m2-zero1-full": ["mesh.data=2", "mesh.context=2", "mesh.model=2", "train.zero_stage=1", "model.remat=full"],
    "d2c2s2-1f1b": ["mesh.data=2", "mesh.context=2", "mesh.stage=2", "train.microbatches=2",
                    "train.pipeline_schedule=1f1b"],
    "d2c4-documents-m2": ["mesh.data=2", "mesh.context=4", "train.microbatches=2", "data.document_mask=true"],
}
ULYSSES = {
    "d2c4-zero3": ["mesh.data=2", "mesh.context=4", "train.zero_stage=3"],
    "c2m4-full-documents": ["mesh.data=1", "mesh.context=2", "mesh.model=4", "model.remat=full",
                            "data.document_mask=true"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ULYSSES))
def test_the_all_to_all_step_sends_what_the_planner_says(name):
    """train.context_attention=all_to_all (CPU HLO): its all-to-alls over `context` (q, k, v there, the output
    back, the transposes; again under remat) and its all-gathers over `context` (the batch's reorder, the
    documents) equal the planner's within 1%; no K/V is gathered."""
    from test_plan import _plan
    from trainer.plan.verify import measure
    cfg, plan = _plan(SGD + ["model.seq_len=64", "train.context_attention=all_to_all"] + ULYSSES[name])
    m = measure(cfg, grads=False)
    mine = {}
    for t in plan.transfers:
        mine[(t.kind, t.axis)] = mine.get((t.kind, t.axis), 0.0) + t.bytes
    xla = {(k, ",".join(a)): b for (k, a), b in m.collectives.items()}
    # XLA moves the batch's reorder by all-gather or collective-permute (over context, and model where the rows
    # are replicated over it): counted together
    xla[("all-gather", "context")] = xla.get(("all-gather", "context"), 0.0) + sum(
        b for (k, a), b in m.collectives.items() if k == "collective-permute" and "context" in a)
    for key in (("all-to-all", "context"), ("all-gather", "context")):
        assert mine[key] > 0 and abs(xla[key] / mine[key] - 1) < 0.01, (key, xla[key], mine[key])
    assert ("reduce-scatter", "context") not in xla


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED))
def test_the_compiled_step_gathers_only_kv_over_context_and_the_planner_holds_it(name):
    """XLA's CPU program (HLO collectives by kind, mesh axes and bytes): the K/V all-gathers over `context` and the
    dK/dV reduce-scatters equal the planner's within 1%, as do the collectives over data x context (ZeRO's and the
    gradients'); every other collective over `context` (the batch's reorder, the positions, the loss's scalars)
    moves less than one layer's K/V; nothing over `context` gathers the residual stream."""
    import re

    from test_plan import _plan
    from trainer.plan.hlo import collective_ops
    from trainer.plan.verify import measure, table_weights
    from trainer.state import make_setup
    cfg, plan = _plan(SGD + ["model.seq_len=64"] + COMPILED[name])
    m = measure(cfg, grads=False)
    s = make_setup(cfg, jax.devices()[:8])
    kv = next(t for t in plan.transfers if t.what.startswith("K and V gathered"))
    per_layer = kv.bytes / kv.count  # one layer's K (or V) as one device receives it
    T = cfg.model.seq_len if cfg.model.seq_len else 64
    xla_kv, xla_rest = 0.0, []
    for kind, axes, sent, line in collective_ops(m.text, m.mesh_shape, *table_weights(s)):
        if axes != ("context",) and not ("context" in axes and kind == "collective-permute"):
            continue
        shape = [int(d) for d in re.search(r"\w+\[([\d,]*)\]", line.split("=", 1)[1]).group(1).split(",") if d]
        if kind == "all-gather" and len(shape) == 4 and shape[2] == T:  # (rows, kv heads, T, head_dim)
            xla_kv += sent
        elif kind != "reduce-scatter":
            xla_rest.append((sent, line.strip()[:120]))
    assert abs(xla_kv / kv.bytes - 1) < 0.01, (xla_kv, kv.bytes)
    mine = {}
    for t in plan.transfers:
        mine[(t.kind, t.axis)] = mine.get((t.kind, t.axis), 0.0) + t.bytes
    xla = {(k, ",".join(a)): b for (k, a), b in m.collectives.items()}
    assert abs(xla.get(("reduce-scatter", "context"), 0) / mine[("reduce-scatter", "context")] - 1) < 0.01
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        got, want = xla.get((kind, "data,context"), 0.0), mine.get((kind, "data,context"), 0.0)
        assert abs(got - want) <= 0.01 * want + 256, (kind, got, want)  # 256 B: the loss's scalars
    assert all(sent < per_layer for sent, _ in xla_rest), [r for r in xla_rest if r[0] >= per_layer]


@pytest.mark.slow
def test_evaluation_equals_one_device():
    """The eval step on (data 2, context 4), balanced, with the same parameters: loss sum and counted tokens of a
    held-out batch equal one device's (1e-5)."""
    from conftest import corpus
    from meshes import devices_named
    from trainer import load_config
    from trainer.data.batches import Batches
    from trainer.state import make_setup
    from trainer.step import jit_eval_step
    out = []
    for keys in (["mesh.data=2", "mesh.context=4"], ["mesh.data=1"]):
        cfg = load_config(TINY + SGD + ["model.seq_len=32", *keys])
        s = make_setup(cfg, jax.devices()[:devices_named(cfg.mesh)])
        b = Batches(corpus(), cfg.train.seed, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size,
                    evaluates=True)
        with jax.set_mesh(s.mesh):
            total, n = jit_eval_step(s)(fresh_state(s)["params"], jax.device_put(b.eval(0), s.batch_sharding()))
        out.append((float(total), float(n)))
    (got, n_got), (want, n_want) = out
    assert n_got == n_want > 0 and abs(got - want) <= 1e-5 * abs(want)


@pytest.mark.slow
def test_the_search_weighs_the_three_strategies(capsys):
    """`plan --search` on 8 devices plans layouts with context > 1 under all_gather, all_to_all and ring, all_to_all
    only where the heads split over model x context, the ring under a pipeline too."""
    import json

    from trainer.cli import main
    assert main(["plan", *TINY, "model.seq_len=64", "model.n_heads=4", "model.n_kv_heads=4", "plan.device=h100-80g",
                 "--search", "--devices", "8", "--top", "5000", "--json"]) == 0
    rows = [p["layout"] for p in json.loads(capsys.readouterr().out)["plans"]]
    ctx = [r for r in rows if r["context"] > 1]
    assert {r["context_attention"] for r in ctx} == {"all_gather", "all_to_all", "ring"}
    assert any(r["context_attention"] == "ring" and r["stage"] > 1 for r in ctx)
    assert all(4 % (r["model"] * r["context"]) == 0 for r in ctx if r["context_attention"] == "all_to_all")
    assert any(4 % (r["model"] * r["context"]) for r in ctx if r["context_attention"] == "all_gather")
    assert all("context_attention" not in r for r in rows if r["context"] == 1)


RING = {
    "c8": ["mesh.data=1", "mesh.context=8"],
    "d2c2m2-zero3-dots": ["mesh.data=2", "mesh.context=2", "mesh.model=2", "train.zero_stage=3", "model.remat=dots"],
    "c4s2-1f1b": ["mesh.data=1", "mesh.context=4", "mesh.stage=2", "train.microbatches=2",
                  "train.pipeline_schedule=1f1b"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RING))
def test_the_ring_step_passes_blocks_and_gathers_no_kv(name):
    """train.context_attention=ring (CPU HLO): no all-gather over `context` of a K/V-shaped array; its
    collective-permutes over `context` (the blocks, their positions, the gradients home) equal the planner's within
    1%. Inside a pipeline the ring's steps are all-gathers within pairs of neighbours (meshes/collectives.py): every
    K/V-shaped all-gather has groups of two, and their bytes equal the planner's within 1%."""
    import re

    from test_plan import _plan
    from trainer.plan.hlo import _groups
    from trainer.plan.verify import measure
    cfg, plan = _plan(SGD + ["model.seq_len=64", "train.context_attention=ring"] + RING[name])
    m = measure(cfg, grads=False)
    piped = "mesh.stage=2" in RING[name]
    for line in m.text.splitlines():
        if " all-gather(" in line:
            shape = re.search(r"\w+\[([\d,]*)\]", line.split("=", 1)[1]).group(1).split(",")
            if len(shape) >= 4:  # else the batch's reorder and the positions
                assert piped and {len(g) for g in _groups(line, 8)} == {2}, line.strip()[:160]
    kind = "all-gather" if piped else "collective-permute"
    mine = sum(t.bytes for t in plan.transfers if t.kind == kind and t.axis == "context" and "ring" in t.what)
    xla = m.collectives.get((kind, ("context",)), 0.0)
    assert mine > 0 and abs(xla / mine - 1) < 0.01, (xla, mine)
