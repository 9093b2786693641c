"""Multi-head latent attention (models/families/mla.py) against transformers' DeepseekV3Attention on random weights
(tests/fixtures/mla/, made by scripts/make_mla_fixture.py): queries through q_lora_rank with interleaved RoPE under
YaRN (mscale 0.707, mscale_all_dim 1.0: the cos/sin factor off 1) and through one q_proj with plain RoPE; values 12
wide against keys of 16 + 8; the output within 1e-5, the softmax scale to 1e-12. The weights are laid out here from
transformers' (out, in) tensors into meshtrain's (in, ...) ones."""
import functools
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from models.families.mla import latent_attention
from models.kernels.attention import attention
from models.layers import rope_inv_freq, yarn_attention_factor, yarn_inv_freq, yarn_softmax_factor

FIX = Path(__file__).parent / "fixtures" / "mla"


def _weights(d, c) -> dict:
    H, E, Ev, D = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"], \
        c["hidden_size"]
    w = {k[2:]: d[k] for k in d.files if k.startswith("w/")}
    out = {"wkv_a": w["kv_a_proj_with_mqa.weight"].T, "kv_norm": w["kv_a_layernorm.weight"],
           "wkv_b": w["kv_b_proj.weight"].T.reshape(c["kv_lora_rank"], H, c["qk_nope_head_dim"] + Ev),
           "wo": w["o_proj.weight"].T.reshape(H, Ev, D)}
    if c["q_lora_rank"] is None:
        out["wq"] = w["q_proj.weight"].T.reshape(D, H, E)
    else:
        out.update(wq_a=w["q_a_proj.weight"].T, q_norm=w["q_a_layernorm.weight"],
                   wq_b=w["q_b_proj.weight"].T.reshape(c["q_lora_rank"], H, E))
    return {k: jnp.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("name", ["q_lora_interleave_yarn", "q_proj_plain"])
def test_latent_attention_equals_transformers(name):
    d = np.load(FIX / f"{name}.npz")
    c = json.loads(str(d["config"]))
    r, T, Er = c["rope"], d["x"].shape[1], c["qk_rope_head_dim"]
    scale = (c["qk_nope_head_dim"] + Er) ** -0.5
    if r["rope_type"] == "yarn":
        inv = yarn_inv_freq(Er, r["rope_theta"], r["factor"], r["original_max_position_embeddings"],
                            r["beta_fast"], r["beta_slow"])
        factor = yarn_attention_factor(r["factor"], r["mscale"], r["mscale_all_dim"])
        scale *= yarn_softmax_factor(r["factor"], r["mscale_all_dim"])
        assert abs(factor - 1) > 0.01  # the fixture's cos/sin factor is not 1: a port that drops it fails
    else:
        inv, factor = rope_inv_freq(Er, r["rope_theta"]), 1.0
    assert scale == pytest.approx(float(d["scaling"]), rel=1e-12)
    ang = jnp.arange(T, dtype=jnp.float32)[:, None] * inv
    cos, sin = jnp.cos(ang) * factor, jnp.sin(ang) * factor
    np.testing.assert_allclose(np.asarray(cos), d["cos"][:, :Er // 2], rtol=1e-5, atol=1e-6)  # transformers' tables
    fn = functools.partial(attention, impl="manual", block=4, platform="cpu")
    y = latent_attention(_weights(d, c), jnp.asarray(d["x"]), cos, sin, fn, scale, c["qk_nope_head_dim"],
                         c["rope_interleave"], c["rms_norm_eps"])
    np.testing.assert_allclose(np.asarray(y), d["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["q_lora_interleave_yarn", "q_proj_plain"])
def test_decoding_from_the_latent_cache_equals_transformers_at_every_position(name):
    """The cache holds each token's latent and RoPE key (kv_lora_rank + qk_rope_head_dim numbers per token: asserted
    from its arrays); the attention by the absorbed up-projections, all positions against the cache at once (causal
    by position) and the last three tokens one at a time against its prefix: transformers' output, within 1e-5."""
    from models.families.mla import absorbed_attention, latents
    d = np.load(FIX / f"{name}.npz")
    c = json.loads(str(d["config"]))
    p, x, T, Er = _weights(d, c), jnp.asarray(d["x"]), d["x"].shape[1], c["qk_rope_head_dim"]
    cos, sin = jnp.asarray(d["cos"][:, :Er // 2]), jnp.asarray(d["sin"][:, :Er // 2])
    kw = dict(scale=float(d["scaling"]), nope=c["qk_nope_head_dim"], interleave=c["rope_interleave"],
              eps=c["rms_norm_eps"])
    cache = latents(p, x, cos, sin, c["rope_interleave"], c["rms_norm_eps"])
    assert [a.shape for a in cache] == [(2, T, c["kv_lora_rank"]), (2, T, Er)]
    y = absorbed_attention(p, x, cos, sin, cache, jnp.arange(T), jnp.arange(T), **kw)
    np.testing.assert_allclose(np.asarray(y), d["y"], rtol=1e-5, atol=1e-5)
    for t in range(T - 3, T):
        one = tuple(a[:, :t + 1] for a in cache)
        y = absorbed_attention(p, x[:, t:t + 1], cos[t:t + 1], sin[t:t + 1], one, jnp.arange(t, t + 1),
                               jnp.arange(t + 1), **kw)
        np.testing.assert_allclose(np.asarray(y[:, 0]), d["y"][:, t], rtol=1e-5, atol=1e-5, err_msg=f"position {t}")
