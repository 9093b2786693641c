"""Records: JSONL and Parquet files of documents, conversations and exchanges, read as a stream.

A record is one of
  {"text": ...}                                   one document (--field NAME for another column)
  {"messages": [{"role": ..., "content": ...}]}   one conversation, rendered with the chat template (and the
                                                  record's `tools` and `chat_template_kwargs`: chat.variables_of)
  {"prompt": ..., "completion": ...}              one exchange: a user turn and an assistant turn
  {"prompt": ..., "chosen": ..., "rejected": ...} a preference pair (trainer/data/pairs.py): two documents
  {"prompt": ...} and nothing to complete it       a prompt of GRPO's (trainer/data/prompts.py): one document of no
                                                  counted token, the record kept beside it for the reward functions
Keys whose value is None are dropped first, at every depth (Parquet fills a column a record lacks with
None), so the same records read the same from either format. A record goes to the held-out split by a
hash of that normalised form (keys sorted), whatever file or format holds it.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.chat import ROLES, ChatTemplate, PrefixMismatch, TemplateFailed, missing, no_variables
from trainer.data.remote import open_source
from trainer.errors import UserError

SUFFIXES = (".jsonl", ".parquet")
ROWS = 1024  # Parquet rows read at a time


def is_records(path: Path) -> bool:
    return path.suffix in SUFFIXES


def normalised(x):
    """x with every None-valued key dropped, at every depth."""
    if isinstance(x, dict):
        return {k: normalised(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [normalised(v) for v in x]
    return x


def key(record: dict) -> bytes:
    """A (normalised) record's identity: its JSON with sorted keys, UTF-8."""
    return json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def held_out(record_key: bytes, frac: float) -> bool:
    """Whether a record is held out: the CRC-32 of its key, mod 10,000, below frac x 10,000 (the rule files
    are split by)."""
    return zlib.crc32(record_key) % 10_000 < frac * 10_000


def read(path: Path, start: int = 0, stop: int | None = None, first_line: int = 1):
    """(where, record, bytes read so far) for each record of a JSONL or Parquet file, a few at a time; of a JSONL
    file's bytes [start, stop) only (whole lines, the first of them line `first_line`) where stop is given."""
    if path.suffix == ".parquet":
        yield from _parquet(path)
        return
    with open_source(path) as f:  # a file, or an object in storage
        f.seek(start)
        at, end = 0, None if stop is None else stop - start
        for n, line in enumerate(f, first_line):
            at += len(line)
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise UserError(f"{path}:{n} is not JSON ({getattr(e, 'msg', e)}); fix or remove that "
                                    "line") from None
                yield f"{path}:{n}", rec, at
            if end is not None and at >= end:
                return


def _parquet(path: Path):
    import pyarrow.parquet as pq
    try:
        f = pq.ParquetFile(path if isinstance(path, Path) else open_source(path))
    except Exception as e:  # pyarrow's own ArrowInvalid and friends
        raise UserError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0][:120]}); "
                        "give a Parquet or JSONL file") from None
    total, size, n = max(f.metadata.num_rows, 1), path.stat().st_size, 0
    for batch in f.iter_batches(batch_size=ROWS):
        for rec in batch.to_pylist():
            n += 1
            yield f"{path} row {n}", rec, size * n // total


@dataclass
class Kinds:
    """How many records of each kind a prepare read, and how many had no token the loss counts (the first: where)."""
    text: int = 0
    conversations: int = 0
    exchanges: int = 0
    pairs: int = 0
    prompts: int = 0  # GRPO's: a prompt file holds nothing else
    dropped_pairs: int = 0  # pairs whose prompt alone reaches --max-length (TRL drops them)
    dropped_prompts: tuple = (0, 0)  # the shortest and the longest of their prompts, in tokens
    uncounted: int = 0
    first_uncounted: str = ""

    def add(self, kind: str):
        name = {"text": "text", "conversation": "conversations", "exchange": "exchanges", "pair": "pairs",
                "prompt": "prompts"}[kind]
        setattr(self, name, getattr(self, name) + 1)

    def drop_pair(self, prompt: int):
        """A pair dropped: its prompt alone (`prompt` tokens) reaches --max-length."""
        lo, hi = self.dropped_prompts
        self.dropped_prompts = (min(lo, prompt) if self.dropped_pairs else prompt, max(hi, prompt))
        self.dropped_pairs += 1

    def add_uncounted(self, where: str):
        self.uncounted += 1
        self.first_uncounted = self.first_uncounted or where

    @property
    def total(self) -> int:
        return self.text + self.conversations + self.exchanges + self.pairs + self.prompts


