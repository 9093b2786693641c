"""LoRA against peft, the figures the tests bound: each peft-made adapter's largest logit difference from peft's
(short and 420-token prompt) read into meshtrain (1 device; the Mixtral's on (2,1,4) ZeRO-3 with the experts split),
and the DPO-with-LoRA second step against TRL's (docs/lora.md).
    .venv/bin/python scripts/bench/lora_figures.py  (from the repo root)"""
import sys
sys.path.insert(0, "tests")
import conftest  # noqa: F401,E402  (8 devices)
import numpy as np  # noqa: E402
from test_lora_peft import EXPERT_TARGETS, FIX, LORA, _logits  # noqa: E402

MIX = FIX.parent / "hf" / "mixtral_e4k2_f32"
EP = ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3", "train.expert_parallel=true"]
CASES = {"peft_r4": [], "peft_r4_rslora": ["model.lora.use_rslora=true"],
         "peft_r4_lm_head": ["model.lora.modules=[lm_head,embed_tokens]"]}
for name, more in CASES.items():
    ref = np.load(FIX / name / "reference.npz")
    short, long = _logits([f"model.init_from={FIX / 'llama_base'}", *LORA, *more, f"model.lora.init_from={FIX / name}"],
                          ref)
    print(f"{name} (1 device): short {np.abs(short - ref['logits']).max():.2e} "
          f"long {np.abs(long - ref['long_logits']).max():.2e} (the adapter moves them {float(ref['moved']):.3f})")
for name, targets, more in (("peft_mixtral_r4", "", []), ("peft_mixtral_experts_r4", EXPERT_TARGETS, []),
                            ("peft_mixtral_fused_r4", EXPERT_TARGETS, ["model.lora.fused_gate_up=true"])):
    ref = np.load(FIX / name / "reference.npz")
    short, long = _logits([f"model.init_from={MIX}", "model.lora.rank=4", "model.lora.alpha=8",
                           f"model.lora.targets=[q_proj,k_proj,v_proj,o_proj{targets}]",
                           f"model.lora.init_from={FIX / name}", *more], ref, EP)
    print(f"{name} ((2,1,4) ZeRO-3, experts split): short {np.abs(short - ref['logits']).max():.2e} "
          f"long {np.abs(long - ref['long_logits']).max():.2e}")
