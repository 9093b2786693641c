"""Training gpt-oss (models/families/gpt_oss.py) on a layout against one device, packed documents, SGD without
clipping: loss, grad_norm and every parameter (sinks, biases, router and experts) within 1e-5 after 3 steps.
(2,1,4) ZeRO-3 with the experts split over data runs the explicit step, each rank's objective on its rows: the
pooled balancing loss (model.router_aux_loss) weighted in there too (its choices summed over the ranks,
models/families/gpt_oss.py balance_term); the (1,4,2) 1F1B pipeline and context parallelism over 4 balanced ranks
(each attention: the sinks join each row's softmax once) behind -m slow."""
import pytest

from conftest import SGD, equals_one_device

GO = ["model.family=gpt_oss", "model.n_layers=4", "model.n_experts=8", "model.n_experts_per_token=2",
      "model.expert_d_ff=32", "model.window=8", "model.local_layers=[true,false,true,false]", "model.yarn_factor=4",
      "model.yarn_original=16", "model.yarn_truncate=false", "model.swiglu_limit=1.0", "model.tie_embeddings=false",
      "model.router_z_loss=0.001", "data.document_mask=true", "train.batch_size=8"] + SGD
LAYOUTS = {
    "zero3_ep_2x1x4": ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3",
                       "train.expert_parallel=true", "model.router_aux_loss=0.05"],
    # a capacity: each rank's kept choices in fixed slots, all-to-all to the experts' ranks (the biases there too)
    "capacity_ep_2x1x4": ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3",
                          "train.expert_parallel=true", "model.capacity_factor=1.0"],
    "1f1b_1x4x2": ["mesh.data=1", "mesh.stage=4", "mesh.model=2", "train.microbatches=4",
                   "train.pipeline_schedule=1f1b"],
    "ring_context4": ["mesh.data=2", "mesh.stage=1", "mesh.model=1", "mesh.context=4", "train.context_attention=ring"],
    "gather_context4": ["mesh.data=2", "mesh.stage=1", "mesh.model=1", "mesh.context=4",
                        "train.context_attention=all_gather"],
    "a2a_context4": ["mesh.data=2", "mesh.stage=1", "mesh.model=1", "mesh.context=4",
                     "train.context_attention=all_to_all"],
}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k == "zero3_ep_2x1x4" else pytest.mark.slow)
                                    for k in LAYOUTS])
def test_layout_equals_one_device(layout):
    # the default run's case on one sliding and one full layer, 2 steps (its share of the suite)
    short = ["model.n_layers=2", "model.local_layers=[true,false]"] if layout == "zero3_ep_2x1x4" else []
    r, _ = equals_one_device(GO + LAYOUTS[layout] + short, steps=2 if short else 3)
    assert {"sinks", "bo", "b_router", "b_gate_up", "b_down"} <= set(r.params["layers"])
