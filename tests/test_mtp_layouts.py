"""Multi-token prediction (model.mtp_depth) trained on a layout against one device: 2 modules on the tiny Llama at
weight 0.5, packed documents and the tiled loss, (2,1,4) ZeRO-3 with tensor parallelism (and (1,4,2) 1F1B, the modules
on the last stage with the head, behind -m slow) and a load-balanced ring over 4 context ranks (each depth's targets
read from the next chunks, models/objectives/mtp.py local_rows; all-to-all over 2 x data 2 behind -m slow): loss,
grad_norm (the modules' gradients in it: a wrong depth scale shows) and every parameter, the modules' included,
within 1e-5 after 3 SGD steps. Reading each chunk's shifts from the chunk alone fails the ring case (grad_norm 4.9%
off)."""
import pytest

from conftest import SGD, equals_one_device

MTP = SGD + ["model.mtp_depth=2", "model.mtp_weight=0.5", "data.document_mask=true", "model.loss_chunk=64"]


LAYOUTS = {"zero3_2x1x4": ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3"],
           "1f1b_1x4x2": ["mesh.data=1", "mesh.stage=4", "mesh.model=2", "model.n_layers=4", "train.microbatches=4",
                          "train.pipeline_schedule=1f1b"],
           # the shift across context ranks' chunks (load balanced: each rank two chunks) is the code under test
           "ring_balanced_context4": ["mesh.data=1", "mesh.stage=1", "mesh.model=1", "mesh.context=4",
                                      "train.context_attention=ring"],
           "a2a_context2_data2": ["mesh.data=2", "mesh.model=1", "mesh.context=2", "model.n_heads=8",
                                  "train.context_attention=all_to_all"],
           # accumulation over 2 microbatches (each depth's sums added, divided once over the step), remat of the
           # scanned layers
           "accum_remat_2x1x4": ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=2",
                                 "train.microbatches=2", "model.remat=full", "model.scan_layers=true"]}
DEFAULT = ("ring_balanced_context4",)  # the share of the default run; the rest behind -m slow


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k in DEFAULT else pytest.mark.slow)
                                    for k in LAYOUTS])
def test_layout_equals_one_device(layout):
    r, _ = equals_one_device(MTP + LAYOUTS[layout])
    assert set(r.params["mtp"]) >= {"enorm", "hnorm", "eh_proj", "post_norm"}
    assert r.params["mtp"]["eh_proj"].shape[0] == 2


@pytest.mark.slow
def test_bfloat16_trains_close_to_float32():
    """(2,1,4) ZeRO-3 computing in bfloat16 against one device in float32: loss and grad_norm within bfloat16's
    rounding (the modules' losses are in both)."""
    import numpy as np
    from conftest import run_steps, single_device
    over = MTP + LAYOUTS["zero3_2x1x4"]
    got = run_steps(over + ["train.dtype=bfloat16"])
    losses, _, norms = single_device(over)
    np.testing.assert_allclose(got.losses, losses, rtol=2e-3)
    np.testing.assert_allclose(got.grad_norms, norms, rtol=2e-2)
    assert not np.allclose(got.losses, losses, rtol=1e-6, atol=0)  # it did compute in bfloat16


def test_dpo_is_refused_in_one_line():
    from conftest import TINY
    from trainer.config import load_config, validate
    from trainer.errors import UserError
    with pytest.raises(UserError, match=r"^model.mtp_depth=2 with train.objective=dpo is not supported") as e:
        validate(load_config(TINY + MTP + ["train.objective=dpo", "model.init_from=/nonexistent"]), 8)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_deepseek_modules_with_the_experts_split_equal_one_device():
    """DeepSeek-V3 (1 dense + 3 MoE layers, the sequence-wise, load-balancing and z losses weighted in) with one
    module (an MoE layer with its own router bias) and packed documents, (2,1,4) ZeRO-3 with the experts split over
    data: against one device, the module's bias after the steps bitwise and moved."""
    import numpy as np
    from test_deepseek_train import DS, LAYOUTS as DS_LAYOUTS
    r, params = equals_one_device(DS + DS_LAYOUTS["zero3_ep_2x1x4"] + ["model.mtp_depth=1", "data.document_mask=true"])
    for k in ("layers", "mtp"):
        np.testing.assert_array_equal(r.params[k]["router_bias"], params[k]["router_bias"])
    assert np.abs(r.params["mtp"]["router_bias"]).max() > 0


def test_counts_and_the_planner_see_the_modules(capsys):
    """param_count is the initialized tree's size with the modules in it; the FLOPs per token grow by each module's
    layer, eh_proj and head (6 x their matmul weights + the layer's attention, written out here); `meshtrain plan`
    plans such a model (its memory check runs before every training start)."""
    import jax
    import numpy as np
    from flax import nnx
    from hf_check import cli
    from models import Transformer, from_preset, params_of
    from models.counts import flops_per_token, param_count
    c = from_preset("tiny", mtp_depth=2)
    shapes = jax.eval_shape(lambda: params_of(Transformer(c, rngs=nnx.Rngs(0))))
    assert param_count(c) == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    D, F, H, E, K, V, T = c.d_model, c.d_ff, c.n_heads, c.head_dim, c.n_kv_heads, c.vocab_size, c.seq_len
    layer = D * H * E * 2 + 2 * D * K * E + 3 * D * F  # q, o; k, v; gate, up, down
    module = 6 * (layer + 2 * D * D + D * V) + 6 * T * H * E  # the convention: 6 L T H Dh for attention
    plain = from_preset("tiny")
    assert abs(flops_per_token(c) - flops_per_token(plain) - 2 * module) < 1e-6 * flops_per_token(c)
    assert cli("plan", "model.preset=tiny", "model.mtp_depth=2") == 0
    assert "activations" in capsys.readouterr().out
