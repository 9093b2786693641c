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
from conftest import SGD, TINY, corpus, fresh_state, max_rel, run_steps, single_device

from models import ModelSpec, Param, Transformer, abstract_model, family, from_preset, params_of, register
from models.hf import llama as llama_hf
from models.layers import rms_norm
from models.spec import HFAdapter, Leaf
from models.families.llama import llama_inventory
from models.transformer import attention_half


def toy_inventory(c):
    inv = llama_inventory(c)
    D, F = c.d_model, c.d_ff
    layers = {k: v for k, v in inv["layers"].items() if k not in ("w_gate", "w_up", "w_down")}
    layers.update(w_in=Param((D, F), ("embed", "mlp"), "normal", True),
                  w_out=Param((F, D), ("mlp", "embed"), "residual", True),
                  post_norm=Param((D,), ("embed",), "ones", False))
    return {**inv, "layers": layers}


def toy_layer(c, p, x, call):
    half, constrain = call.half, call.constrain
    x = half(functools.partial(attention_half, c, call=call))(p, x)

    def mlp(p, x):
        h = rms_norm(x, p["mlp_norm"].astype(x.dtype), c.norm_eps)
        a = constrain(jax.nn.gelu(jnp.einsum("btd,df->btf", h, p["w_in"].astype(x.dtype))), ("batch", "seq", "mlp"))
        y = x + jnp.einsum("btf,fd->btd", a, p["w_out"].astype(x.dtype))
        return constrain(rms_norm(y, p["post_norm"].astype(x.dtype), c.norm_eps), ("batch", "seq", "embed"))
    return half(mlp)(p, x), {}


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
                                  pytest.param(["mesh.data=2", "mesh.stage=2", "mesh.model=1",
                                                "train.pipeline_schedule=1f1b", "train.microbatches=2"],
                                               marks=pytest.mark.slow)],  # the aux test below runs 1F1B by default
                         ids=["zero3-2x1x4", "1f1b-2x2x1"])
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
    from hf_check import read_folder

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


# ----------------------------------------------------------------------------- auxiliary outputs, per-layer data

AUX_COEF = 0.1


def aux_layer(c, p, x, call):
    """The toy layer with one auxiliary output: AUX_COEF x w[layer] x the mean square of its output per token,
    over the tokens of a document; w (per-layer data) is the layer's index + 1, so that a layer run with
    another's index gives another value."""
    x, _ = toy_layer(c, p, x, call)
    keep = jnp.ones(x.shape[:2]) if call.segments is None else (call.segments > 0).astype(jnp.float32)
    sq = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1) * keep
    return x, {"act_sq": AUX_COEF * call.data["w"] * jnp.sum(sq)}


def aux_counts(c, batch):
    return {"act_sq": c.n_layers * jnp.sum((batch["segment_ids"] > 0).astype(jnp.float32))}


register(ModelSpec("toy_aux", toy_inventory, aux_layer, aux=("act_sq",), aux_counts=aux_counts,
                   layer_data=lambda c: {"w": np.arange(1, c.n_layers + 1, dtype=np.float32)}))
AUX = SGD + ["model.family=toy_aux", "model.n_layers=4", "train.batch_size=8"]


def reference_objective(c, params, batch):
    """The objective by hand, outside the layer stack, the step and every layout: the layers one by one in a
    Python loop (index and weight given directly), the token loss mean and the aux mean taken here, once."""
    from models.layers import rope_tables
    from models.objectives.cross_entropy import cross_entropy
    from models.transformer import head, layer_call
    x = params["embed"][batch["tokens"]]
    rope = rope_tables(x.shape[1], c.head_dim, c.rope_theta, c.rope_scaling)
    aux_sum = aux_count = 0.0
    for i in range(c.n_layers):
        p = jax.tree.map(lambda w: w[i], params["layers"])
        x, _ = toy_layer(c, p, x, layer_call(c, rope, index=i))
        sq = jnp.mean(jnp.square(x), axis=-1)
        aux_sum, aux_count = aux_sum + AUX_COEF * (i + 1) * jnp.sum(sq), aux_count + sq.size
    token = cross_entropy(head(c, params, x), batch["targets"]) / batch["targets"].size
    return token + aux_sum / aux_count, (token, aux_sum / aux_count)


