"""Build tests/fixtures/dpo_lora/: TRL 1.16's DPOTrainer given a seeded peft LoraConfig on the DPO fixture's policy
(tests/fixtures/dpo/policy, no reference model: TRL's reference is then the policy with the adapters off), SGD at a
constant learning rate, no clipping, every text pair in each batch, 2 steps: the adapter as TRL starts it (saved
before training: A random, B zero) and every metric TRL logs at each step. TRL, peft, transformers and torch are not
meshtrain dependencies: run it in their venv,
    /path/to/venv/bin/python scripts/make_dpo_lora_fixture.py
(tests read only the files written: reference.json, initial_adapter/)."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaForCausalLM
from trl import DPOConfig, DPOTrainer

ROOT = Path(__file__).resolve().parents[1]
DPO = ROOT / "tests" / "fixtures" / "dpo"
OUT = ROOT / "tests" / "fixtures" / "dpo_lora"
LR, STEPS, RANK, ALPHA, TARGETS = 0.5, 2, 4, 8, ["q_proj", "v_proj", "o_proj"]


def main():
    ref = json.loads((DPO / "reference.json").read_text())
    records = [json.loads(line) for line in (DPO / "pairs_text.jsonl").read_text().splitlines()]
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(DPO / "policy")
    policy = LlamaForCausalLM.from_pretrained(DPO / "policy", dtype=torch.float32)
    peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                         optim="sgd", max_grad_norm=0.0, weight_decay=0.0, per_device_train_batch_size=len(records),
                         max_steps=STEPS, max_length=ref["max_length"], beta=ref["beta"], logging_steps=1,
                         report_to=[], use_cpu=True, seed=0, bf16=False, save_strategy="no", loss_type=["sigmoid"])
        trainer = DPOTrainer(model=policy, ref_model=None, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tok, peft_config=peft_config)
        trainer.model.save_pretrained(OUT / "initial_adapter")
        trainer.train()
        logs = [{k: float(v) for k, v in e.items() if isinstance(v, (int, float))}
                for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == STEPS, logs
    assert abs(logs[1]["loss"] - logs[0]["loss"]) > 1e-3, "the second step's loss does not move"
    (OUT / "reference.json").write_text(json.dumps({"lr": LR, "rank": RANK, "alpha": ALPHA, "targets": TARGETS,
                                                    "steps": logs}, indent=1) + "\n")
    import peft
    import transformers
    import trl
    (OUT / "versions.json").write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                                   "trl": trl.__version__, "peft": peft.__version__}) + "\n")
    print(logs)


if __name__ == "__main__":
    main()
