"""Build tests/fixtures/rope/yarn.json: transformers' YaRN inverse frequencies and cos/sin factor for a few
configurations (DeepSeek-V3's, with mscale and mscale_all_dim equal and different; gpt-oss's, untruncated; Qwen's,
without mscale; a short one whose correction range is clamped at both ends). Needs torch + transformers, which
meshtrain does not: install them once in a separate venv and run
    python scripts/make_rope_fixture.py [--out tests/fixtures/rope/yarn.json]
The tests read only the JSON (tests/test_yarn.py)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import transformers
from transformers import DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

QK_NOPE, QK_ROPE = 16, 8  # a DeepSeek attention's query/key widths: its softmax scale reads their sum

CASES = {  # name: (head_dim, theta, rope_parameters beyond rope_type and rope_theta)
    "deepseek_v3": (64, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "deepseek_mscales_differ": (64, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 4096,
                                              "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                              "mscale_all_dim": 1.0}),
    "gpt_oss_untruncated": (64, 150000.0, {"factor": 32.0, "original_max_position_embeddings": 4096,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
    "qwen_no_mscale": (128, 1000000.0, {"factor": 4.0, "original_max_position_embeddings": 32768}),
    "short_clamped": (16, 10000.0, {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                                    "beta_slow": 1}),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/rope/yarn.json"))
    out = {"transformers": transformers.__version__, "cases": {}}
    for name, (head_dim, theta, params) in CASES.items():
        cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                          max_position_embeddings=params["original_max_position_embeddings"] * int(params["factor"]),
                          rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params})
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        out["cases"][name] = {"head_dim": head_dim, "theta": theta, **params,
                              "inv_freq": [float(v) for v in inv.tolist()], "attention_factor": float(factor)}
        if "mscale_all_dim" in params:  # DeepSeek's attention multiplies its softmax scale by YaRN's correction too
            ds = DeepseekV3Config(hidden_size=64, num_attention_heads=2, qk_nope_head_dim=QK_NOPE,
                                  qk_rope_head_dim=QK_ROPE, v_head_dim=16, q_lora_rank=None, kv_lora_rank=16,
                                  max_position_embeddings=cfg.max_position_embeddings,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params})
            out["cases"][name]["softmax_scale"] = {"qk_head_dim": QK_NOPE + QK_ROPE,
                                                   "scaling": float(DeepseekV3Attention(ds, layer_idx=0).scaling)}
    Path(ap.parse_args().out).parent.mkdir(parents=True, exist_ok=True)
    Path(ap.parse_args().out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
