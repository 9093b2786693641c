"""Expert parallelism (train.expert_parallel): an MoE's experts split over `data`, each rank's tokens sent to the
ranks holding their experts (dropless: gathered and the results reduce-scattered; with a capacity: all-to-all in
per-row slots). Every layout against one device (SGD, no clipping; loss, grad_norm, aux/... and moe/dropped,
parameters); the compiled program (no expert weight gathered or reduced over `data`; each rank holds 1/data of
them); the one-line errors."""
import pytest
from conftest import SGD, TINY
from test_moe import same_as_one_device

E = 8  # experts: divisible by every mesh.data below
MOE = SGD + ["model.family=mixtral", f"model.n_experts={E}", "model.expert_d_ff=32", "model.router_aux_loss=0.1",
             "model.router_z_loss=0.01"]
CAPACITY = ("model.capacity_factor=1.0",)
ONE = ("mesh.data=1", "mesh.stage=1", "mesh.model=1")
LAYOUTS = {
    "(4,1,2) ZeRO-3 dropless": ((), ("mesh.data=4", "mesh.stage=1", "mesh.model=2", "train.zero_stage=3")),
    "(2,4,1) 1F1B capacity": (CAPACITY + ("model.n_layers=4",),
                              ("mesh.data=2", "mesh.stage=4", "mesh.model=1", "train.microbatches=4",
                               "train.pipeline_schedule=1f1b")),
}
SLOW = {
    "(8,1,1) ZeRO-0 dropless": ((), ("mesh.data=8", "mesh.stage=1", "mesh.model=1")),
    "(8,1,1) ZeRO-0 capacity": (CAPACITY, ("mesh.data=8", "mesh.stage=1", "mesh.model=1")),
    "(4,1,2) ZeRO-3 capacity": (CAPACITY, LAYOUTS["(4,1,2) ZeRO-3 dropless"][1]),
    "(2,4,1) 1F1B dropless": (("model.n_layers=4",), LAYOUTS["(2,4,1) 1F1B capacity"][1]),
    "(2,2,2) interleaved V=2 dropless": (("model.n_layers=4",),
                                         ("mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.microbatches=2",
                                          "train.pipeline_schedule=interleaved_1f1b", "train.pipeline_repeats=2")),
    "(2,2,2) interleaved V=2 capacity": (CAPACITY + ("model.n_layers=4",),
                                         ("mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.microbatches=2",
                                          "train.pipeline_schedule=interleaved_1f1b", "train.pipeline_repeats=2")),
    "(4,1,2) psum M=2 dropless": ((), ("mesh.data=4", "mesh.stage=1", "mesh.model=2", "train.grad_sync=psum",
                                       "train.microbatches=2")),
    "(4,1,2) psum M=2 capacity": (CAPACITY, ("mesh.data=4", "mesh.stage=1", "mesh.model=2", "train.grad_sync=psum",
                                             "train.microbatches=2")),
}
ROUTER_SCALE = 20.0  # the router's weights x20: top-k margins far above the layouts' float differences


def _same_as_one_device(model, layout):
    same_as_one_device(model, layout, base=tuple(MOE), router_scale=ROUTER_SCALE, split=True)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_one_device(name):
    _same_as_one_device(*LAYOUTS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_more_layouts_equal_one_device(name):
    _same_as_one_device(*SLOW[name])


@pytest.mark.parametrize("keys,message", [
    (["model.n_experts=6", "mesh.data=4", "mesh.model=2", "train.expert_parallel=true"],
     r"^train.expert_parallel=true: model.n_experts=6 is not divisible by mesh.data=4 \(each data rank holds "
     r"n_experts / mesh.data experts\); set train.expert_parallel=false \(experts replicated\)$"),
    (["mesh.data=8", "train.expert_parallel=true", "train.sync=local_sgd", "train.sync_every=2"],
     r"^train.expert_parallel=true: train.sync=local_sgd keeps a whole replica on every data rank, and an "
     r"expert-parallel rank holds only its experts; set train.expert_parallel=false \(experts replicated\)$"),
])
def test_bad_input_is_one_line(keys, message):
    from trainer.config import load_config, validate
    from trainer.errors import UserError
    with pytest.raises(UserError, match=message):
        validate(load_config(TINY + MOE + keys), 8)


def test_on_by_default_where_the_experts_divide_and_off_with_one_line_where_not(caplog):
    from trainer.config import expert_parallel, load_config
    assert expert_parallel(load_config(TINY + MOE + ["mesh.data=8"]), 8)
    assert not expert_parallel(load_config(TINY + MOE + ["mesh.data=8", "train.expert_parallel=false"]), 8)
    assert not expert_parallel(load_config(TINY + MOE + ["mesh.data=1"]), 1)
    with caplog.at_level("WARNING"):
        assert not expert_parallel(load_config(TINY + MOE + ["model.n_experts=6", "mesh.data=4"]), 4)
    assert "expert parallelism off: model.n_experts=6 is not divisible by mesh.data=4" in caplog.text
