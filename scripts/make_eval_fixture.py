"""lm-evaluation-harness's own Hugging Face backend (`HFLM`, transformers + torch on CPU, float32) on meshtrain's
shipped offline tasks (trainer/eval_tasks), for tests/test_eval.py to compare `meshtrain eval` with: every request's
arguments and response (log-likelihood and is_greedy, rolling sums, generated strings) and the task scores.

    /tmp/hfvenv/bin/python scripts/make_eval_fixture.py   # a venv with torch, transformers and lm_eval==0.4.13

The model is the tiny Llama of tests/fixtures/grpo/policy (its tokenizer beside it). Writes tests/fixtures/eval/."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "trainer" / "eval_tasks"
POLICY = ROOT / "tests" / "fixtures" / "grpo" / "policy"
# name -> (model folder, HFLM's max_length: None its own context, 256; 64 cuts the rolling documents into windows and
# leaves the long generation context (past 64 - max_gen_toks 16 tokens) truncated on the left)
MODELS = {"llama": (POLICY, None), "llama_64": (POLICY, 64)}
NAMES = ["meshtrain_mc", "meshtrain_rolling", "meshtrain_gen"]


def configs() -> list[dict]:
    """The shipped task YAMLs with their data files made absolute (as meshtrain eval reads them)."""
    from lm_eval.tasks._yaml_loader import load_yaml
    out = []
    for name in NAMES:
        cfg = load_yaml(TASKS / f"{name}.yaml")
        files = cfg["dataset_kwargs"]["data_files"]
        cfg["dataset_kwargs"]["data_files"] = {k: str(TASKS / v) for k, v in files.items()}
        out.append(cfg)
    return out


def main():
    import lm_eval
    import torch
    import transformers
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    out = ROOT / "tests" / "fixtures" / "eval"
    out.mkdir(parents=True, exist_ok=True)
    for name, (folder, max_length) in MODELS.items():
        lm = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=1, max_length=max_length)
        r = simple_evaluate(model=lm, tasks=configs(), log_samples=True, random_seed=1234, numpy_random_seed=1234,
                            torch_random_seed=1234, fewshot_random_seed=1234, bootstrap_iters=0)
        got = {"versions": {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__,
                            "torch": torch.__version__},
               "max_length": lm.max_length,
               "results": {t: {k: v for k, v in r["results"][t].items() if isinstance(v, (int, float))}
                           for t in NAMES},
               "samples": {t: [{"doc_id": s["doc_id"], "arguments": [list(a) for a in s["arguments"]],
                                "resps": s["resps"], "filtered_resps": s["filtered_resps"]}
                               for s in r["samples"][t]] for t in NAMES}}
        if max_length:  # what the test relies on: windows, and a context cut on the left
            docs = [len(lm.tok_encode(s["arguments"][0][0])) for s in got["samples"]["meshtrain_rolling"]]
            ctxs = [len(lm.tok_encode(s["arguments"][0][0])) for s in got["samples"]["meshtrain_gen"]]
            assert max(docs) > max_length and max(ctxs) > max_length - 16, (docs, ctxs)
        (out / f"{name}.json").write_text(json.dumps(got, indent=1, default=str) + "\n")
        print(name, json.dumps(got["results"]), file=sys.stderr)


if __name__ == "__main__":
    main()
