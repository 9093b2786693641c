"""Documents (data.document_mask): the batch's segment_ids and positions, attention that stays inside a
document on every path, and training with document masks on every family of layouts."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SGD, TINY, fresh_state, max_rel, prepare_documents, run_steps
from trainer.data.batches import documents

SLOW = pytest.mark.slow
T = 32
# documents A (20 tokens), B (10), C (16), D: a window from offset 12 holds A's last 8 (cut by the window's
# start), all of B, and C's first 14 with the 15th as the last target (cut by its end)
DOC_STARTS = np.array([0, 20, 30, 46, 100])
WINDOW = 12


def test_fields_of_a_window_across_documents():
    weight, seg, pos = (x[0] for x in documents(DOC_STARTS, np.array([WINDOW]), T))
    np.testing.assert_array_equal(seg, [1] * 8 + [2] * 10 + [3] * 14)
    np.testing.assert_array_equal(pos, list(range(12, 20)) + list(range(10)) + list(range(14)))
    # the input before a document's first token has that token as its target: not counted
    np.testing.assert_array_equal(np.flatnonzero(weight == 0), [7, 17])


def _row(vocab: int):
    """One window of T+1 random tokens over DOC_STARTS at WINDOW, and its fields."""
    from models.batch import from_windows
    w = np.random.default_rng(5).integers(0, vocab, (1, T + 1))
    return w, from_windows(w, *documents(DOC_STARTS, np.array([WINDOW]), T))


def _alone_losses(vocab: int):
    """Each document's mean loss alone: the plain model (no document mask) on a row of just its tokens.
    RoPE depends on position differences only, so a document cut by the window's start needs no offset."""
    from flax import nnx
    from models import from_preset
    from models.batch import from_windows
    from models.objectives.objective import loss_fn
    from models.transformer import Transformer, params_of
    w, b = _row(vocab)
    c = from_preset("tiny", kernels="reference")
    p = params_of(Transformer(c, rngs=nnx.Rngs(0)))
    out = []
    for d in (1, 2, 3):
        cols = np.flatnonzero(b["segment_ids"][0] == d)
        span = w[:, cols[0]:cols[-1] + 2]  # the document's inputs and their targets
        weight = b["loss_weight"][:, cols]  # the last target of A and B is the next document's: not counted
        out.append(float(loss_fn(c, p, from_windows(span, weight))))
    return np.array(out)


def _layout_losses(mesh, kernels: str, document_mask: bool = True):
    """The train step's loss on a batch of that row (4 copies), weight selecting each document in turn."""
    from trainer.config import load_config
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    d, st, m = mesh
    over = [f"mesh.data={d}", f"mesh.stage={st}", f"mesh.model={m}", f"model.kernels={kernels}",
            f"data.document_mask={str(document_mask).lower()}", "train.batch_size=4", "train.lr=0"]
    if st > 1:
        over += ["train.pipeline_schedule=1f1b", "train.microbatches=4", "model.n_layers=4"]
    s = make_setup(load_config(TINY + SGD + over), jax.devices()[:d * st * m])
    step = jit_train_step(s)
    _, b = _row(s.model.vocab_size)
    out = []
    with jax.set_mesh(s.mesh):
        state = fresh_state(s)
        if st > 1:  # the 2-layer reference's layers, twice: 4 stages of one layer each (the same function)
            state = {**state, "params": _two_layers_twice(s, state["params"])}
        for doc in (1, 2, 3):
            batch = {k: np.repeat(v, 4, axis=0) for k, v in b.items()}
            batch["loss_weight"] = batch["loss_weight"] * (batch["segment_ids"] == doc)
            state, metrics = step(state, jax.device_put(batch, s.batch_sharding()))
            out.append(float(metrics["loss"]))
    return np.array(out)


def _two_layers_twice(s, params):
    """A 4-layer stack whose layers 2 and 3 have zero output projections: it computes what the first two
    layers compute (each zeroed layer adds nothing to the residual stream)."""
    from flax import nnx
    from models import from_preset
    from models.transformer import Transformer, params_of
    two = params_of(Transformer(from_preset("tiny"), rngs=nnx.Rngs(0)))
    layers = {k: jnp.concatenate([v, jnp.zeros_like(v) if k in ("wo", "w_down") else v]) for k, v in two["layers"].items()}
    out = {**two, "layers": layers}
    return jax.tree.map(lambda x, ref: jax.device_put(x, ref.sharding), out, params)


