"""GRPO's prompts: records with a `prompt` (text, or a list of messages) and any other fields, which reach the
reward functions, read from a JSONL or Parquet file as they are or from what `meshtrain prepare` made of one.

A prompt's ids are those the policy continues: a text's as the data's documents start (what tokenizer(text) puts
first, Llama's BOS) and then its own ids, no end-of-text token; a conversation rendered by the chat template with
the generation prompt and the record's `tools` and `chat_template_kwargs` (as TRL 1.16 renders it), encoded without
added special tokens. `meshtrain prepare` writes each prompt as one document of no counted token and the record
itself, a JSON line per document in document order, in `DATA.bin.prompts.jsonl` (the sidecar's `prompts`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainer.errors import UserError


def records_path(bin_path) -> Path:
    """Where `meshtrain prepare` writes a prompt file's records, one JSON line per document."""
    return Path(str(bin_path) + ".prompts.jsonl")


def check(rec, where: str):
    """One line for a record whose prompt is neither a non-empty string nor a list of messages with a 'role'."""
    prompt = rec.get("prompt") if isinstance(rec, dict) else None
    if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt)):
        raise UserError(f"{where} has no 'prompt' (a non-empty string, or a list of messages with a 'role'); "
                        "fix the record")


def encode(tok, start: list[int], template, rec: dict, where: str) -> list[int]:
    """The ids of a record's prompt (the module's docstring), with the tokenizer `tok`, `start` the ids a text
    document starts with and `template` the chat template (None: a conversation is refused in one line)."""
    from trainer.data.chat import TemplateFailed
    prompt = rec["prompt"]
    if isinstance(prompt, str):
        return list(start) + tok.encode(prompt, add_special_tokens=False).ids
    if template is None:
        raise UserError(f"{where}: a conversational prompt needs a chat template beside the run's tokenizer "
                        "(chat_template.jinja or tokenizer_config.json); give text prompts or add the template")
    try:
        text = template.render(prompt, template.variables(rec, where), add_generation_prompt=True)
    except TemplateFailed as e:
        raise UserError(f"{where}: the chat template failed on its prompt ({e}); fix the record or the "
                        "template") from None
    return tok.encode(text, add_special_tokens=False).ids


def prepared(source: str) -> list[dict] | None:
    """The training split's prompts of a prepared source (a .bin or a folder of shards), each its record with its
    `prompt_ids`; None where `source` is no prepared data; one line where it is prepared data of no prompts."""
    from trainer.data.manifest import Where, is_manifest, read_manifest
    if str(source).endswith(".bin"):
        folder, name = str(source).rsplit("/", 1) if "/" in str(source) else (".", str(source))
        where = Where(folder)
        if where.size(name + ".json") is None:
            return None
        shards = [name]
    elif is_manifest(source):
        where, shards = Where(source), [e["path"] for e in read_manifest(source)["shards"]]
    else:
        return None
    out = []
    for name in shards:
        meta = where.json(name + ".json")
        if not meta.get("prompts"):
            raise UserError(f"data.source {source} holds prepared documents, not prompts (no 'prompts' in "
                            f"{name}.json); prepare a file of records with a 'prompt' and nothing to complete it, "
                            "or give that file as data.source")
        ids = where.small(name, np.dtype(meta["dtype"]))
        index = where.small(_beside(name, meta["document_index"]["path"]), np.uint64)
        text = where.small(_beside(name, meta["prompts"]["path"]), np.uint8).tobytes().decode().splitlines()
        for i in range(int(meta["prompts"]["train"])):  # the training split's documents come first
            out.append({**json.loads(text[i]), "prompt_ids": ids[int(index[i]):int(index[i + 1])].tolist()})
    return out


def _beside(name: str, file: str) -> str:
    """A file that shard (or .bin) `name`'s sidecar names, relative to the folder `name` is relative to."""
    return (name.rsplit("/", 1)[0] + "/" if "/" in name else "") + file
