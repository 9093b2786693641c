"""The safetensors format read and written with numpy alone: an 8-byte little-endian header length,
a JSON header {name: {dtype, shape, data_offsets}}, then the raw little-endian tensors.

Tensors are read through memory maps, so a reader touches only the bytes of the slices it takes.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable, NamedTuple

import ml_dtypes  # comes with jax: numpy's bfloat16
import numpy as np

from trainer.errors import UserError

F8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)  # a block-quantized weight's values (trainer/ckpt/quantized.py)
DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "F8_E4M3": F8_E4M3, "U8": np.dtype(np.uint8)}  # U8: MXFP4's blocks and scales (trainer/ckpt/mxfp4.py)
CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # the format's own limit on the JSON header


class Tensor(NamedTuple):
    """Where one tensor lies: file, dtype, shape and its first byte in the file."""
    file: Path
    dtype: np.dtype
    shape: tuple
    start: int

    def array(self) -> np.ndarray:
        """The whole tensor as a read-only memory map (nothing is read until it is indexed)."""
        if math.prod(self.shape) == 0:
            return np.zeros(self.shape, self.dtype)
        return np.memmap(self.file, self.dtype, mode="r", offset=self.start, shape=self.shape)

    def read(self, view: tuple, idx: tuple) -> np.ndarray:
        """The tensor reshaped to `view`, indexed by `idx`: only those bytes are read."""
        return self.array().reshape(view)[idx]


def read_header(path) -> dict[str, Tensor]:
    """Every tensor of a .safetensors file; a corrupt header or a truncated file is a UserError."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise ValueError(f"header length {n} does not fit the file's {size} bytes")
            head = json.loads(f.read(n))
        if not isinstance(head, dict):
            raise ValueError("header is not a JSON object")
    except OSError as e:
        raise UserError(f"{path} cannot be read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} has a corrupt safetensors header ({str(e).splitlines()[0][:120]}); "
                        "download or save it again") from None
    out, data = {}, 8 + n
    for name, v in head.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = v["dtype"], tuple(int(d) for d in v["shape"]), v["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path} has a corrupt safetensors header (entry '{name}' is malformed); "
                            "download or save it again") from None
        if dtype not in DTYPES:
            raise UserError(f"{path}: tensor '{name}' is {dtype}; meshtrain reads {', '.join(DTYPES)}")
        if b - a != math.prod(shape) * DTYPES[dtype].itemsize or a < 0:
            raise UserError(f"{path} has a corrupt safetensors header ('{name}' spans bytes {a}..{b}, "
                            f"not the {math.prod(shape) * DTYPES[dtype].itemsize} of {dtype} {list(shape)})")
        if data + b > size:
            raise UserError(f"{path} is truncated: '{name}' ends at byte {data + b} of a {size}-byte file; "
                            "download or save it again")
        out[name] = Tensor(path, DTYPES[dtype], shape, data + a)
    return out


def write(path, entries: list[tuple[str, tuple, np.dtype]], fill: Callable[[str], np.ndarray],
          metadata: dict | None = None):
    """Write `entries` (name, shape, dtype) to one file, asking fill(name) for each tensor in turn."""
    head, off = {}, 0
    if metadata:
        head["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        head[name] = {"dtype": CODES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so that the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, dtype in entries:
            a = np.ascontiguousarray(fill(name), dtype=dtype)
            if a.shape != tuple(shape):
                raise ValueError(f"{name}: got shape {a.shape}, declared {tuple(shape)}")
            f.write(a.reshape(-1).view(np.uint8).data)  # no copy; every platform jax runs on is little-endian
