"""MXFP4, the form gpt-oss's release stores its experts' weights in (`<name>_blocks`, `<name>_scales`), read as
float32: each block of 32 values along the last (input) axis is 16 bytes of 4-bit e2m1 codes, the low nibble first
(the block's even positions), and one byte of scale, the power of two it is multiplied by plus 127 (`blocks` U8
[..., in / 32, 16], `scales` U8 [..., in / 32]). An e2m1 code is a sign bit, two exponent bits and one mantissa bit:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. As transformers' `convert_moe_packed_tensors` reads them (which then
transposes [E, out, in] to its [E, in, out]: the adapter's view does that here)."""
from __future__ import annotations

import numpy as np

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
