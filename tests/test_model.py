"""Model-level equivalences: accumulation == full batch, remat on == off, causality, presets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY, corpus, max_rel
from models import PRESETS, Transformer, from_preset, param_count, params_of
from models.batch import from_windows
from models.objectives.objective import loss_fn
from models.transformer import embed, head, layer_stack
from trainer.config import load_config
from trainer.data.batches import Batches
from models import abstract_model
from trainer.state import init_state, make_setup
from trainer.step import loss_and_grads


def _grads(overrides, n_devices=8):
    cfg = load_config(TINY + ["train.batch_size=32"] + overrides)
    s = make_setup(cfg, jax.devices()[:n_devices])
    state = init_state(s)
    b = Batches(corpus(), 0, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size).global_train(0)
    with jax.set_mesh(s.mesh):
        parts, g = jax.jit(lambda p, x: loss_and_grads(s, p, x))(state["params"], jax.device_put(b, s.batch_sharding()))
    return float(parts["loss"]), jax.tree.map(np.asarray, g)


@pytest.mark.parametrize("layout", [  # behind -m slow: tests/test_layouts.py compares ZeRO-2 accumulation with one device by default
    pytest.param(["mesh.data=8"], marks=pytest.mark.slow, id="dp-auto"),
    pytest.param(["mesh.data=8", "train.zero_stage=2"], marks=pytest.mark.slow, id="dp-zero2"),
    pytest.param(["mesh.data=4", "mesh.model=2", "train.zero_stage=3"], marks=pytest.mark.slow, id="dp-tp-zero3")])
def test_accumulation_equals_full_batch(layout):
    loss1, g1 = _grads(layout + ["train.microbatches=1"])
    loss4, g4 = _grads(layout + ["train.microbatches=4"])
    assert abs(loss1 - loss4) / loss1 < 1e-5
    assert max_rel(g4, g1) < 1e-5


def _tiny_params(**kw):
    c = from_preset("tiny", **kw)
    return c, params_of(Transformer(c, rngs=nnx.Rngs(0)))


def test_remat_on_off_same_loss_and_grads():
    c, p = _tiny_params()
    batch = from_windows(corpus().train[: 4 * 33].reshape(4, 33))
    out = {}
    for remat in ("none", "full", "dots"):
        out[remat] = jax.jit(jax.value_and_grad(lambda p: loss_fn(c, p, batch, remat=remat)))(p)
    for remat in ("full", "dots"):
        assert abs(float(out[remat][0]) - float(out["none"][0])) < 1e-6
        assert max_rel(out[remat][1], out["none"][1]) < 1e-5


@pytest.mark.parametrize("scan", [True, False])
def test_sublayer_remat_same_loss_and_grads_and_saves_two_inputs_per_layer(scan):
    """model.remat=sublayer recomputes each layer half from its input: the loss and gradients of
    remat=none (scanned or unrolled), and per layer only the two half inputs are saved."""
    from jax._src.ad_checkpoint import saved_residuals
    from trainer.config import load_config, model_config
    assert model_config(load_config(["model.preset=tiny", "model.remat=sublayer"])).remat == "sublayer"
    c, p = _tiny_params(scan_layers=scan)
    batch = from_windows(corpus().train[: 4 * 33].reshape(4, 33))
    out = {r: jax.jit(jax.value_and_grad(lambda p: loss_fn(c, p, batch, remat=r)))(p) for r in ("none", "sublayer")}
    np.testing.assert_allclose(float(out["sublayer"][0]), float(out["none"][0]), rtol=1e-6)
    assert max_rel(out["sublayer"][1], out["none"][1]) < 1e-6
    x = jnp.ones((4, 32, c.d_model))
    layers = p["layers"]
    saved = [r for r in saved_residuals(lambda w, x: layer_stack(c, w, x, remat="sublayer")[0], layers, x)
             if r[0].shape[-3:] == x.shape]  # activations (stacked when scanned), not weights or tables
    assert sum(r[0].size for r in saved) == 2 * c.n_layers * x.size, saved


def test_model_is_causal():
    c, p = _tiny_params()
    tokens = jnp.asarray(corpus().train[:2 * 32].reshape(2, 32).astype(np.int32))
    x0 = embed(c, p, tokens, jnp.float32)
    t = 10

    def out_t(x):
        return head(c, p, layer_stack(c, p["layers"], x)[0])[:, t].sum()

    g = np.asarray(jax.grad(out_t)(x0))
    assert np.abs(g[:, t + 1:]).max() == 0.0  # no influence from the future
    assert np.abs(g[:, t]).max() > 0 and np.abs(g[:, : t]).max() > 0  # but from the past and present


def test_gqa_heads_shapes():
    c, p = _tiny_params()
    assert c.n_kv_heads < c.n_heads
    assert p["layers"]["wk"].shape[2] == c.n_kv_heads and p["layers"]["wq"].shape[2] == c.n_heads


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_builds_abstractly(preset):
    c = from_preset(preset)
    shapes, logical = abstract_model(c)[:2]
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert n == param_count(c)
    assert jax.tree.structure(shapes) == jax.tree.structure(logical, is_leaf=lambda x: isinstance(x, tuple))
    if preset == "7b":
        assert 6.5e9 < n < 7.0e9  # Llama-2-7B: 6.74B parameters


# ----------------------------------------------------------------------------- fast paths (docs/performance.md)

def _loss_and_grads(c, p, batch, **kw):
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(c, p, batch, **kw)))(p)


@pytest.mark.parametrize("kv_heads", [pytest.param(8, marks=pytest.mark.slow, id="mha"), pytest.param(4, id="gqa")])
def test_fast_paths_match_the_reference_layer(kv_heads):
    """Unrolled layers, the hand-written attention backward (blocked and not) and the
    projections' shared backward give the loss and gradients of the plain formulation:
    scanned layers, jax.nn.dot_product_attention, autodiff."""
    batch = from_windows(corpus().train[: 4 * 33].reshape(4, 33))
    c_ref, p = _tiny_params(n_kv_heads=kv_heads, scan_layers=True, attention="xla")
    ref = _loss_and_grads(c_ref, p, batch)
    for kw in (dict(scan_layers=False, attention="manual", attention_block=0),
               dict(scan_layers=False, attention="manual", attention_block=8),
               dict(scan_layers=True, attention="manual", attention_block=16)):
        c = from_preset("tiny", n_kv_heads=kv_heads, **kw)
        got = _loss_and_grads(c, p, batch)
        assert abs(float(got[0]) - float(ref[0])) < 1e-6, kw
        assert max_rel(got[1], ref[1]) < 1e-5, kw


@pytest.mark.slow  # tests/test_fast_paths.py checks the blocked attention at the default run's shapes
def test_blocked_attention_matches_jax_attention_with_odd_shapes():
    from models.kernels.attention import causal_attention
    ks = jax.random.split(jax.random.key(1), 4)
    B, T, H, K, E = 2, 48, 6, 3, 16
    q = jax.random.normal(ks[0], (B, T, H, E))
    k, v = jax.random.normal(ks[1], (B, T, K, E)), jax.random.normal(ks[2], (B, T, K, E))
    w = jax.random.normal(ks[3], (B, T, H, E))
    for block in (0, 16, 24, 48, 20):  # 20 does not divide 48: one block
        f = lambda q, k, v: (causal_attention(q, k, v, block) * w).sum()  # noqa: E731
        g = lambda q, k, v: (jax.nn.dot_product_attention(q, k, v, is_causal=True) * w).sum()  # noqa: E731
        np.testing.assert_allclose(f(q, k, v), g(q, k, v), rtol=1e-5)
        assert max_rel(jax.grad(f, argnums=(0, 1, 2))(q, k, v), jax.grad(g, argnums=(0, 1, 2))(q, k, v)) < 1e-5


def test_dots_remat_saves_projection_outputs_and_full_saves_none():
    """The `dots` policy must see the projections (a custom_vjp) as saveable matmul outputs,
    or it would silently recompute the whole layer like `full`."""
    from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint.print_saved_residuals prints
    from models.layers import REMAT, rope_tables
    from models.transformer import layer, layer_call
    c, p = _tiny_params()
    lp = jax.tree.map(lambda w: w[0], p["layers"])
    x = jnp.ones((2, 32, c.d_model))
    rope = rope_tables(32, c.head_dim, c.rope_theta)

    def named(policy):
        f = jax.checkpoint(lambda lp, x: layer(c, lp, x, layer_call(c, rope))[0].sum(), policy=REMAT[policy])
        return [r for r in saved_residuals(f, lp, x) if "projection" in r[1]]

    # q, k, v, attention out, gate, up: six (B*T, ...) projection outputs per layer
    assert len(named("dots")) >= 5 and all(r[0].shape[0] == 64 for r in named("dots"))
    assert named("full") == []
