"""What a path argument is, decided here for every command: a local path, a URL of object storage that meshtrain
reads and writes (`s3://BUCKET/PATH`, `gs://BUCKET/PATH`), or a mistyped or unsupported URL, refused in one line
before anything is read or written (`s3:/bucket/x` would otherwise be the local folder ./s3:/bucket/x).

A path looks like a URL when it starts with a scheme and ':/' (`s3:/b`, `http://h`, `file:///x`), with a storage
scheme in any case and a ':' or '//' (`S3://b`, `s3:b`, `gcs://b`, `s3//b`). A local file or folder whose name is
such (a folder named `s3:`) is written with `./` before it.
"""
from __future__ import annotations

import re

from trainer.config.mixture_entries import split_entry
from trainer.errors import UserError

SCHEMES = ("s3", "gs")  # object storage read and written by meshtrain (trainer/data/remote.py, trainer/ckpt/objects.py)
_STORAGE = r"s3|s3a|s3n|gs|gcs"  # what a user may mean by one of SCHEMES
_URL = re.compile(r"(s3|gs)://[^/\s]")
_STORAGE_NAME = re.compile(rf"(?i:{_STORAGE})")
_LOOKS = re.compile(rf"[A-Za-z][A-Za-z0-9+.-]+:/|(?i:{_STORAGE})\s*(:|//)")
# the config keys that name a path (checked as load_config reads a YAML file or the command line)
CONFIG_KEYS = ("run.dir", "data.source", "model.init_from", "dpo.reference")


def is_url(path) -> bool:
    """True for a URL of SCHEMES (`s3://BUCKET...`, `gs://BUCKET...`)."""
    return _URL.match(str(path)) is not None


def check(path, what: str, where: str = "") -> str:
    """`path` where it is a local path or a URL of SCHEMES; else a one-line UserError naming `what` (the flag or
    key that gave it; `where`: the file or command line that set it) and the path as it should be written."""
    s = str(path)
    what = f"{what} '{s}'" + (f" ({where})" if where else "")
    if is_url(s) or not _LOOKS.match(s):
        return s
    scheme = re.match(r"\s*([A-Za-z][A-Za-z0-9+.-]*)", s)
    scheme = scheme[1].lower() if scheme else ""
    fix = {"s3a": "s3", "s3n": "s3", "gcs": "gs"}.get(scheme, scheme)
    if fix in SCHEMES:
        rest = re.sub(rf"^\s*{re.escape(scheme)}\s*:?/*", "", s, flags=re.I)
        raise UserError(f"{what} is a mistyped URL; write {fix}://{rest or 'BUCKET/PATH'} (two slashes, the "
                        f"scheme in lower case), or ./{s} for a local path of that name")
    raise UserError(f"{what} is a URL meshtrain does not read or write; give a local path or "
                    f"{' or '.join(f'{k}://BUCKET/PATH' for k in SCHEMES)}")


def check_layer(node, where: str):
    """check() on every path key that one layer of a config (a YAML file, the command line) sets; not on the base
    layer (a checkpoint's own config, store.config_of, is read whatever its run.dir was)."""
    from omegaconf import OmegaConf
    if where == "base":
        return
    for key in CONFIG_KEYS:
        value = OmegaConf.select(node, key, default=None)
        if isinstance(value, str):
            check(value, key, where)
    mixture = OmegaConf.select(node, "data.mixture", default=None)
    for entry in mixture if OmegaConf.is_list(mixture) else ():
        name, source, _ = split_entry(str(entry))
        # a NAME is never a storage scheme: s3:/b/x=1 is a mistyped URL, not the source /b/x named s3
        check(str(entry).rpartition("=")[0] if _STORAGE_NAME.fullmatch(name) else source, "data.mixture entry", where)
