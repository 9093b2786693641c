"""Build tests/fixtures/generate/: a tiny Llama trained to answer two chats and finish a sentence, as a Hugging Face
folder with a ChatML template, and transformers' greedy `generate` tokens for it (needs torch + transformers).

Neither is a meshtrain dependency: install them once in a separate venv and run
    /path/to/hf-venv/bin/python scripts/make_generate_fixture.py [--out tests/fixtures/generate]
The folder: config.json, generation_config.json (eos_token_id a list: <|im_end|> and <|endoftext|>),
model.safetensors (float32, tied embeddings), tokenizer.json (tests/fixtures/chat's, plus a <|begin_of_text|>
that its post-processor puts first, as Llama 3's does), tokenizer_config.json, chat_template.jinja ({{ bos_token }}
and the chat fixture's ChatML) and reference.json: for each case the prompt's ids (apply_chat_template with
add_generation_prompt=True, or tokenizer(prompt)), the new ids of greedy `generate` (do_sample=False, stopped by the
generation config's eos list, or by `stop_strings`), their text (decode with skip_special_tokens=True) and the
smallest top-1/top-2 logit gap on the way (a gap this wide cannot flip between float32 implementations); plus
tokenizer(prompt) under tokenizer_config.json's add_bos_token / add_eos_token, with the tokenizer.json as written and
without its post-processor (then no BOS, whatever the flags say), and the versions. Training is seeded
and single-threaded: a second run writes the same bytes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "generate"
CHAT_TOKENIZER = ROOT / "tests" / "fixtures" / "chat" / "tokenizer" / "tokenizer.json"
BOS = "<|begin_of_text|>"
MAX_NEW = 32
SEED = 0

CHATS = [[{"role": "user", "content": "Hello! What is the capital of France?"},
          {"role": "assistant", "content": "Paris."}],
         [{"role": "system", "content": "Be terse."},
          {"role": "user", "content": "Name a color."},
          {"role": "assistant", "content": "Red."}]]
TEXT = "Pack my box with five dozen liquor jugs. The quick brown fox jumps over the lazy dog."
PLAIN = "Pack my box with five dozen liquor jugs. The quick brown fox"
STOP_STRING = " lazy"
NO_BOS_PLAIN = PLAIN + " j"  # as many tokens without a BOS as PLAIN with one: the tests compile one prefill
# (tokenizer_config.json's flags, whether tokenizer.json keeps its post-processor, the prompt)
VARIANTS = [({"add_bos_token": False}, True, PLAIN), ({"add_eos_token": True}, True, PLAIN),
            ({"add_bos_token": True, "add_eos_token": True}, True, PLAIN),
            ({"add_bos_token": True}, False, NO_BOS_PLAIN)]


def template() -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_chat_fixture import CHATML  # the chat fixture's ChatML (tools, system header), BOS first
    return "{{ bos_token }}" + CHATML


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, processors
    tok = Tokenizer.from_file(str(CHAT_TOKENIZER))
    tok.add_special_tokens([BOS])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                                                       special_tokens=[(BOS, bos)])
    (out / "tokenizer.json").write_text(tok.to_str(pretty=False) + "\n", encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "clean_up_tokenization_spaces": False,
              "model_max_length": 256}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(template(), encoding="utf-8")


def train(tok, steps: int = 300):
    """A 2-layer, width-64 Llama that learned CHATS and TEXT (every token of each), so that greedy decoding
    answers and ends its turn."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(SEED)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=10000.0,
                      bos_token_id=tok.bos_token_id, eos_token_id=eot, pad_token_id=eot)
    model = LlamaForCausalLM(cfg)
    rows = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in CHATS]
    rows.append(tok(TEXT)["input_ids"] + [eot])
    width = max(map(len, rows))
    ids = torch.tensor([r + [eot] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"trained {steps} steps: loss {loss.item():.4f}")
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[im_end, eot],
                                               pad_token_id=eot)
    return model


