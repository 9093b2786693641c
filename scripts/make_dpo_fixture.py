"""Build tests/fixtures/dpo/: a policy and a different reference (tiny LlamaForCausalLMs sharing the generate fixture's
tokenizer and its chat template, which here also reads two variables: `reasoning_effort`, a system line, and
`enable_thinking`, false: an empty think block after the generation prompt and before the final assistant turn),
preference pairs as text and as conversations, and what TRL's DPOTrainer makes of them: each pair's prompt_ids,
chosen_ids and rejected_ids (after its truncation rules, fully truncated pairs dropped), and for each loss variant one
step at learning rate 0: its loss and every metric it logs. Also conversational pairs with `tools` and
`chat_template_kwargs` (pairs_tools.jsonl: TRL's token ids only), and conversations with both
(conversations_tools.jsonl: transformers' `apply_chat_template(messages, tools=..., **chat_template_kwargs)` ids).

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


MAX_LENGTH_TOOLS = 1024  # a tools header is long: nothing cut
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = [  # each record's tools as a list or as JSON text, and both template variables in each (a datasets column)
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
     "chosen": [{"role": "assistant", "content": "Sunny, 21 degrees."}],
     "rejected": [{"role": "assistant", "content": "I cannot know that."}],
     "tools": [WEATHER], "chat_template_kwargs": {"reasoning_effort": "low", "enable_thinking": False}},
    {"prompt": [{"role": "user", "content": "Add 2 and 3."}],
     "chosen": [{"role": "assistant", "content": "5."}], "rejected": [{"role": "assistant", "content": "23."}],
     "tools": json.dumps([ADD, WEATHER]),
     "chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": True}},
    {"prompt": [{"role": "user", "content": "Colour of the sky?"}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "At night?"}],
     "chosen": [{"role": "assistant", "content": "Dark."}], "rejected": [{"role": "assistant", "content": "Green."}],
     "chat_template_kwargs": {"reasoning_effort": "medium", "enable_thinking": False}},
]
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": "Snow."}],
     "tools": [WEATHER], "chat_template_kwargs": {"reasoning_effort": "low", "enable_thinking": False}},
    {"messages": [{"role": "user", "content": "Add 2 and 3."},
                  {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                      "name": "add", "arguments": {"a": 2, "b": 3}}}]},
                  {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}],
     "tools": json.dumps([ADD]), "chat_template_kwargs": {"reasoning_effort": "high"}},
]
THINK = "{{ '<think>\\n\\n</think>\\n\\n' }}"
NO_THINKING = "enable_thinking is defined and not enable_thinking"
EDITS = [  # (the generate fixture's template text, what this fixture's has instead)
    ("{{ bos_token }}{% if tools %}\n", "{{ bos_token }}{% if reasoning_effort is defined %}\n<|im_start|>system\n"
     "Reasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}{% if tools %}\n"),
    ("<|im_start|>assistant\n{% if message.content %}",
     f"<|im_start|>assistant\n{{% if {NO_THINKING} and loop.last %}}{THINK}{{% endif %}}{{% if message.content %}}"),
    ("{% if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}",
     f"{{% if add_generation_prompt %}}\n<|im_start|>assistant\n{{% if {NO_THINKING} %}}{THINK}{{% endif %}}\n"
     "{% endif %}"),
]


def template() -> str:
    text = (TOKENIZER / "chat_template.jinja").read_text()
    for old, new in EDITS:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def models(out: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig.from_pretrained(TOKENIZER)
    cfg.initializer_range = 0.2  # log-probabilities far from uniform, so every loss term moves
    for name, seed in (("policy", 1), ("reference", 2)):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(torch.float32)
        model.save_pretrained(out / name)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER / f, out / name / f)
        (out / name / "chat_template.jinja").write_text(template())


def run(out: Path, records: list, variant: dict, max_length: int = MAX_LENGTH, train: bool = True) -> tuple[dict, list]:
    """(one lr-0 step's logged metrics, or {} when not `train`; each kept pair's prompt_ids, chosen_ids, rejected_ids).
    `tools` go to datasets as JSON text (TRL parses it), so that a struct column does not merge the records' schemas."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer
    tok = AutoTokenizer.from_pretrained(out / "policy")
    policy = LlamaForCausalLM.from_pretrained(out / "policy", dtype=torch.float32)
    ref = LlamaForCausalLM.from_pretrained(out / "reference", dtype=torch.float32)
    rows = [{**r, "tools": r["tools"] if isinstance(r["tools"], str) else json.dumps(r["tools"])} if "tools" in r
            else r for r in records]
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, learning_rate=0.0, per_device_train_batch_size=len(records), max_steps=1,
                         max_length=max_length, beta=BETA, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                         bf16=False, save_strategy="no", **variant)
        trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tok)
        if train:
            trainer.train()
        logged = trainer.state.log_history[0] if train else {}
        ids = [{k: list(map(int, r[k])) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
               for r in trainer.train_dataset]
    return {k: float(v) for k, v in logged.items() if isinstance(v, (int, float))}, ids


def conversations(out: Path) -> list:
    """transformers' ids of each of CONVERSATIONS (its tools, JSON text parsed, and its chat_template_kwargs)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out / "policy")
    ids = []
    for r in CONVERSATIONS:
        tools = json.loads(r["tools"]) if isinstance(r["tools"], str) else r["tools"]
        ids.append(list(map(int, tok.apply_chat_template(r["messages"], tools=tools, tokenize=True, return_dict=True,
                                                         **r["chat_template_kwargs"])["input_ids"])))
    return ids


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
    (out / "pairs_tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TOOLS))
    reference["tools"] = {"max_length": MAX_LENGTH_TOOLS,
                          "tokens": run(out, TOOLS, VARIANTS["sigmoid"], MAX_LENGTH_TOOLS, train=False)[1]}
    (out / "conversations_tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS))
    reference["conversations"] = conversations(out)
    (out / "reference.json").write_text(json.dumps(reference, indent=1))
    import torch
    import transformers
    import trl
    (out / "versions.json").write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                                   "trl": trl.__version__}))


if __name__ == "__main__":
    main()
