"""Weight decay: declared where each parameter is created, read by the optimizer, whatever the stacking."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY
from models import abstract_model, from_preset, params_of, weight_decay_of
from trainer.config import load_config
from trainer.optim import make_optimizer
from trainer.state import init_state, make_setup

# plain SGD without momentum or clipping: an update with a zero gradient is the decay alone, -lr * wd * p
DECAY = ["train.optimizer=sgd", "train.grad_clip=0", "train.b1=0", "train.weight_decay=0.5", "train.lr=0.1",
         "train.warmup_steps=0", "train.steps=10"]


def _decay_step(tx, params):
    """The update of one step with a zero gradient: what weight decay alone does to `params`."""
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    return updates


def test_llama_declares_decay_on_matrices_embedding_and_head_not_on_norms():
    """Llama's choices, written out by hand: every matmul weight, the embedding and the head decay."""
    got = abstract_model(from_preset("tiny", tie_embeddings=False)).decay
    norms = {"attn_norm", "mlp_norm"}
    want = {"embed": True, "final_norm": False, "lm_head": True,
            "layers": {n: n not in norms for n in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate",
                                                    "w_up", "w_down")}}
    assert got == want


class _Biased(nnx.Module):
    """Test-only: a stacked weight and a stacked bias whose name says nothing about decay."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones((2, 3, 4)), logical_axes=("layers", "embed", "mlp"), weight_decay=True)
        self.bias = nnx.Param(jnp.ones((2, 4)), logical_axes=("layers", "mlp"), weight_decay=False)


def test_a_bias_declared_without_decay_is_not_decayed():
    m = _Biased()
    params, decay = params_of(m), weight_decay_of(m)
    assert decay == {"w": True, "bias": False}
    tx, _ = make_optimizer(load_config(DECAY).train, decay)
    up = _decay_step(tx, params)
    assert np.all(np.asarray(up["bias"]) == 0), up["bias"]
    np.testing.assert_allclose(np.asarray(up["w"]), -0.1 * 0.5 * np.ones((2, 3, 4)), rtol=1e-6)


def test_a_parameter_without_a_declaration_is_refused():
    class Undeclared(nnx.Module):
        def __init__(self):
            self.b = nnx.Param(jnp.ones((3,)))
    with pytest.raises(ValueError, match="does not declare weight_decay"):
        weight_decay_of(Undeclared())


def test_decay_follows_the_declaration_on_replica_stacked_state():
    """Local SGD stacks params as (replicas, L, ...): the (2, 2, 64) norm gains still do not decay."""
    s = make_setup(load_config(TINY + DECAY + ["train.sync=local_sgd", "mesh.data=2"]), jax.devices()[:2])
    stacked = init_state(s)["params"]
    assert stacked["layers"]["attn_norm"].shape == (2, 2, 64)
    up = _decay_step(s.tx, stacked)
    decay = abstract_model(s.model).decay
    for (path, u), d, p in zip(jax.tree_util.tree_flatten_with_path(up)[0], jax.tree.leaves(decay),
                               jax.tree.leaves(stacked)):
        expect = -0.1 * 0.5 * np.asarray(p) if d else np.zeros(p.shape)
        np.testing.assert_allclose(np.asarray(u), expect, rtol=1e-6, atol=0, err_msg=jax.tree_util.keystr(path))
