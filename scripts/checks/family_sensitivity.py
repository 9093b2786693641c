"""Issue 30's sensitivity figures: each family's distinguishing feature dropped from the imported model, and how
far its logits then are from transformers' (the parity tests allow 1e-4). Run from the repo root."""
import dataclasses
import sys

sys.path.insert(0, "tests")
import conftest  # noqa: F401,E402  (8 devices)
import numpy as np  # noqa: E402

import models.transformer as transformer  # noqa: E402
from models.transformer import forward, inventory  # noqa: E402
from hf_check import FIX, loaded  # noqa: E402


def off(name, edit):
    s, params = loaded(name, "1dev")
    ref = np.load(FIX / name / "reference.npz")
    c, p = edit(s.model, dict(params))
    return float(np.abs(np.asarray(forward(c, p, ref["tokens"])) - ref["logits"]).max())


def without(*keys):
    return lambda c, p: (c, {**p, "layers": {k: v for k, v in p["layers"].items() if k not in keys}})


def untied(c, p):
    """The tied model read as untied: the head the untied inventory adds, at zero."""
    c = dataclasses.replace(c, tie_embeddings=False)
    extra = {k: np.zeros(v.shape, np.float32) for k, v in inventory(c).items() if k not in p}
    return c, {**p, **extra}


def o_bias(c, p):
    """An o bias the family does not have (as a wrong Qwen2 import would add): a random (d_model,) vector added to
    every attention output, patched into the layer's output projection for this case only."""
    bias = 0.5 * np.random.default_rng(0).standard_normal(c.d_model).astype(np.float32)
    plain = transformer.attn_out
    transformer.attn_out = lambda *a, **k: plain(*a, **k) + bias
    return c, p


CASES = {
    "qwen2 as imported": ("qwen2_tied_bias_f32", lambda c, p: (c, p)),
    "qwen2 without its q/k/v biases": ("qwen2_tied_bias_f32", without("bq", "bk", "bv")),
    "qwen2 with its head untied (a zero head)": ("qwen2_tied_bias_f32", untied),
    "qwen2 with an o bias added": ("qwen2_tied_bias_f32", o_bias),
    "qwen3 as imported": ("qwen3_head_dim_bf16", lambda c, p: (c, p)),
    "qwen3 without its q/k norms": ("qwen3_head_dim_bf16", without("q_norm", "k_norm")),
    "mistral as imported": ("mistral_window16_f32", lambda c, p: (c, p)),
    "mistral without its window": ("mistral_window16_f32", lambda c, p: (dataclasses.replace(c, window=None), p)),
}
for label, (name, edit) in CASES.items():
    plain = transformer.attn_out
    try:
        print(f"{label}: max |logits - transformers'| = {off(name, edit):.3g}")
    finally:
        transformer.attn_out = plain
