"""Model-level equivalences: accumulation == full batch, remat on == off, causality, presets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY, corpus, max_rel
from models import PRESETS, Transformer, from_preset, param_count, params_of
from models.transformer import embed, head, layer_stack, loss_fn
from trainer.config import load_config
from trainer.data import Batches
from trainer.state import abstract_model, init_state, make_setup
from trainer.step import loss_and_grads


def _grads(overrides, n_devices=8):
    cfg = load_config(TINY + ["train.batch_size=32"] + overrides)
    s = make_setup(cfg, jax.devices()[:n_devices])
    state = init_state(s)
    b = Batches(corpus(), 0, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size).global_train(0)
    with jax.set_mesh(s.mesh):
        loss, g = jax.jit(lambda p, x: loss_and_grads(s, p, x))(state["params"], jax.device_put(b, s.batch_sharding()))
    return float(loss), jax.tree.map(np.asarray, g)


@pytest.mark.parametrize("layout", [["mesh.data=8"], ["mesh.data=8", "train.zero_stage=2"],
                                    ["mesh.data=4", "mesh.model=2", "train.zero_stage=3"]],
                         ids=["dp-auto", "dp-zero2", "dp-tp-zero3"])
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
    batch = jnp.asarray(corpus().train[: 4 * 33].reshape(4, 33).astype(np.int32))
    out = {}
    for remat in ("none", "full", "dots"):
        out[remat] = jax.jit(jax.value_and_grad(lambda p: loss_fn(c, p, batch, remat=remat)))(p)
    for remat in ("full", "dots"):
        assert abs(float(out[remat][0]) - float(out["none"][0])) < 1e-6
        assert max_rel(out[remat][1], out["none"][1]) < 1e-5


def test_model_is_causal():
    c, p = _tiny_params()
    tokens = jnp.asarray(corpus().train[:2 * 32].reshape(2, 32).astype(np.int32))
    x0 = embed(c, p, tokens, jnp.float32)
    t = 10

    def out_t(x):
        return head(c, p, layer_stack(c, p["layers"], x))[:, t].sum()

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
    shapes, logical = abstract_model(c)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert n == param_count(c)
    assert jax.tree.structure(shapes) == jax.tree.structure(logical, is_leaf=lambda x: isinstance(x, tuple))
    if preset == "7b":
        assert 6.5e9 < n < 7.0e9  # Llama-2-7B: 6.74B parameters
