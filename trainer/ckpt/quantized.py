"""Block-quantized weights of a Hugging Face folder, read as float32: DeepSeek's FP8 (`quantization_config` with
`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [rows, cols]`): each quantized `<name>.weight` is float8 e4m3
beside a float32 `<name>.weight_scale_inv` holding one factor per block of the weight, the blocks whole from the top
left and cut short at the bottom and right edges (ceil(rows / block rows) x ceil(cols / block cols) of them, as
DeepSeek's `weight_dequant` reads them). The weight is the float8 value times its block's factor, in float32.

Each read takes only the slice it asks for (`Dequantized.read`), as a plain tensor's memory map does."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from trainer.ckpt.safetensors import F8_E4M3, Tensor
from trainer.errors import UserError

SCALE = "_scale_inv"  # the factors' tensor: the weight's name plus this


class Dequantized(NamedTuple):
    """A float8 weight and its block factors, read as float32."""
    weight: Tensor
    scale: Tensor
    block: tuple  # (rows, cols) of one block

    @property
    def shape(self) -> tuple:
        return self.weight.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def read(self, view: tuple, idx: tuple) -> np.ndarray:
        """The weight reshaped to `view`, indexed by `idx` (basic slices and integers), as float32: only the float8
        values and factors of those elements are read."""
        r, c = np.divmod(_flat_index(view, idx), self.weight.shape[1])  # each element's place in the weight
        return self.weight.read(view, idx).astype(np.float32) * self.scale.array()[r // self.block[0],
                                                                                   c // self.block[1]]


def _flat_index(view: tuple, idx: tuple) -> np.ndarray:
    """The row-major flat index, in an array of shape `view`, of each element `idx` (basic slices and integers)
    selects, shaped as the selection: built from each axis's selected coordinates, the selection's size alone."""
    idx = tuple(idx) + (slice(None),) * (len(view) - len(idx))
    strides = np.cumprod((1,) + tuple(view[:0:-1]), dtype=np.int64)[::-1]
    kept = sum(not isinstance(i, (int, np.integer)) for i in idx)
    flat, axis = np.zeros((1,) * kept, np.int64), 0
    for n, i, stride in zip(view, idx, strides):
        coords = np.arange(n, dtype=np.int64)[i] * stride
        if coords.ndim:
            coords, axis = coords.reshape((1,) * axis + (-1,) + (1,) * (kept - axis - 1)), axis + 1
        flat = flat + coords
    return flat


def block_of(config: dict, where) -> tuple | None:
    """The (rows, cols) block of a folder's FP8 weights (config.json's quantization_config), None where it declares
    none; a scheme meshtrain does not read is a one-line error."""
    q = config.get("quantization_config")
    if q is None or (isinstance(q, dict) and q.get("quant_method") == "mxfp4"):  # mxfp4: trainer/ckpt/mxfp4.py
        return None
    method, fmt, block = q.get("quant_method"), q.get("fmt", "e4m3"), q.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2
                                                 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UserError(f"{where}: quantization_config {q} is not one meshtrain reads; it reads DeepSeek's block FP8 "
                        "(quant_method fp8, fmt e4m3, weight_block_size [rows, cols]); give the folder in bfloat16 "
                        "or float32")
    return tuple(block)


def dequantized(tensors: dict, block: tuple | None, where) -> dict:
    """`tensors` (name -> Tensor) with each float8 weight and its factors read as one float32 Dequantized under the
    weight's name; a float8 tensor without its factors, or factors of another grid, is a one-line error."""
    out = {}
    for name, t in tensors.items():
        owner = tensors.get(name[:-len(SCALE)]) if name.endswith(SCALE) else None
        if owner is not None and owner.dtype == F8_E4M3:  # read with its weight
            continue
        if t.dtype != F8_E4M3:
            out[name] = t
            continue
        scale = tensors.get(name + SCALE)
        if block is None or scale is None:
            why = "config.json has no quantization_config" if block is None else f"'{name + SCALE}' is missing"
            raise UserError(f"{where}: tensor '{name}' is float8 but {why}; give the folder as it was published")
        grid = tuple(math.ceil(n / b) for n, b in zip(t.shape, block)) if len(t.shape) == 2 else None
        if grid is None or scale.shape != grid or scale.dtype != np.float32:
            raise UserError(f"{where}: '{name + SCALE}' is {scale.dtype} {list(scale.shape)}, not the float32 "
                            f"{list(grid or ())} factors of {list(t.shape)} in blocks of {list(block)}")
        out[name] = Dequantized(t, scale, block)
    return out
