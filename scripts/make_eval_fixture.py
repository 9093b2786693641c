"""lm-evaluation-harness's own Hugging Face backend (`HFLM`, transformers + torch on CPU, float32) on meshtrain's
shipped offline tasks (trainer/eval_tasks), for tests/test_eval.py to compare `meshtrain eval` with: every request's
arguments and response (log-likelihood and is_greedy, rolling sums, generated strings) and the task scores.

    /tmp/hfvenv/bin/python scripts/make_eval_fixture.py   # a venv with torch, transformers and lm_eval==0.4.13

Two models, each with the tokenizer (and chat template) of tests/fixtures/grpo/policy, written to tests/fixtures/eval/:
- `llama/`: the tiny Llama of tests/fixtures/grpo/policy trained (AdamW, seeded) on the generation task's
  questions each followed by " answer\\n", so that its generations stop on the task's `until` string ("\\n") before
  max_gen_toks (asserted: at least one), while the multiple-choice task, not trained on, scores strictly between 0
  and 1 (asserted);
- `mixtral/`: a tiny random MixtralForCausalLM (4 experts, 2 per token), drawn again (seed recorded) until every
  token that any request routes, in every layer, has its 2nd and 3rd router logits more than 1e-3 apart (asserted
  from the router's own outputs during lm-eval's pass), so that another layout's rounding cannot swap an expert.
Results: `llama.json` (HFLM at the folder's own context, 256), `llama_64.json` (max_length 64: the rolling documents
span several windows and a generation context is cut on the left, asserted), `llama_chat.json` (the multiple-choice
and generation tasks through the chat template, `apply_chat_template=True`), `mixtral.json` (max_length 64)."""
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "trainer" / "eval_tasks"
POLICY = ROOT / "tests" / "fixtures" / "grpo" / "policy"
OUT = ROOT / "tests" / "fixtures" / "eval"
NAMES = ["meshtrain_mc", "meshtrain_rolling", "meshtrain_gen"]
TOKENIZER = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
MARGIN = 1e-3


def configs(names=NAMES) -> list[dict]:
    """The shipped task YAMLs with their data files made absolute (as meshtrain eval reads them)."""
    from lm_eval.tasks._yaml_loader import load_yaml
    out = []
    for name in names:
        cfg = load_yaml(TASKS / f"{name}.yaml")
        files = cfg["dataset_kwargs"]["data_files"]
        cfg["dataset_kwargs"]["data_files"] = {k: str(TASKS / v) for k, v in files.items()}
        out.append(cfg)
    return out


def trained_llama(folder: Path):
    """The policy Llama trained on the generation task's question + " answer\\n" (BOS first), saved with its tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(str(POLICY), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(POLICY))
    docs = [json.loads(x) for x in (TASKS / "gen.jsonl").read_text().splitlines()]
    seqs = [tok(d["question"] + " " + d["answer"] + "\n").input_ids for d in docs]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        for ids in seqs:
            x = torch.tensor([ids])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    model.save_pretrained(str(folder))
    for f in TOKENIZER:
        shutil.copy(POLICY / f, folder / f)
    print("llama trained, last loss", float(loss), file=sys.stderr)


def random_mixtral(folder: Path, seed: int):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(seed)
    pol = json.loads((POLICY / "config.json").read_text())
    cfg = MixtralConfig(vocab_size=pol["vocab_size"], hidden_size=64, intermediate_size=72, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=256, bos_token_id=pol["bos_token_id"], eos_token_id=pol["eos_token_id"],
                        pad_token_id=pol["pad_token_id"], tie_word_embeddings=False, initializer_range=0.25,
                        rope_theta=1e6, router_jitter_noise=0.0)
    model = MixtralForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(str(folder))
    for f in TOKENIZER:
        shutil.copy(POLICY / f, folder / f)


def run(folder: Path, max_length=None, names=NAMES, chat=False, hook=None) -> dict:
    import lm_eval
    import torch
    import transformers
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    lm = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=1, max_length=max_length)
    if hook:
        hook(lm.model)
    r = simple_evaluate(model=lm, tasks=configs(names), log_samples=True, random_seed=1234, numpy_random_seed=1234,
                        torch_random_seed=1234, fewshot_random_seed=1234, bootstrap_iters=0,
                        apply_chat_template=chat)
    got = {"versions": {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__,
                        "torch": torch.__version__},
           "max_length": lm.max_length,
           "results": {t: {k: v for k, v in r["results"][t].items() if isinstance(v, (int, float))} for t in names},
           "samples": {t: [{"doc_id": s["doc_id"], "arguments": [list(a) for a in s["arguments"]],
                            "resps": s["resps"], "filtered_resps": s["filtered_resps"]}
                           for s in r["samples"][t]] for t in names}}
    got["_lm"] = lm
    return got


def write(name: str, got: dict):
    got = {k: v for k, v in got.items() if k != "_lm"}
    (OUT / f"{name}.json").write_text(json.dumps(got, indent=1, default=str) + "\n")
    print(name, json.dumps(got["results"]), file=sys.stderr)


def stops_early(got: dict) -> int:
    """How many generation requests the model answers with an `until` string before max_gen_toks (its greedy
    continuation without stop strings, decoded)."""
    import torch
    lm, n = got["_lm"], 0
    for s in got["samples"]["meshtrain_gen"]:
        ctx, kw = s["arguments"][0]
        ids = lm.tok_encode(ctx)[-(lm.max_length - kw["max_gen_toks"]):]
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=kw["max_gen_toks"], do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):]
        text = lm.tokenizer.decode(out)
        cut = [text.find(u) for u in kw["until"] if u in text]
        n += bool(cut) and len(lm.tok_encode(text[:min(cut)], add_special_tokens=False)) < kw["max_gen_toks"]
    return n


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    llama = OUT / "llama"
    llama.mkdir(exist_ok=True)
    trained_llama(llama)
    own = run(llama)
    assert stops_early(own) >= 1, "no generation stops on an until string before max_gen_toks"
    scores = [v for t in NAMES for k, v in own["results"][t].items() if k.startswith(("acc", "exact_match"))]
    assert any(0 < v < 1 for v in scores), scores
    write("llama", own)
    short = run(llama, 64)
    docs = [len(short["_lm"].tok_encode(s["arguments"][0][0])) for s in short["samples"]["meshtrain_rolling"]]
    ctxs = [len(short["_lm"].tok_encode(s["arguments"][0][0])) for s in short["samples"]["meshtrain_gen"]]
    assert max(docs) > 64 and max(ctxs) > 64 - 16, (docs, ctxs)  # windows, and a context cut on the left
    write("llama_64", short)
    write("llama_chat", run(llama, names=["meshtrain_mc", "meshtrain_gen"], chat=True))
    moe = OUT / "mixtral"
    moe.mkdir(exist_ok=True)
    for seed in range(100):
        random_mixtral(moe, seed)
        margins = []

        def hook(model):
            from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

            def gap(_, __, out):
                top = out[0].float().topk(3, dim=-1).values
                margins.append(float((top[..., 1] - top[..., 2]).min()))
            for m in model.modules():
                if isinstance(m, MixtralTopKRouter):
                    m.register_forward_hook(gap)
        got = run(moe, 64, hook=hook)
        if min(margins) > MARGIN:
            break
        print(f"seed {seed}: router margin {min(margins):.2e}, drawn again", file=sys.stderr)
    got["seed"], got["router_margin"], got["routed_forwards"] = seed, min(margins), len(margins)
    write("mixtral", got)


if __name__ == "__main__":
    main()