def greedy(model, tok, ids: list[int], **kwargs) -> dict:
    import torch
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **kwargs)
    new = out.sequences[0, len(ids):].tolist()
    gaps = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.logits]
    return {"prompt_ids": ids, "new_ids": new, "text": tok.decode(new, skip_special_tokens=True),
            "min_gap": round(min(gaps), 3)}


def cases(model, tok) -> list[dict]:
    out = []
    for i, chat in enumerate(CHATS):
        messages = chat[:-1]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        out.append({"name": f"chat{i}", "messages": messages, **greedy(model, tok, list(ids))})
    ids = tok(PLAIN)["input_ids"]
    out.append({"name": "plain", "prompt": PLAIN, **greedy(model, tok, ids)})
    out.append({"name": "stop_string", "prompt": PLAIN, "stop": [STOP_STRING],
                **greedy(model, tok, ids, stop_strings=[STOP_STRING], tokenizer=tok)})
    for c in out:
        print(f"{c['name']:12s} {len(c['prompt_ids'])} + {len(c['new_ids'])} tokens, gap {c['min_gap']}: "
              f"{tok.decode(c['new_ids'])!r}")
        assert len(c["new_ids"]) <= MAX_NEW - 8, "it must stop well before the token limit"
        assert c["min_gap"] > 0.1, "a greedy choice this close could flip between implementations"
    # the tests compile one prefill for all (a new prompt length is a new compile: about a second)
    assert len({len(c["prompt_ids"]) for c in out}) == 1, "keep every prompt the same number of tokens"
    return out


def encodings(out: Path) -> list[dict]:
    """tokenizer(prompt) when tokenizer_config.json sets add_bos_token / add_eos_token, and when tokenizer.json has
    no post-processor."""
    from transformers import AutoTokenizer
    found = []
    for flags, post_processor, prompt in VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            tok = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
            tok["post_processor"] = tok["post_processor"] if post_processor else None
            (Path(tmp) / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
            conf = json.loads((out / "tokenizer_config.json").read_text())
            (Path(tmp) / "tokenizer_config.json").write_text(json.dumps({**conf, **flags}))
            found.append({"tokenizer_config": flags, "post_processor": post_processor, "prompt": prompt,
                          "ids": AutoTokenizer.from_pretrained(tmp)(prompt)["input_ids"]})
    print("tokenizer(prompt):", [(e["tokenizer_config"], e["post_processor"], e["ids"][:2]) for e in found])
    assert len({len(e["ids"]) for e in found}) == 1, "keep every encoding the same number of tokens"
    return found


def write_reference(path: Path, reference: dict) -> None:
    """One line per case, so that a diff shows which case changed."""
    top = {k: json.dumps(v) for k, v in reference.items() if not isinstance(v, list) or k == "eos_token_id"}
    lists = {k: ",\n".join(json.dumps(e, ensure_ascii=False) for e in v) for k, v in reference.items() if k not in top}
    body = [f'"{k}": {v}' for k, v in top.items()] + [f'"{k}": [\n{v}\n]' for k, v in lists.items()]
    path.write_text("{" + ",\n".join(body) + "}\n", encoding="utf-8")
    assert json.loads(path.read_text(encoding="utf-8")) == reference


def build(out: Path) -> None:
    import tokenizers
    import torch
    import transformers
    from transformers import AutoTokenizer
    torch.set_num_threads(1)  # one thread: the same sums in the same order, the same weights every time
    torch.use_deterministic_algorithms(True)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.bos_token == BOS and tok("x")["input_ids"][0] == tok.bos_token_id
    model = train(tok)
    model.save_pretrained(out)
    reference = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                              "tokenizers": tokenizers.__version__},
                 "max_new_tokens": MAX_NEW, "eos_token_id": model.generation_config.eos_token_id,
                 "cases": cases(model, tok), "encodings": encodings(out)}
    write_reference(out / "reference.json", reference)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out}: {size / 1e6:.2f} MB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="the fixture folder (replaced)")
    build(ap.parse_args().out)
