"""MXFP4 (trainer/ckpt/mxfp4.py) against the format decoded here value by value from its bits: each byte's low
nibble first, an e2m1 code as sign x 2^(exponent - 1) x (1 + mantissa / 2), or mantissa / 2 where the exponent bits
are 0, times 2^(scale byte - 127); bit for bit, every code and scales from 2^-127 to 2^125 included."""
import numpy as np
import pytest

from trainer.ckpt.mxfp4 import dequantize


def _e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man / 2 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def _by_hand(blocks, scales):
    E, O, G, _ = blocks.shape
    out = np.zeros((E, O, G * 32), np.float32)
    for e in range(E):
        for o in range(O):
            for g in range(G):
                for i, byte in enumerate(blocks[e, o, g]):
                    for half, code in enumerate((int(byte) & 15, int(byte) >> 4)):
                        out[e, o, g * 32 + 2 * i + half] = np.float32(_e2m1(code) * 2.0 ** (int(scales[e, o, g]) - 127))
    return out


def test_dequantized_equals_the_bits_decoded_by_hand():
    r = np.random.default_rng(0)
    blocks = r.integers(0, 256, (2, 3, 4, 16), dtype=np.uint8)
    blocks[0, 0, 0] = np.arange(16, dtype=np.uint8) * 17  # every code, in both nibbles
    scales = r.integers(100, 140, (2, 3, 4), dtype=np.uint8)
    scales[1, 2, :] = [0, 1, 251, 252]  # the smallest powers of two, and the largest whose 6 x 2^s is a float32
    got = dequantize(blocks, scales)
    assert got.shape == (2, 3, 128) and got.dtype == np.float32
    assert got.tobytes() == _by_hand(blocks, scales).tobytes()


def test_unpaired_blocks_and_scales_are_refused():
    with pytest.raises(ValueError, match=r"do not pair up"):
        dequantize(np.zeros((2, 4, 16), np.uint8), np.zeros((2, 3), np.uint8))
