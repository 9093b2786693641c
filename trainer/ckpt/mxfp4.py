"""MXFP4, the form gpt-oss's release stores its experts' weights in (`<name>_blocks`, `<name>_scales`), read as
float32: each block of 32 values along the last (input) axis is 16 bytes of 4-bit e2m1 codes, the low nibble first
(the block's even positions), and one byte of scale, the power of two it is multiplied by plus 127 (`blocks` U8
[..., in / 32, 16], `scales` U8 [..., in / 32]). An e2m1 code is a sign bit, two exponent bits and one mantissa bit:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. As transformers' `convert_moe_packed_tensors` reads them (which then
transposes [E, out, in] to its [E, in, out]: the adapter's view does that here)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from trainer.errors import UserError

# the sixteen e2m1 values by code (sign bit 8)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # values per scale


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., G * 32] of `blocks` uint8 [..., G, 16] and `scales` uint8 [..., G]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair up: blocks "
                         f"[..., G, {BLOCK // 2}] go with scales [..., G]")
    out = np.empty(blocks.shape[:-1] + (BLOCK,), np.float32)
    out[..., 0::2] = E2M1[blocks & 0x0F]
    out[..., 1::2] = E2M1[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(blocks.shape[:-2] + (blocks.shape[-2] * BLOCK,))


class Packed(NamedTuple):
    """An MXFP4 weight (`<name>_blocks` [E, out, G, 16], `<name>_scales` [E, out, G]) read as the float32 tensor
    transformers makes of it, [E, in, out] (in = G x 32): one expert's bytes dequantized per expert a read asks for."""
    blocks: object  # trainer/ckpt/safetensors.py Tensor (uint8)
    scales: object

    @property
    def shape(self) -> tuple:
        E, out, G, _ = self.blocks.shape
        return (E, G * BLOCK, out)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def read(self, view: tuple, idx: tuple) -> np.ndarray:
        """The tensor reshaped to `view` (its leading axis the experts'), indexed by `idx`."""
        first, rest = (idx[0] if idx else slice(None)), tuple(idx[1:])
        experts = np.arange(self.shape[0])[first]
        blocks, scales = self.blocks.array()[experts], self.scales.array()[experts]
        w = np.swapaxes(dequantize(blocks, scales), -1, -2)  # [..., in, out]
        if np.ndim(experts) == 0:
            return w.reshape(view[1:])[rest]
        return w.reshape((len(experts),) + tuple(view[1:]))[(slice(None),) + rest]


def packed(tensors: dict, where) -> dict:
    """`tensors` with each `<name>_blocks` and its `<name>_scales` read as one Packed under `<name>`; a uint8 tensor
    without its pair, or a pair of other shapes, is a one-line error."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scales") and name[:-len("_scales")] + "_blocks" in tensors:
            continue
        if not name.endswith("_blocks"):
            out[name] = t
            continue
        base = name[:-len("_blocks")]
        scales = tensors.get(base + "_scales")
        if scales is None:
            raise UserError(f"{where}: MXFP4 tensor '{name}' has no '{base}_scales'; give the folder as it was "
                            "published")
        if (t.dtype != np.uint8 or scales.dtype != np.uint8 or len(t.shape) != 4 or t.shape[-1] != BLOCK // 2
                or tuple(scales.shape) != tuple(t.shape[:-1])):
            raise UserError(f"{where}: MXFP4 '{name}' {t.dtype} {list(t.shape)} and '{base}_scales' {scales.dtype} "
                            f"{list(scales.shape)} are not uint8 [E, out, G, 16] and [E, out, G]")
        out[base] = Packed(t, scales)
    return out
