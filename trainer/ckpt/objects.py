"""A run.dir in object storage (`s3://`, `gs://`): checkpoints written there by Orbax and tensorstore, the run's
other files (config.yaml, metrics.jsonl, goodput.jsonl, tensorboard/) beside them.

Checkpoints. Orbax's CheckpointManager takes an epath (etils: fsspec for s3://, gcsfs or tf for gs://) and writes
the arrays through tensorstore. Object stores have no rename, so a save is made atomic the way Orbax does it on GCS
(CommitFileTemporaryPath): the step is written in place and `commit_success.txt` last; a step without it is never
listed, and a save of that step again replaces it. Orbax builds tensorstore's kvstore for gs:// (the `gcs` driver)
but refuses any other URL ("Checkpoint path should be absolute"): `install()` teaches its spec builder `s3://`,
the `s3` driver with the endpoint, region and credentials of the AWS environment (AWS_ENDPOINT_URL,
AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, else the default chain). Each process writes and
reads only its own shards, so many hosts share the bucket as they share a disk.

The run's other files are written to a local folder (`RunFiles.local`: $MESHTRAIN_CACHE/runs/<hash of the URL>/)
and process 0 uploads those that changed after every checkpoint and at the end; a resumed run first downloads
them, so metrics.jsonl goes on from where the checkpoint is. Each upload is one PUT: a reader sees an object whole.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from trainer.data import remote
from trainer.errors import UserError

_installed = False


def path_of(path):
    """A run.dir or checkpoint folder as a path object: epath's for a URL (what Orbax takes), else pathlib's."""
    if remote.is_url(path):
        remote.filesystem(str(path))  # one line where the scheme's package is missing
        from etils import epath
        return epath.Path(str(path))
    return Path(path)


def absolute(path):
    """path_of(path), a local one made absolute (epath makes a URL 'cwd/s3:/...'); a URL's arrays readable by Orbax."""
    p = path_of(path)
    if remote.is_url(path):
        install()
        return p
    return p.absolute()


def manager_options(path) -> dict:
    """Orbax CheckpointManagerOptions for a folder: a commit file, not a rename, in object storage."""
    if not remote.is_url(path):
        return {}
    install()
    from orbax.checkpoint._src.path import atomicity
    return {"temporary_path_class": atomicity.CommitFileTemporaryPath}


def s3_kvstore(url: str) -> dict:
    """tensorstore's kvstore spec of an s3:// folder, from the AWS environment."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    spec = {"driver": "s3", "bucket": bucket, "path": key.rstrip("/") + "/" if key else ""}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint:
        spec["endpoint"] = endpoint
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):  # else tensorstore's default chain (profile, instance metadata, ...)
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def install():
    """Orbax's tensorstore spec builder taught s3:// (once): where it would use its gcs driver for gs://, an s3://
    directory gets the `s3` driver (s3_kvstore); everything else stays Orbax's."""
    global _installed
    if _installed:
        return
    try:
        from orbax.checkpoint._src.path import gcs_utils
        from orbax.checkpoint._src.serialization import tensorstore_utils as tu
        normalize, use_gcs, gcs_kvstore = tu._normalize_path, tu._use_gcs_driver, gcs_utils.get_kvstore_for_gcs
        assert tu.gcs_utils is gcs_utils
    except (ImportError, AttributeError, AssertionError) as e:
        import orbax.checkpoint as ocp
        raise UserError(f"checkpoints in s3:// need orbax-checkpoint's tensorstore spec builder of 0.11 or later, "
                        f"and orbax-checkpoint {getattr(ocp, '__version__', '?')} differs ({e}); pip install "
                        "'orbax-checkpoint>=0.11,<0.13' or give run.dir as a local folder") from None
    tu._normalize_path = lambda p: "s3://" + os.path.normpath(p[5:]) if p.startswith("s3://") else normalize(p)
    tu._use_gcs_driver = lambda d: d.startswith("s3://") or use_gcs(d)
    gcs_utils.get_kvstore_for_gcs = lambda p: s3_kvstore(p) if p.startswith("s3://") else gcs_kvstore(p)
    _installed = True


class RunFiles:
    """The files of a run.dir URL other than its checkpoints, kept in a local folder and uploaded by process 0."""

    SKIP = ("checkpoints/",)

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.local = remote.cache_root() / "runs" / hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self._sent: dict[str, tuple[int, int]] = {}

    def pull(self):
        """The folder made to hold what the URL holds now (its checkpoints aside): a resumed run goes on from it."""
        import shutil
        if self.local.exists():
            shutil.rmtree(self.local)
        self.local.mkdir(parents=True)
        fs, path = remote.filesystem(self.url)
        if not remote.exists(self.url):
            return
        for key, info in remote._retried(self.url, lambda: fs.find(path, detail=True)).items():
            rel = key[len(path.rstrip("/")) + 1:]
            if info.get("type", "file") != "file" or not rel or rel.startswith(self.SKIP):
                continue
            dst = self.local / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            remote._retried(f"{self.url}/{rel}", lambda key=key, dst=dst: fs.get_file(key, str(dst)))
            st = dst.stat()
            self._sent[rel] = (st.st_size, st.st_mtime_ns)

    def push(self):
        """Every local file new or changed since the last push uploaded (one PUT each)."""
        fs, path = remote.filesystem(self.url)
        for f in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel, st = f.relative_to(self.local).as_posix(), f.stat()
            if self._sent.get(rel) == (st.st_size, st.st_mtime_ns):
                continue
            try:
                fs.put_file(str(f), f"{path.rstrip('/')}/{rel}")
            except OSError as e:
                raise UserError(f"uploading {rel} to run.dir {self.url} failed ({type(e).__name__}: {e}); "
                                "check the bucket, the endpoint and the credentials") from None
            self._sent[rel] = (st.st_size, st.st_mtime_ns)
