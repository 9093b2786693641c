"""`meshtrain prepare` on conversations against plain text, in one process: tokens/s of each.

  python scripts/bench/prepare_chat.py [--n 1000] [--rounds 3]

Writes n conversations of 4 turns (user, assistant, user, assistant) of about 100 tokens each as JSONL, the
same conversations rendered as one plain text file, and prepares both with the test fixtures' tokenizer
and ChatML templates (with and without {% generation %} blocks: the prefix rule renders each assistant turn
twice more). Prints each rate (the sidecar's tokens_per_sec: tokens over the encoding time) and its ratio
to plain text's, best of --rounds, and the time of the record checks alone (roles, and each message's text found
in the rendering: trainer/data/chat.py's `missing`) as a share of the ChatML preparation's encoding time."""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from trainer.data.chat import ChatTemplate, missing, parse_date
from trainer.data.prepare import prepare

F = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "chat"
WORDS = ("the model trains on each batch of tokens and the loss counts what the assistant says about "
         "gradients optimizers meshes layers checkpoints and data").split()


def _turn(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 90))) + "."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rng = random.Random(0)
    tmp = Path(tempfile.mkdtemp())
    convs = [[{"role": r, "content": _turn(rng)} for r in ("user", "assistant", "user", "assistant")]
             for _ in range(a.n)]
    (tmp / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    chatml = (F / "templates" / "chatml.jinja").read_text()
    t = ChatTemplate("chatml", chatml, {"eos_token": "<|endoftext|>"}, parse_date(None))
    (tmp / "plain.txt").write_text("".join(t.render(m) for m in convs))
    best: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for r in range(a.rounds):
        for name, src, template in (("plain text", "plain.txt", None),
                                    ("chatml (prefix rule)", "chats.jsonl", "chatml"),
                                    ("chatml_gen (generation blocks)", "chats.jsonl", "chatml_gen")):
            meta = prepare([str(tmp / src)], str(tmp / f"{r}-{template}.bin"), tokenizer=str(F / "tokenizer"),
                           heldout=0, show_progress=False, log=lambda *x: None,
                           chat_template=template and str(F / "templates" / f"{template}.jinja"))
            best[name] = max(best.get(name, 0.0), meta["tokens_per_sec"])
            tokens = sizes[name] = meta["tokens"]["total"]
            print(f"round {r}: {name}: {meta['tokens_per_sec']:,} tokens/s ({tokens:,} tokens)", flush=True)
    cpu = next((ln.split(":")[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("cpu family")), "?")
    print(f"best of {a.rounds} (cpu family {cpu}):")
    for name, v in best.items():
        print(f"  {name}: {v:,.0f} tokens/s, {v / best['plain text']:.2f} of plain text's")
    texts = [t.render(m) for m in convs]
    checks = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        for m, text in zip(convs, texts):
            assert all(x["role"] in t.roles for x in m) and missing(m, text) is None
        checks.append(time.perf_counter() - t0)
    encode = sizes["chatml (prefix rule)"] / best["chatml (prefix rule)"]
    print(f"  the record checks: {min(checks) * 1e3:.1f} ms of chatml's {encode:.2f} s "
          f"({min(checks) / encode:.1%})")


if __name__ == "__main__":
    main()
