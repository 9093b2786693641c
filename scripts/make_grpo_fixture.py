"""Build tests/fixtures/grpo/ from TRL's own GRPOTrainer (needs torch, transformers and trl 1.16: none is a meshtrain
dependency; install them in a separate venv, as for scripts/make_peft_fixture.py, and run
    python scripts/make_grpo_fixture.py).

TRL trains `policy/` (tests/fixtures/generate's tiny Llama shape and tokenizer, tied embeddings, a vocabulary of 1028
so that 4 model ranks split it, weights drawn from a seed) on CPU without vLLM. Completions are
not sampled: a `rollout_func` returns recorded token ids (`completions.json`: for each prompt, G completions, some
ending in EOS, some cut at max_completion_length), so that meshtrain can learn from the same ones. Settings: SGD,
constant learning rate, no clipping (max_grad_norm=0), temperature 0.7, 4 prompts x G=3 completions per generation,
per-device batch 6 and gradient_accumulation_steps=2 (two microbatches per optimizer step), num_iterations=2 (the
second optimizer step relearns the same completions: its ratios differ from 1), two reward functions with weights.
For beta > 0 the trainer's reference model is swapped for `reference/` (the same model with its weights moved by
seeded noise), so that the KL is not 0 at iteration 1.

Per variant (loss_type x beta x mask_truncated_completions), `<variant>.npz` holds what TRL's `_compute_loss` received
and computed for each of its four calls (step 1 and 2, microbatch 0 and 1: `s{step}m{mb}_<name>`: prompt_ids,
prompt_mask, completion_ids, completion_mask, advantages, old/ref per-token log-probabilities where TRL has them, its
own per-token log-probabilities, num_items_in_batch, the returned loss), the rewards each function gave, each step's
logged metrics (`log{step}_<metric>`), and the gradient of step 1 as SGD applies it (read before the optimizer step):
its global norm and the first layer's q_proj.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from datasets import Dataset
from transformers import AutoTokenizer, LlamaForCausalLM

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
import trl  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GEN = ROOT / "tests" / "fixtures" / "generate"
PROMPTS = ["The quick brown", "def add(a, b):", "import os\nimport sys\n", "Once upon a time, in a land"]
G, MAX_LEN, LR = 3, 12, 0.05
WEIGHTS = [1.0, 0.5]


def completions(tok, eos: int) -> dict:
    """For each prompt, G completions of random token ids: the first of each group ends with EOS (a short one), the
    second is cut at MAX_LEN without EOS, the third ends with EOS at MAX_LEN or before."""
    rng = np.random.default_rng(11)
    out = {}
    for p in PROMPTS:
        group = []
        for g in range(G):
            n = [int(rng.integers(3, 8)), MAX_LEN, int(rng.integers(8, MAX_LEN + 1))][g]
            ids = [int(x) for x in rng.integers(5, 1000, size=n)]
            if g != 1:
                ids[-1] = eos
            group.append(ids)
        out[p] = group
    return out


def policy(out: Path):
    """policy/: tests/fixtures/generate's Llama shape and tokenizer with a vocabulary of 1028 (its 1025 ids and 3
    unused: 1028 splits over 4 model ranks), drawn by transformers from a seed."""
    cfg = LlamaForCausalLM.from_pretrained(GEN).config
    cfg.vocab_size = 1028
    torch.manual_seed(21)
    shutil.rmtree(out / "policy", ignore_errors=True)
    LlamaForCausalLM(cfg).save_pretrained(out / "policy")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (GEN / f).exists():
            shutil.copy(GEN / f, out / "policy" / f)


def count_a(completions, **kw):
    return [float(c.count("a")) / 4.0 for c in completions]


def even_length(completions, **kw):
    return [1.0 if len(c) % 2 == 0 else -0.5 for c in completions]


def run(variant: dict, recorded: dict, reference: Path, out: Path):
    tok = AutoTokenizer.from_pretrained(GEN)
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(out / "policy", dtype=torch.float32)
    seen = {}

    def rollout(prompts, trainer):
        counts: dict = {}
        prompt_ids, completion_ids = [], []
        for p in prompts:
            k = counts.get(p, 0)
            counts[p] = k + 1
            prompt_ids.append(tok(p, add_special_tokens=False)["input_ids"])
            completion_ids.append(recorded[p][k % G])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[0.0] * len(c) for c in completion_ids]}

    args = GRPOConfig(output_dir=str(out / "tmp"), per_device_train_batch_size=6, gradient_accumulation_steps=2,
                      num_generations=G, max_completion_length=MAX_LEN, temperature=0.7, num_iterations=2,
                      optim="sgd", learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, max_steps=2,
                      logging_steps=1, save_strategy="no", report_to=[], seed=3, use_cpu=True, bf16=False,
                      reward_weights=WEIGHTS, epsilon=0.2, epsilon_high=0.28, **variant)
    trainer = GRPOTrainer(model=model, reward_funcs=[count_a, even_length], args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=tok,
                          rollout_func=rollout)
    if variant["beta"]:  # patched as GRPOTrainer patches its own reference (log-probabilities at the temperature)
        from trl.trainer.utils import add_fused_lm_head
        trainer.ref_model = LlamaForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
        add_fused_lm_head(trainer.ref_model, temperature=args.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
    calls, rewards = [], []
    inner_loss, inner_rewards = trainer._compute_loss, trainer._calculate_rewards

    def compute_loss(model, inputs):
        got = {}
        orig = trainer._get_per_token_logps_and_entropies

        def logps(*a, **kw):
            r = orig(*a, **kw)
            got["per_token_logps"] = r[0].detach().numpy()
            got["entropies"] = r[1].detach().numpy()
            return r
        trainer._get_per_token_logps_and_entropies = logps
        try:
            loss = inner_loss(model, inputs)
        finally:
            trainer._get_per_token_logps_and_entropies = orig
        keep = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_per_token_logps",
                "ref_per_token_logps", "num_items_in_batch")
        got.update({k: inputs[k].detach().numpy() for k in keep if inputs.get(k) is not None})
        got["loss"] = np.float64(loss.item())
        calls.append(got)
        return loss

    def calc_rewards(*a, **kw):
        r = inner_rewards(*a, **kw)
        rewards.append(r.detach().numpy())
        return r
    trainer._compute_loss, trainer._calculate_rewards = compute_loss, calc_rewards
    grads = {}

    class Step1Gradient(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if state.global_step == 0:  # the first optimizer step's gradient, as SGD is about to apply it
                grads.update({k: v.grad.detach().numpy().copy() for k, v in model.named_parameters()})
    trainer.add_callback(Step1Gradient())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(calls) == 4 and len(logs) == 2 and grads, (len(calls), len(logs), len(grads))
    arrays = {f"s{i // 2 + 1}m{i % 2}_{k}": v for i, c in enumerate(calls) for k, v in c.items()}
    for step, h in enumerate(logs, 1):
        arrays.update({f"log{step}_{k}": np.float64(v) for k, v in h.items() if isinstance(v, (int, float))})
    arrays["rewards_per_func"] = np.concatenate(rewards)
    arrays["grad_norm"] = np.float64(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values())))
    arrays["grad_q0"] = grads["model.layers.0.self_attn.q_proj.weight"]
    name = f"{variant['loss_type']}_beta{variant['beta']}_mask{int(variant['mask_truncated_completions'])}"
    np.savez_compressed(out / f"{name}.npz", **arrays)
    region = logs[1].get("clip_ratio/region_mean")
    print(f"{name}: loss {logs[0]['loss']:.6f} -> {logs[1]['loss']:.6f}, clip region at iteration 2 {region}, "
          f"grad norm {float(arrays['grad_norm']):.5f}")
    shutil.rmtree(out / "tmp", ignore_errors=True)
    return region


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "grpo"))
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(GEN)
    eos = int(LlamaForCausalLM.from_pretrained(GEN).config.eos_token_id)
    recorded = completions(tok, eos)
    (out / "completions.json").write_text(json.dumps({"prompts": PROMPTS, "completions": recorded, "G": G,
                                                      "max_completion_length": MAX_LEN, "lr": LR,
                                                      "reward_weights": WEIGHTS}, indent=1) + "\n")
    policy(out)
    ref = LlamaForCausalLM.from_pretrained(out / "policy", dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.005 * torch.randn(p.shape, generator=g))
    shutil.rmtree(out / "reference", ignore_errors=True)
    ref.save_pretrained(out / "reference")
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo"):
        for beta in (0.0, 0.04):
            for masked in (False, True):
                region = run({"loss_type": loss_type, "beta": beta, "mask_truncated_completions": masked}, recorded,
                             out / "reference", out)
                assert region is not None and 0.05 < region < 0.9, f"clip_ratio/region_mean {region} at iteration 2"
    (out / "versions.json").write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                                   "trl": trl.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