@pytest.mark.parametrize("mesh", [[], pytest.param(["mesh.data=2", "mesh.model=4", "train.zero_stage=3",
                                                    "train.microbatches=2"], marks=pytest.mark.slow),
                                  ["mesh.data=2", "mesh.stage=2", "mesh.model=1", "train.pipeline_schedule=1f1b",
                                   "train.microbatches=2"],
                                  # -m slow: ZeRO-3 with tensor parallelism and accumulation (the default run keeps
                                  # one device and a pipeline), interleaved 1F1B (the executor 1F1B runs, V = 2)
                                  pytest.param(["mesh.data=1", "mesh.stage=2", "mesh.model=1", "train.microbatches=2",
                                                "train.pipeline_schedule=interleaved_1f1b", "train.pipeline_repeats=2"],
                                               marks=pytest.mark.slow),
                                  # -m slow: GPipe and circular GPipe run the same executor (tables differ only in
                                  # their order) as 1F1B (V = 1) and interleaved 1F1B (V = 2, circular blocks)
                                  pytest.param(["mesh.data=1", "mesh.stage=2", "mesh.model=1", "train.microbatches=2",
                                                "train.pipeline_schedule=gpipe"], marks=pytest.mark.slow),
                                  pytest.param(["mesh.data=1", "mesh.stage=2", "mesh.model=1", "train.microbatches=2",
                                                "train.pipeline_schedule=gpipe", "train.pipeline_repeats=2"],
                                               marks=pytest.mark.slow)],
                         ids=["1-device", "zero3-2x1x4-m2", "1f1b-2x2x1", "interleaved-1x2x1-v2", "gpipe-1x2x1",
                              "circular-gpipe-1x2x1-v2"])
def test_aux_outputs_and_per_layer_data_reach_the_loss_and_gradients_on_every_layout(mesh):
    """Every path (compiler, explicit accumulation over data, every pipeline schedule's tick loop forward and
    backward, circular blocks) gives the hand-computed objective's token loss, aux mean and gradient."""
    from trainer.config import load_config
    from trainer.data.batches import Batches
    from trainer.state import make_setup
    from trainer.step import jit_train_step, loss_and_grads
    cfg = load_config(TINY + AUX + ["mesh.data=1", "mesh.stage=1", "mesh.model=1"] + mesh)
    s = make_setup(cfg, jax.devices()[:cfg.mesh.data * cfg.mesh.stage * cfg.mesh.model])
    state = fresh_state(s)
    b = Batches(corpus(), 0, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size).global_train(0)
    params = jax.tree.map(np.asarray, state["params"])
    # jitted: op by op, the hand-written objective's ops would each compile on their own (most of this test's time)
    ref = jax.jit(lambda p, x: jax.value_and_grad(reference_objective, argnums=1, has_aux=True)(s.model, p, x))
    (_, (token, aux)), want = ref(params, jax.tree.map(jnp.asarray, b))
    with jax.set_mesh(s.mesh):
        batch = jax.device_put(b, s.batch_sharding())
        parts, got = jax.jit(lambda p, x: loss_and_grads(s, p, x))(state["params"], batch)
        # the step's metric (once: its parts are these, summed the same way on every layout)
        m = jit_train_step(s)(state, batch)[1] if cfg.train.pipeline_schedule == "1f1b" and cfg.mesh.stage > 1 \
            else None
    np.testing.assert_allclose(float(parts["loss"]), float(token), rtol=1e-5)
    from models.objectives.objective import aux_counts
    total, count = float(parts["aux"]["act_sq"]), float(aux_counts(s.model, b)["act_sq"])
    np.testing.assert_allclose(total / count, float(aux), rtol=1e-5)
    if m is not None:
        np.testing.assert_allclose(float(m["aux/act_sq"]), float(aux), rtol=1e-5)
    assert count == 4 * b["tokens"].size  # the family's count: every layer's tokens
    assert max_rel(jax.tree.map(np.asarray, got), want) < 1e-5
    if not mesh:  # the aux term moves the gradient (so the comparison can fail): without it the layers' differ
        no_aux = jax.jit(jax.grad(lambda p: reference_objective(s.model, p, jax.tree.map(jnp.asarray, b))[1][0]))(params)
        assert max_rel(no_aux["layers"], want["layers"]) > 1e-3
