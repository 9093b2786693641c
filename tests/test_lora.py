"""LoRA (models/lora.py): adapters on a frozen base trained on a layout against one device (SGD without clipping:
loss, grad_norm and every parameter, the adapters', within 1e-5), the base bit for bit what it was."""
import numpy as np
import pytest

from conftest import SGD, TINY, equals_one_device, run_steps

LORA = TINY + SGD + ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,v_proj,o_proj,down_proj]",
                     "data.document_mask=true", "model.tie_embeddings=false"]
LAYOUTS = {"zero3_2x1x4": ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3"],
           "1f1b_1x4x2": ["mesh.data=1", "mesh.stage=4", "mesh.model=2", "model.n_layers=4", "train.microbatches=4",
                          "train.pipeline_schedule=1f1b"],
           "context2_2x1x2": ["mesh.data=2", "mesh.stage=1", "mesh.model=2", "mesh.context=2",
                              "train.context_attention=ring"]}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k == "zero3_2x1x4" else pytest.mark.slow)
                                    for k in LAYOUTS])
def test_layout_equals_one_device_and_the_base_stays(layout):
    over = LORA + LAYOUTS[layout]
    r, _ = equals_one_device(over)
    start = run_steps(over + ["train.lr=0"], steps=1).params  # the same initial state, not moved
    for k, v in r.params["layers"].items():
        if k.endswith(("_lora_a", "_lora_b")):
            continue
        np.testing.assert_array_equal(v, start["layers"][k], err_msg=k)
    for k in ("embed", "final_norm", "lm_head"):
        np.testing.assert_array_equal(r.params[k], start[k], err_msg=k)
    moved = np.abs(r.params["layers"]["wq_lora_b"]).max()
    assert moved > 0  # B left zero at the start, trained


@pytest.mark.parametrize("keys,message", [
    (["model.lora.targets=[q_proj,qkv_proj]"], r"^model.lora.targets names qkv_proj, which llama has not; its "
     r"projections: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj \(or all-linear\)$"),
    (["model.lora.rank=65"], r"^model.lora.rank=65 exceeds the smallest adapted projection's width 32; use a rank "
     r"of at most 32$"),
    (["model.lora.rank=-1"], r"^model.lora.rank=-1"),
    (["model.lora.dropout=0.1"], r"^model.lora.dropout=0.1 is not supported yet; set 0$"),
    (["model.lora.rank=0", "model.lora.init_from=/some/adapter"], r"^model.lora.init_from=/some/adapter with "
     r"model.lora.rank=0 \(no adapters\); set model.lora.rank to the adapter's r$"),
])
def test_bad_lora_input_is_one_line(keys, message):
    from trainer.config import load_config, validate
    from trainer.errors import UserError
    with pytest.raises(UserError, match=message) as e:
        validate(load_config(TINY + ["model.lora.rank=4"] + keys), 8)
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_the_7b_lora_step_on_tpu_holds_at_most_half_of_full_fine_tuning():
    """XLA:TPU's per-chip bytes (arguments + temp) of the 7B's step on v5p:2x2x2, ZeRO-3 over 8 chips, batch 8 x 4096,
    bfloat16, full remat: LoRA of rank 16 on every projection (the base float32, as full fine-tuning's weights) at most
    half of full fine-tuning's (docs/lora.md quotes both)."""
    from trainer.config import load_config
    from trainer.plan.aot import compile_for
    base = ["model.preset=7b", "model.remat=full", "train.zero_stage=3", "mesh.data=8", "train.batch_size=8",
            "train.dtype=bfloat16"]
    full = compile_for(load_config(base), "v5p:2x2x2")
    lora = compile_for(load_config(base + ["model.lora.rank=16", "model.lora.targets=[all-linear]"]), "v5p:2x2x2")
    print(f"per chip: full fine-tuning {full.total_bytes:,}, LoRA {lora.total_bytes:,}")
    assert lora.total_bytes <= 0.5 * full.total_bytes


def test_the_plan_shows_the_saving_against_full_fine_tuning(capsys):
    """`meshtrain plan` of a LoRA run: no gradient or optimizer state for the base (the adapters' only), and full
    fine-tuning's state of the same layout beside it (parameters + gradients + two Adam moments)."""
    import json
    from trainer.cli import main
    assert main(["plan", *TINY, "model.lora.rank=4", "model.lora.targets=[all-linear]", "mesh.data=8",
                 "train.zero_stage=3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    p = got.get("predicted", got)
    full = p["full_finetune_state_bytes"]
    assert p["grads_bytes"] < p["params_bytes"] / 10 and p["opt_state_bytes"] < p["params_bytes"] / 5
    assert full > 3.5 * p["params_bytes"]  # each weight's float32 value, gradient and two moments, sharded 8 ways
    assert p["params_bytes"] + p["grads_bytes"] + p["opt_state_bytes"] < 0.35 * full


@pytest.mark.slow  # a compile of the small preset's step per layout (the default suite's share: docs/lora.md)
@pytest.mark.parametrize("layout", [
    ["train.zero_stage=3"],
    ["train.zero_stage=1"],  # the merged weights kept as buffers, not gathered
    ["train.zero_stage=3", "model.remat=full"]])
def test_the_planned_lora_step_is_xla_s_within_ten_percent(layout):
    """The planner's scratch (activations + gradients + buffers) of a LoRA step against XLA:CPU's compiled step
    (model.preset=small, (2,1,4), rank 8 on every projection). Measured (cpu family 25): ZeRO-3 +9.5%, ZeRO-1 +8.1%,
    ZeRO-3 with full remat +12.2% (remat's recomputation is estimated for full fine-tuning too: -7.0% there);
    before the merged weights were counted once, ZeRO-3 was +21.6%."""
    from trainer.config import load_config, model_config
    from trainer.hardware import get_device
    from trainer.plan.core import estimate, strategy_of
    from trainer.plan.verify import measure
    cfg = load_config(["model.preset=small", "mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.batch_size=8",
                       "model.lora.rank=8", "model.lora.targets=[all-linear]", *layout])
    plan = estimate(model_config(cfg), cfg.train, strategy_of(cfg, 8), get_device("h100-80g"), 1, "float32", None)
    pred = plan.activations_bytes + plan.grads_bytes + plan.buffers_bytes
    xla = measure(cfg, grads=False).temp_bytes
    limit = 0.13 if "model.remat=full" in layout else 0.10
    assert abs(pred / xla - 1) < limit, (pred, xla)
