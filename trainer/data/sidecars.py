"""What a run's data says of itself, read for generate and export wherever the data is (local disk or a bucket):
a prepared .bin's sidecar, the files it names beside the .bin (the chat template its conversations were rendered
with), and the run's tokenizer (data.tokenizer) as a local file."""
from __future__ import annotations

from pathlib import Path

from trainer.data import remote
from trainer.data.batches import read_sidecar
from trainer.errors import UserError


def data_sidecar(source: str) -> dict | None:
    """The sidecar of a prepared .bin `source` (a URL's read from its bucket); None for any other source or a bare
    .bin."""
    if not source.endswith(".bin"):
        return None
    if remote.is_url(source):
        return remote.read_json(source + ".json") if remote.exists(source + ".json") else None
    return read_sidecar(source)


def beside(source: str, name: str) -> str:
    """The path or URL of the file `name` that a sidecar names, beside its .bin `source`."""
    if remote.is_url(source):
        return remote.join(source.rpartition("/")[0], name)
    return str(Path(source).parent / name)


def read_beside(source: str, name: str) -> str:
    """The text of the file `name` beside the .bin `source`."""
    where = beside(source, name)
    return remote.read_bytes(where).decode() if remote.is_url(source) else Path(where).read_text()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def local_tokenizer(path: str) -> str:
    """A run's data.tokenizer as a local path: a tokenizer.json URL (data prepared into a bucket) is copied with the
    tokenizer files beside it (TOKENIZER_FILES) into the cache, as mirror() copies a folder; a local path as it is."""
    if not remote.is_url(path):
        return path
    folder, _, name = path.rstrip("/").rpartition("/")
    if name not in TOKENIZER_FILES:  # a folder holding a tokenizer.json
        folder, name = path.rstrip("/"), "tokenizer.json"
    copy = remote.mirror(folder, only=TOKENIZER_FILES) / name
    if not copy.is_file():
        raise UserError(f"the run's tokenizer '{path}' (data.tokenizer) is missing; put the object back there (the "
                        "run's config.yaml names it)")
    return str(copy)