def kind_of(rec, where: str, field: str) -> str:
    if not isinstance(rec, dict):
        raise UserError(f"{where} is a JSON {type(rec).__name__}, not a record; give objects with '{field}', "
                        "'messages' or 'prompt' and 'completion'")
    if "messages" in rec:
        msgs = rec["messages"]
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                         for m in msgs)):
            raise UserError(f"{where}: 'messages' must be a non-empty list of objects with a 'role'; fix the record")
        return "conversation"
    if "chosen" in rec or "rejected" in rec:
        from trainer.data.pairs import check_pair
        check_pair(rec, where)
        return "pair"
    if "prompt" in rec and "completion" in rec:
        if not (isinstance(rec["prompt"], str) and isinstance(rec["completion"], str)):
            raise UserError(f"{where}: 'prompt' and 'completion' must be strings; fix the record")
        return "exchange"
    if field in rec:
        if not isinstance(rec[field], str):
            raise UserError(f"{where}: '{field}' must be a string; fix the record or choose another --field")
        return "text"
    if "prompt" in rec:  # a prompt alone: GRPO's (trainer/data/prompts.py)
        from trainer.data.prompts import check
        check(rec, where)
        return "prompt"
    raise UserError(f"{where} has none of the fields '{field}', 'messages', 'prompt' + 'completion' (it has "
                    f"{', '.join(map(repr, sorted(rec))) or 'none'}); fix the record or name its text with --field")


