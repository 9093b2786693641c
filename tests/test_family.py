"""A model family defined only here registers through the public registry (models/spec.py) and runs on a
tensor-parallel ZeRO-3 layout and a 1F1B pipeline exactly as on one device; with a Hugging Face adapter of its own
it is exported to and imported from an HF folder; nothing outside this file changes.

The toy: Llama's attention, a GELU MLP of two matrices (not SwiGLU's three) and an extra RMSNorm after it.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from conftest import SGD, max_rel, run_steps, single_device

from models import ModelSpec, Param, Transformer, abstract_model, family, from_preset, params_of, register
from models import llama_hf
from models.layers import rms_norm
from models.spec import HFAdapter, Leaf
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


def toy_leaves(mc):
    D, F, L = mc.d_model, mc.d_ff, mc.n_layers
    mine = {"w_in": ("mlp.fc_in", (F, D), (F, D), (1, 0)), "w_out": ("mlp.fc_out", (D, F), (D, F), (1, 0)),
            "post_norm": ("post_mlp_layernorm", (D,), (D,), (0,))}
    out = [lf for lf in llama_hf.leaves(mc) if lf.path[-1] not in ("w_gate", "w_up", "w_down")]
    return out + [Leaf(("layers", k), [f"model.layers.{i}.{n}.weight" for i in range(L)], s, v, pm, True)
                  for k, (n, s, v, pm) in mine.items()]


def toy_config(mc, dtype):
    return {**llama_hf.hf_config(mc, dtype), "architectures": ["ToyGeluForCausalLM"], "model_type": "toy_gelu",
            "hidden_act": "gelu"}


def toy_check(hc):
    if hc.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act={hc['hidden_act']!r} is not supported; the toy has 'gelu'")


register(ModelSpec("toy_hf", toy_inventory, toy_layer,
                   HFAdapter("ToyGeluForCausalLM", toy_check, llama_hf.model_keys, toy_leaves, toy_config)))


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


def test_a_family_with_its_own_hf_adapter_goes_out_to_a_folder_and_back(tmp_path):
    """Export writes the adapter's tensor names and config.json; importing the folder picks the family from its
    architectures and reads back the same parameters; a family without an adapter is refused by name."""
    from test_hf import read_folder

    from trainer.ckpt.hf_export import write_hf
    from trainer.ckpt.params import load_params_at
    from trainer.errors import UserError
    mc = from_preset("tiny", family="toy_hf", tie_embeddings=False)
    params = params_of(Transformer(mc, rngs=nnx.Rngs(3)))
    write_hf(params, mc, tmp_path / "hf")
    tensors = {k: a for k, (_, a) in read_folder(tmp_path / "hf").items()}
    assert "model.layers.1.mlp.fc_in.weight" in tensors and not any("gate_proj" in n for n in tensors)
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.fc_out.weight"], np.asarray(params["layers"]["w_out"][1]).T)
    back, cfg, _ = load_params_at(tmp_path / "hf")
    assert cfg.model.family == "toy_hf" and cfg.model.d_model == mc.d_model
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, params)
    (tmp_path / "hf" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text().replace(
        '"hidden_act": "gelu"', '"hidden_act": "relu"'))
    with pytest.raises(UserError, match="hidden_act='relu' is not supported; the toy has 'gelu'"):
        load_params_at(tmp_path / "hf")
    with pytest.raises(UserError, match="model.family='toy_gelu' has no Hugging Face form"):
        write_hf(params, from_preset("tiny", family="toy_gelu", tie_embeddings=False), tmp_path / "none")
