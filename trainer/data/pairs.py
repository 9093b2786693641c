"""Preference pairs: `{"prompt", "chosen", "rejected"}` records, tokenized as TRL 1.16's DPOTrainer tokenizes them, and
the rows that hold them (one pair per row: its two sequences as two documents, so that a pair never spans
microbatches, data ranks or pipeline stages).

A pair is text (three strings) or conversational (`prompt` a list of messages, `chosen` and `rejected` the assistant's
turns as lists of messages), as TRL takes them:
  text            EOS appended to chosen and rejected (unless they end with it); prompt, prompt + chosen and
                  prompt + rejected encoded as tokenizer(text) encodes them (its post-processor's BOS included);
  conversational  prompt rendered with the chat template and the generation prompt, prompt + chosen and
                  prompt + rejected rendered whole, each given the record's `tools` and `chat_template_kwargs`
                  (chat.variables_of) and encoded without special tokens (the template holds them).
The completion starts where the prompt's ids and each whole sequence's ids first differ (the shorter of the two
common prefixes); each sequence (prompt + completion) is cut to `max_length` tokens keeping its start, and a pair
whose prompt alone reaches `max_length` is dropped and counted. The loss mask marks the completion's tokens.
"""
from __future__ import annotations

import numpy as np

from trainer.data.chat import TemplateFailed, no_variables
from trainer.errors import UserError

FIELDS = ("prompt", "chosen", "rejected")


def _conversational(x) -> bool:
    return isinstance(x, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in x)


def check_pair(rec: dict, where: str):
    """One line where a pair record lacks a field, mixes text and messages, or has an empty or identical answer."""
    missing = [f for f in FIELDS if f not in rec]
    if missing:
        raise UserError(f"{where} is a preference pair without '{missing[0]}'; give 'prompt', 'chosen' and 'rejected' "
                        "(text, or lists of messages)")
    kinds = {("text" if isinstance(rec[f], str) else "messages" if _conversational(rec[f]) else "other")
             for f in FIELDS}
    if kinds not in ({"text"}, {"messages"}):
        raise UserError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all be lists of messages "
                        "(objects with a 'role'); fix the record")
    for f in ("chosen", "rejected"):
        if not rec[f] or (isinstance(rec[f], str) and not rec[f].strip()):
            raise UserError(f"{where}: '{f}' is empty; a pair needs two answers to compare: fix or remove the record")
    if rec["chosen"] == rec["rejected"]:
        raise UserError(f"{where}: 'chosen' and 'rejected' are the same answer, which teaches nothing; fix or remove "
                        "the record")