@functools.lru_cache(maxsize=None)
def alone():
    return _alone_losses(256)


@pytest.mark.parametrize("mesh,kernels", [
    ((1, 1, 1), "fast"), ((1, 1, 1), "reference"),
    pytest.param((2, 1, 4), "fast", marks=SLOW), pytest.param((2, 1, 4), "reference", marks=SLOW),
    pytest.param((1, 4, 1), "fast", marks=SLOW), pytest.param((1, 4, 1), "reference", marks=SLOW)])
def test_each_document_as_if_alone(mesh, kernels):
    np.testing.assert_allclose(_layout_losses(mesh, kernels), alone(), rtol=1e-5)


def test_without_the_mask_documents_see_each_other():
    """The same check with data.document_mask=false: B and C attend to what precedes them, and differ."""
    off = _layout_losses((1, 1, 1), "fast", document_mask=False)
    assert abs(off[0] - alone()[0]) < 1e-5 * alone()[0]  # A comes first: nothing before it to see
    assert (np.abs(off[1:] - alone()[1:]) > 1e-3 * alone()[1:]).all(), (off, alone())


def test_fast_attention_backward_with_segments_equals_the_reference():
    from models.kernels.attention import attention
    rng = np.random.default_rng(0)
    B, H, K, E = 2, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(B, 64, n, E)), jnp.float32) for n in (H, K, K))
    seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [10, 30, 24]), np.repeat([0, 1, 2], [5, 40, 19])]), jnp.float32)

    def by_hand(q, k, v):  # softmax over the keys of the query's segment at or before it
        kk, vv = jnp.repeat(k, H // K, 2), jnp.repeat(v, H // K, 2)
        s = jnp.einsum("bthe,bshe->bhts", q, kk) / np.sqrt(E)
        keep = (jnp.arange(64)[:, None] >= jnp.arange(64)[None]) & (seg[:, None, :, None] == seg[:, None, None, :])
        return jnp.einsum("bhts,bshe->bthe", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), -1), vv)

    ref = jax.jit(jax.grad(lambda *a: (by_hand(*a) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v)
    for impl, block in (("manual", 16), ("manual", 0), ("xla", 0)):
        f = functools.partial(attention, impl=impl, block=block, segments=seg)
        np.testing.assert_allclose(jax.jit(f)(q, k, v), jax.jit(by_hand)(q, k, v), atol=1e-6)
        got = jax.jit(jax.grad(lambda *a: (f(*a) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v)
        # 1.04e-6 on an AVX-512 Xeon (another summation order), 1e-6 elsewhere: float32 rounding (eps 1.2e-7)
        assert max(float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(got, ref)) < 4e-6, impl


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare_documents(tmp_path_factory.mktemp("docs"))


TRAIN = ["model.vocab_size=320", "data.document_mask=true"] + SGD


@pytest.mark.parametrize("layout", [
    pytest.param(["mesh.data=2", "mesh.model=4", "train.zero_stage=3", "train.microbatches=2"], id="zero3-2x1x4"),
    pytest.param(["mesh.data=2", "mesh.stage=4", "train.pipeline_schedule=1f1b", "train.microbatches=4",
                  "model.n_layers=4"], id="1f1b-2x4x1", marks=SLOW),
    pytest.param(["mesh.data=8", "train.grad_sync=ring", "train.microbatches=2"], id="ring-8x1x1", marks=SLOW),
    pytest.param(["mesh.data=2", "mesh.model=4", "train.zero_stage=3", "train.microbatches=2",
                  "train.sequence_parallel=true"], id="zero3-2x1x4-sequence-parallel", marks=SLOW)])
def test_training_with_document_masks_equals_one_device(prepared, layout):
    model = [o for o in layout if o.startswith("model.")]
    got = run_steps(TRAIN + layout, source=prepared)
    ref = run_steps(TRAIN + model + ["mesh.data=1", "mesh.stage=1", "mesh.model=1"], 1, source=prepared)
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5)
    np.testing.assert_allclose(got.grad_norms, ref.grad_norms, rtol=1e-5)
    assert max_rel(got.params, ref.params) < 1e-5
    off = run_steps([o for o in TRAIN if o != "data.document_mask=true"] + model
                    + ["mesh.data=1", "mesh.stage=1", "mesh.model=1"], 1, source=prepared)
    # at init the model barely uses its context, so the mask moves the loss a little, but far beyond rounding
    assert (np.abs(off.losses - ref.losses) > 2e-5 * ref.losses).all(), (off.losses, ref.losses)
