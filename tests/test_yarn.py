"""YaRN RoPE (models/layers.py: yarn_inv_freq, yarn_attention_factor, yarn_softmax_factor) against transformers'
`yarn` rope type for DeepSeek-V3's, gpt-oss's and Qwen's settings and a short one clamped at both ends
(tests/fixtures/rope/yarn.json, made by scripts/make_rope_fixture.py): the inverse frequencies within a few
float32 ulps, the cos/sin factor and DeepSeek's softmax scale to 1e-12."""
import json
from pathlib import Path

import numpy as np
import pytest

from models.layers import yarn_attention_factor, yarn_inv_freq, yarn_softmax_factor

CASES = json.loads((Path(__file__).parent / "fixtures" / "rope" / "yarn.json").read_text())["cases"]


@pytest.mark.parametrize("name", list(CASES))
def test_yarn_equals_transformers(name):
    c = CASES[name]
    inv = yarn_inv_freq(c["head_dim"], c["theta"], c["factor"], c["original_max_position_embeddings"],
                        c.get("beta_fast", 32), c.get("beta_slow", 1), c.get("truncate", True))
    np.testing.assert_allclose(np.asarray(inv), c["inv_freq"], rtol=1e-6, atol=0)  # a few float32 ulps: XLA's pow against torch's
    assert yarn_attention_factor(c["factor"], c.get("mscale"), c.get("mscale_all_dim")) == pytest.approx(
        c["attention_factor"], rel=1e-12)
    if "softmax_scale" in c:
        s = c["softmax_scale"]
        assert s["qk_head_dim"] ** -0.5 * yarn_softmax_factor(c["factor"], c["mscale_all_dim"]) == pytest.approx(
            s["scaling"], rel=1e-12)


def test_the_fixture_tells_the_corrections_apart():
    """mscale 0.707 against mscale_all_dim 1.0 moves the cos/sin factor off 1 (equal, it is exactly 1 and a port that
    ignored it would pass); the untruncated and the clamped ranges differ from what a truncated, unclamped one gives."""
    assert CASES["deepseek_v3"]["attention_factor"] == 1.0
    assert abs(CASES["deepseek_mscales_differ"]["attention_factor"] - 1.0) > 0.05
    c = CASES["gpt_oss_untruncated"]
    truncated = yarn_inv_freq(c["head_dim"], c["theta"], c["factor"], c["original_max_position_embeddings"], 32, 1,
                              True)
    assert not np.allclose(np.asarray(truncated), c["inv_freq"], rtol=1e-4)