def _common(a: list, b: list) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def sequences(enc, where: str, rec: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of a pair, as TRL's tokenize step gives them (before truncation)."""
    tok = enc.tok
    if isinstance(rec["prompt"], str):
        no_variables(rec, where, "a text pair")
        eos = tok.id_to_token(enc.eot)
        ans = [a if a.endswith(eos) else a + eos for a in (rec["chosen"], rec["rejected"])]
        prompt = tok.encode(rec["prompt"]).ids
        whole = [tok.encode(rec["prompt"] + a).ids for a in ans]
    else:
        enc._needs_template(where)
        given = enc.template.variables(rec, where)
        try:
            texts = [enc.template.render(rec["prompt"], given, add_generation_prompt=True)] + [
                enc.template.render(rec["prompt"] + rec[f], given) for f in ("chosen", "rejected")]
        except TemplateFailed as e:
            raise UserError(f"{where}: the chat template {enc.template.source} cannot render it ({e}); fix the "
                            "record or give another template with --chat-template") from None
        prompt, *whole = (tok.encode(t, add_special_tokens=False).ids for t in texts)
    n = min(_common(prompt, w) for w in whole)
    return prompt[:n], whole[0][n:], whole[1][n:]


class Dropped(list):
    """No documents: a pair whose prompt alone (`prompt` tokens) reaches --max-length, dropped as TRL drops it."""

    def __init__(self, prompt: int):
        super().__init__()
        self.prompt = prompt


def encode_pair(enc, where: str, rec: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(ids, mask) of prompt + chosen, of prompt + rejected], each cut to enc.max_length keeping its start; none
    (Dropped) where the prompt alone reaches it."""
    if enc.max_length is None:
        raise UserError(f"{where} is a preference pair: pairs are prepared into one .bin (--out FILE.bin), not into "
                        "a folder of shards; give --out FILE.bin")
    prompt, chosen, rejected = sequences(enc, where, rec)
    if len(prompt) >= enc.max_length:
        return Dropped(len(prompt))
    out = []
    for ans in (chosen, rejected):
        ids = np.asarray(prompt + ans, np.int64)[:enc.max_length]
        mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(ans), np.uint8)])[:enc.max_length]
        out.append((ids, mask))
    return out


def pack_pairs(doc_starts: np.ndarray, T: int, source: str):
    """A Packing (trainer/data/packing.py) of one pair per row: documents 2i (chosen) and 2i + 1 (rejected) of
    doc_starts (their starts, the end last), segments 1 and 2; one line where a pair does not fit T slots."""
    from trainer.data.packing import Packing
    starts = np.asarray(doc_starts, np.int64)
    n_docs = len(starts) - 1
    if n_docs % 2:
        raise UserError(f"data.source '{source}' holds {n_docs} documents, not whole pairs; prepare it again")
    slots = starts[1:] - starts[:-1] - 1  # a document of n tokens fills n - 1 slots (its targets)
    need = slots[0::2] + slots[1::2]
    if len(need) and need.max() > T:
        i = int(np.argmax(need))
        raise UserError(f"pair {i} of data.source '{source}' needs {int(need[i])} slots (its two sequences' targets) "
                        f"and a row has model.seq_len={T}; raise model.seq_len to {int(need.max())} or prepare with "
                        f"a smaller --max-length")
    rows = len(need)
    return Packing(row_ptr=np.arange(0, 2 * rows + 1, 2, dtype=np.int64), start=starts[:-1].copy(),
                   length=slots.copy(), offset=np.zeros(n_docs, np.int64), documents=n_docs, split=0)


def packed_pairs(corpus, starts: np.ndarray, cut: int, T: int, evaluates: bool):
    """(training rows, held-out rows or None, the line a run prints) of a prepared source of pairs."""
    packed = pack_pairs(starts[starts <= cut], T, corpus.source)
    if packed.rows == 0:
        raise UserError(f"data.source '{corpus.source}' has no training pairs; prepare it from more records")
    held = pack_pairs(starts[starts >= cut], T, corpus.source) if evaluates else None
    if held is not None and held.rows == 0:
        raise UserError(f"data.source '{corpus.source}' has no held-out pairs to evaluate on (prepared with "
                        "--heldout 0); prepare it with --heldout > 0 or set train.eval_every=0")
    return packed, held, f"{packed.rows:,} training preference pairs, one per row of {T}"


def check_kinds(kinds):
    """One line where a prepare mixes pairs with other records (a pair's rows are laid out otherwise), or dropped
    every pair (each one's prompt alone reaches --max-length), naming the length that keeps them."""
    if kinds.pairs and kinds.pairs != kinds.total:
        raise UserError(f"the sources mix {kinds.pairs} preference pairs with {kinds.total - kinds.pairs} other "
                        "records; prepare pairs (for train.objective=dpo) into a .bin of their own")
    if kinds.pairs and kinds.dropped_pairs == kinds.pairs:
        lo, hi = kinds.dropped_prompts
        raise UserError(f"all {kinds.pairs:,} preference pairs were dropped: each one's prompt alone reaches "
                        f"--max-length (the prompts have {lo:,} to {hi:,} tokens, and a pair keeps its first "
                        f"--max-length tokens of prompt + answer); give --max-length {hi + 1} or more to keep every "
                        f"pair ({lo + 1} keeps the shortest), more to keep their answers whole")


def summary(kinds, meta: dict, max_length: int) -> str:
    return (f"{kinds.pairs:,} preference pairs ({meta['pairs']['train']:,} train, {meta['pairs']['heldout']:,} "
            f"held-out); {kinds.dropped_pairs:,} dropped: their prompt alone has --max-length {max_length} tokens")
