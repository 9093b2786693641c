"""A model family defined only here registers through the public registry (models/spec.py) and runs on a
tensor-parallel ZeRO-3 layout and a 1F1B pipeline exactly as on one device; nothing outside this file changes.

The toy: Llama's attention, a GELU MLP of two matrices (not SwiGLU's three) and an extra RMSNorm after it.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SGD, max_rel, run_steps, single_device

from models import ModelSpec, Param, abstract_model, family, from_preset, register
from models.layers import rms_norm
from models.transformer import attention_half, llama_inventory


def toy_inventory(c):
    inv = llama_inventory(c)
    D, F = c.d_model, c.d_ff
    layers = {k: v for k, v in inv["layers"].items() if k not in ("w_gate", "w_up", "w_down")}
    layers.update(w_in=Param((D, F), ("embed", "mlp"), "normal", True),
                  w_out=Param((F, D), ("mlp", "embed"), "residual", True),
                  post_norm=Param((D,), ("embed",), "ones", False))
    return {**inv, "layers": layers}


def toy_layer(c, p, x, rope, constrain=lambda x, axes: x, kernels=None, half=lambda f: f, segments=None):
    x = half(functools.partial(attention_half, c, rope=rope, constrain=constrain, kernels=kernels,
                               segments=segments))(p, x)

    def mlp(p, x):
        h = rms_norm(x, p["mlp_norm"].astype(x.dtype), c.norm_eps)
        a = constrain(jax.nn.gelu(jnp.einsum("btd,df->btf", h, p["w_in"].astype(x.dtype))), ("batch", "seq", "mlp"))
        y = x + jnp.einsum("btf,fd->btd", a, p["w_out"].astype(x.dtype))
        return constrain(rms_norm(y, p["post_norm"].astype(x.dtype), c.norm_eps), ("batch", "seq", "embed"))
    return half(mlp)(p, x)


register(ModelSpec("toy_gelu", toy_inventory, toy_layer))
TOY = SGD + ["model.family=toy_gelu"]


def test_the_family_is_registered_and_declares_its_parameters():
    c = from_preset("tiny", family="toy_gelu")
    a = abstract_model(c)
    assert family("toy_gelu").layer is toy_layer
    assert sorted(a.params["layers"]) == sorted(toy_inventory(c)["layers"]) and "w_gate" not in a.params["layers"]
    assert a.params["layers"]["w_in"].shape == (c.n_layers, c.d_model, c.d_ff)
    assert a.logical["layers"]["w_out"] == ("layers", "mlp", "embed")
    assert a.decay["layers"]["post_norm"] is False and a.decay["layers"]["w_in"] is True
    with pytest.raises(ValueError, match="model.family='nope' is not registered; choose one of .*llama"):
        family("nope")
    # the toy runs, not Llama: the same seed and batches give other losses
    toy, llama = single_device(TOY)[0], single_device(SGD)[0]
    assert np.abs(toy - llama).min() > 1e-3, (toy, llama)


@pytest.mark.parametrize("mesh", [["mesh.data=2", "mesh.model=4", "train.zero_stage=3"],
                                  ["mesh.data=2", "mesh.stage=2", "mesh.model=1", "train.pipeline_schedule=1f1b",
                                   "train.microbatches=2"]], ids=["zero3-2x1x4", "1f1b-2x2x1"])
def test_a_family_defined_in_a_test_trains_as_on_one_device(mesh):
    over = TOY + mesh
    r = run_steps(over)
    ref_losses, ref_params, ref_norms = single_device(over)
    assert sorted(r.params["layers"]) == sorted(toy_inventory(r.setup.model)["layers"])
    np.testing.assert_allclose(r.losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(r.grad_norms, ref_norms, rtol=1e-5)
    assert max_rel(r.params, ref_params) < 1e-5 and ref_losses[-1] != ref_losses[0]