def _mask_of(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap a span (transformers' assistant mask), else 0."""
    if not spans or not len(offsets):
        return np.zeros(len(offsets), np.uint8)
    starts = np.asarray([s for s, _ in spans])
    ends = np.asarray([e for _, e in spans])
    k = np.searchsorted(ends, offsets[:, 0], side="right")  # the first span ending after the token starts
    hit = k < len(spans)
    hit[hit] = starts[k[hit]] < offsets[hit, 1]
    return hit.astype(np.uint8)


def text_specials(tok, eot: int) -> tuple[list[int], list[int]]:
    """The ids tokenizer(text) puts before and after a text's own: its post-processor's (Llama's BOS first; none
    for a trained byte-level BPE), found around a probe's ids (the end-of-text token's text: one id)."""
    for probe in (tok.id_to_token(eot), "a", "0"):
        try:
            bare, full = tok.encode(probe, add_special_tokens=False).ids, tok.encode(probe).ids
        except Exception:  # noqa: BLE001 - the library's own error: a probe this vocabulary cannot encode
            continue
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
        if bare and at is not None:
            return full[:at], full[at + len(bare):]
    raise UserError("the tokenizer's post-processor changes a text's own tokens, not only adds special tokens around "
                    "them; give a tokenizer.json whose post-processor only adds them (or none)")


def as_text(ids, specials: tuple[list[int], list[int]], eot: int, first: bool = True,
            last: bool = True) -> tuple[np.ndarray, int, int]:
    """A text's ids (a piece of it: its `first`, its `last`) as tokenizer(text) gives them, the specials around
    them, then the end-of-text token unless they end with it; with how many ids went before and after."""
    head, tail = (specials[0] if first else []), (list(specials[1]) if last else [])
    body = [*head, *ids, *tail]
    if last and (not body or body[-1] != eot):
        tail.append(eot)
    return np.asarray([*head, *ids, *tail], np.int64), len(head), len(tail)


class Encoder:
    """Turns records into (ids, mask) documents, a batch at a time (the tokenizer encodes a batch in parallel)."""

    def __init__(self, tok, eot: int, template: ChatTemplate | None, loss_on: str, field: str,
                 require_counted: bool = False, max_length: int | None = None):
        self.tok, self.eot, self.template, self.loss_on, self.field = tok, eot, template, loss_on, field
        self.max_length = max_length  # a pair's sequences kept to this many tokens; None: pairs are refused
        self.require_counted = require_counted  # a record without a counted token is an error, not a count
        self.specials = ([], [])  # text_specials of tok, set with it

    def _needs_template(self, where: str):
        if self.template is None:
            raise UserError(f"{where} is a conversation, and the tokenizer has no chat template (no chat_template in "
                            "its tokenizer_config.json, no chat_template.jinja); give one with --chat-template FILE")

    def render(self, where: str, kind: str, rec: dict) -> tuple[str, list, bool]:
        """(text, the assistant's character spans, whether an end-of-text token follows)."""
        if kind == "text":
            no_variables(rec, where, "a text record")
            return rec[self.field], [], True
        if kind == "exchange" and self.template is None:
            no_variables(rec, where, "a prompt and completion without a chat template")
            p, c = rec["prompt"], rec["completion"]
            return p + c, [(len(p), len(p) + len(c))], True  # the end-of-text token after it is the completion's
        msgs = rec["messages"] if kind == "conversation" else [
            {"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["completion"]}]
        self._needs_template(where)
        if kind == "conversation":
            self._check_roles(where, msgs)
        try:
            text, spans = self.template.assistant_spans(msgs, self.template.variables(rec, where))
        except TemplateFailed as e:
            raise UserError(f"{where}: the chat template {self.template.source} cannot render it ({e}); fix the "
                            "record or give another template with --chat-template") from None
        except PrefixMismatch as e:
            raise UserError(f"{where}: assistant turn {e.args[0]} was not found: the template renders the earlier "
                            f"turns differently from the whole conversation, so the template needs "
                            "{% generation %} blocks to mark the assistant's tokens; add them, or use --loss-on all") \
                from None
        if (lost := missing(msgs, text)) is not None:
            i, field = lost
            name = f"messages[{i}].{field}" if kind == "conversation" else ("prompt", "completion")[i]
            raise UserError(f"{where}: {name} is missing from the text the chat template {self.template.source} "
                            "renders (the template drops it); fix the record, or give a template that renders it "
                            "with --chat-template FILE")
        return text, spans, False

    def _check_roles(self, where: str, msgs: list):
        t = self.template
        for i, m in enumerate(msgs):
            if m["role"] not in t.roles:
                named = f" ({', '.join(t.roles[len(ROLES):])})" if len(t.roles) > len(ROLES) else ""
                raise UserError(f"{where}: messages[{i}].role is '{m['role']}': neither {', '.join(ROLES)} nor a role "
                                f"the chat template {t.source} names{named}; rename it (the model's turns are "
                                "'assistant'), or give a chat template that names it with --chat-template FILE")

    def encode(self, batch: list[tuple[str, str, dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(where, kind, record)] -> [(ids, mask)], each a document. Plain text and exchanges without a template
        are texts: as tokenizer(text) encodes them, then the end-of-text token (as_text); a conversation's text
        holds the template's own special tokens, so the tokenizer adds none."""
        if any(k == "prompt" for _, k, _ in batch):  # a prompt of GRPO's: its ids, no token counted
            from trainer.data.prompts import encode
            return [(np.asarray(encode(self.tok, self.specials[0], self.template, r, w), np.int64), None)
                    if k == "prompt" else self.encode([(w, k, r)])[0] for w, k, r in batch]
        if any(k == "pair" for _, k, _ in batch):  # each pair: its two documents, or none (fully truncated)
            from trainer.data.pairs import encode_pair
            return [encode_pair(self, w, r) if k == "pair" else self.encode([(w, k, r)])[0] for w, k, r in batch]
        rendered = [self.render(w, k, r) for w, k, r in batch]
        texts = [t for t, _, _ in rendered]
        plain = all(k == "text" for _, k, _ in batch)
        encs = (self.tok.encode_batch_fast(texts, add_special_tokens=False) if plain
                else self.tok.encode_batch(texts, add_special_tokens=False))
        out = []
        for (_, kind, _), (text, spans, eot), enc in zip(batch, rendered, encs):
            ids = np.asarray(enc.ids, np.int64)
            every = kind == "text" or self.loss_on == "all"
            mask = (np.ones(len(ids), np.uint8) if every
                    else _mask_of(np.asarray(enc.offsets, np.int64).reshape(-1, 2), spans))
            if eot:
                ids, head, tail = as_text(enc.ids, self.specials, self.eot)
                # a BOS before an exchange is the prompt's, what ends it (an EOS, end-of-text) the completion's
                mask = np.concatenate([np.full(head, every, np.uint8), mask, np.ones(tail, np.uint8)])
            out.append((ids, mask))
        return out
