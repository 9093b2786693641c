"""Build tests/fixtures/dpo/: a policy and a different reference (tiny LlamaForCausalLMs sharing the generate fixture's
tokenizer and chat template), preference pairs as text and as conversations, and what TRL's DPOTrainer makes of them:
each pair's prompt_ids, chosen_ids and rejected_ids (after its truncation rules, fully truncated pairs dropped), and
for each loss variant one step at learning rate 0: its loss and every metric it logs.

TRL, transformers and torch are not meshtrain dependencies: install them once in a separate venv and run
    /path/to/trl-venv/bin/python scripts/make_dpo_fixture.py [--out tests/fixtures/dpo]
(made with torch 2.13.0 CPU, transformers 5.25.0, trl 1.16.0: versions.json). Tests read only the files written.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "dpo"
TOKENIZER = ROOT / "tests" / "fixtures" / "generate"
MAX_LENGTH = 48
BETA = 0.1
VARIANTS = {  # name: DPOConfig arguments
    "sigmoid": dict(loss_type=["sigmoid"]),
    "ipo": dict(loss_type=["ipo"]),
    "hinge": dict(loss_type=["hinge"]),
    "robust": dict(loss_type=["robust"], label_smoothing=0.1),
    "sigmoid_sft": dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
}
TEXT = [
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Berlin, of course."},
    {"prompt": "Two plus two equals", "chosen": " four", "rejected": " five"},
    {"prompt": "Name a prime number:", "chosen": " 7 is prime.", "rejected": " 9"},
    {"prompt": "Write a short greeting.", "chosen": " Hello there, nice to meet you and welcome to the team; we are "
     "glad you are here and hope you enjoy the work.", "rejected": " Go away."},  # truncated at MAX_LENGTH
    {"prompt": "A prompt so long that it fills the whole sequence by itself and leaves no room at all for either "
     "completion, so the pair is dropped before training starts, as its prompt alone reaches the maximum length.",
     "chosen": " yes", "rejected": " no"},  # fully truncated: dropped
]
CHAT = [
    {"prompt": [{"role": "user", "content": "What is 3 times 3?"}],
     "chosen": [{"role": "assistant", "content": "It is 9."}],
     "rejected": [{"role": "assistant", "content": "It is 6, I think."}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
     "chosen": [{"role": "assistant", "content": "Hi!"}],
     "rejected": [{"role": "assistant", "content": "Hello, how are you doing today?"}]},
    {"prompt": [{"role": "user", "content": "Colour of the sky?"}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "At night?"}],
     "chosen": [{"role": "assistant", "content": "Dark, nearly black."}],
     "rejected": [{"role": "assistant", "content": "Green."}]},
]


def models(out: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig.from_pretrained(TOKENIZER)
    cfg.initializer_range = 0.2  # log-probabilities far from uniform, so every loss term moves
    for name, seed in (("policy", 1), ("reference", 2)):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(torch.float32)
        model.save_pretrained(out / name)
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(TOKENIZER / f, out / name / f)


def run(out: Path, records: list, variant: dict) -> tuple[dict, list]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer
    tok = AutoTokenizer.from_pretrained(out / "policy")
    policy = LlamaForCausalLM.from_pretrained(out / "policy", dtype=torch.float32)
    ref = LlamaForCausalLM.from_pretrained(out / "reference", dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, learning_rate=0.0, per_device_train_batch_size=len(records), max_steps=1,
                         max_length=MAX_LENGTH, beta=BETA, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                         bf16=False, save_strategy="no", **variant)
        trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tok)
        trainer.train()
        logged = trainer.state.log_history[0]
        ids = [{k: list(map(int, r[k])) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
               for r in trainer.train_dataset]
    return {k: float(v) for k, v in logged.items() if isinstance(v, (int, float))}, ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(OUT))
    out = Path(ap.parse_args().out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    models(out)
    reference = {"max_length": MAX_LENGTH, "beta": BETA, "variants": VARIANTS}
    for name, records in (("text", TEXT), ("chat", CHAT)):
        (out / f"pairs_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        reference[name] = {}
        for v, kw in VARIANTS.items():
            metrics, ids = run(out, records, kw)
            reference[name][v] = metrics
            reference[name]["tokens"] = ids
    (out / "reference.json").write_text(json.dumps(reference, indent=1))
    import torch
    import transformers
    import trl
    (out / "versions.json").write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                                   "trl": trl.__version__}))


if __name__ == "__main__":
    main()
