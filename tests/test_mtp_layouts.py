"""Multi-token prediction (model.mtp_depth) trained on a layout against one device: 2 modules on the tiny Llama at
weight 0.5, packed documents and the tiled loss, (2,1,4) ZeRO-3 with tensor parallelism (and (1,4,2) 1F1B, the modules
on the last stage with the head, behind -m slow) and a load-balanced ring over 4 context ranks (each depth's targets
read from the next chunks, models/objectives/mtp.py local_shifted; all-to-all over 2 x data 2 behind -m slow): loss,
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
                                  "train.context_attention=all_to_all"]}
DEFAULT = ("ring_balanced_context4",)  # the share of the default run; the rest behind -m slow


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k in DEFAULT else pytest.mark.slow)
                                    for k in LAYOUTS])
def test_layout_equals_one_device(layout):
    r, _ = equals_one_device(MTP + LAYOUTS[layout])
    assert set(r.params["mtp"]) >= {"enorm", "hnorm", "eh_proj", "post_norm"}
    assert r.params["mtp"]["eh_proj"].shape[0] == 2


def test_dpo_is_refused_in_one_line():
    from conftest import TINY
    from trainer.config import load_config, validate
    from trainer.errors import UserError
    with pytest.raises(UserError, match=r"^model.mtp_depth=2 with train.objective=dpo is not supported") as e:
        validate(load_config(TINY + MTP + ["train.objective=dpo", "model.init_from=/nonexistent"]), 8)
    assert "\n" not in str(e.value)
