"""The families' sensitivity figures: each distinguishing feature dropped from the imported model, and how far its
logits then are from transformers' (the parity tests allow 1e-4), on the 24 reference tokens and, for the Gemma
fixtures (whose window is 16), on the last 8 positions of the 420-token prompt. Run from the repo root."""
import dataclasses
import sys

sys.path.insert(0, "tests")
import conftest  # noqa: F401,E402  (8 devices)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import models.families.gemma as gemma  # noqa: E402
import models.transformer as transformer  # noqa: E402
from models.transformer import forward, inventory  # noqa: E402
from hf_check import FIX, loaded  # noqa: E402


def off(name, edit):
    s, params = loaded(name, "1dev")
    ref = np.load(FIX / name / "reference.npz")
    c, p = edit(s.model, dict(params))
    short = float(np.abs(np.asarray(forward(c, p, ref["tokens"])) - ref["logits"]).max())
    if not name.startswith("gemma"):
        return short
    long = np.asarray(forward(c, p, ref["long_prompt"]))[0, -8:]
    return max(short, float(np.abs(long - ref["long_logits"]).max()))


def model(**kw):
    return lambda c, p: (dataclasses.replace(c, **kw), p)


def erf_gelu(c, p):
    """The exact (erf) GELU in place of the tanh one, patched into Gemma's GeGLU for this case only."""
    gemma.geglu = lambda gate, up: jax.nn.gelu(gate, approximate=False) * up
    return c, p


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
    "mistral without its window": ("mistral_window16_f32", model(window=None)),
}
G2, G3, VLM = "gemma2_mixed_f32", "gemma3_mixed_bf16", "gemma3_vlm_f32"
for name in (G2, G3, VLM):
    g = name.split("_")[0] + (" (multimodal folder)" if name == VLM else "")
    CASES.update({
        f"{g} as imported": (name, lambda c, p: (c, p)),
        f"{g} without the sqrt(d) embedding scale": (name, model(embed_scale=False)),
        f"{g} with norm gains w, not 1 + w": (name, model(norm_plus_one=False)),
        f"{g} without its post-attention and post-MLP norms": (name, without("post_attn_norm", "post_mlp_norm")),
        f"{g} with the erf GELU, not tanh": (name, erf_gelu),
        f"{g} scaled by head_dim, not query_pre_attn_scalar": (name, model(query_scale=None)),
        f"{g} with every layer global": (name, model(local_layers=(False,) * 4 if name != VLM else (False, False))),
    })
    if name == G2:
        CASES.update({f"{g} without the attention soft-cap": (name, model(attn_softcap=None)),
                      f"{g} without the final soft-cap": (name, model(final_softcap=None))})
    else:
        CASES.update({f"{g} without its q/k norms": (name, without("q_norm", "k_norm")),
                      f"{g} with the global RoPE base on the local layers": (name, model(rope_local_theta=None)),
                      f"{g} without the global layers' linear RoPE scaling": (name, model(rope_linear=None))})
only = sys.argv[1:]  # labels containing any of these words (all by default)
for label, (name, edit) in CASES.items():
    if only and not any(w in label for w in only):
        continue
    plain, geglu = transformer.attn_out, gemma.geglu
    try:
        print(f"{label}: max |logits - transformers'| = {off(name, edit):.3g}")
    finally:
        transformer.attn_out, gemma.geglu = plain, geglu
