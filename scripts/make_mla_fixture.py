"""Build tests/fixtures/mla/: transformers' DeepseekV3Attention (multi-head latent attention) on random weights
and inputs, one .npz per case (its weights under transformers' names, the input, the RoPE tables' cos and sin, the
output, the config's numbers): with q_lora_rank set and interleaved RoPE under YaRN whose mscale (0.707) differs from
mscale_all_dim (1.0), and with q_lora_rank null and plain RoPE. Needs torch + transformers, which meshtrain does
not: install them once in a separate venv and run
    python scripts/make_mla_fixture.py [--out tests/fixtures/mla]
The tests read only the .npz files (tests/test_mla.py)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

T = 20
BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, rms_norm_eps=1e-6, attention_bias=False)
CASES = {
    "q_lora_interleave_yarn": dict(q_lora_rank=24, rope_interleave=True, max_position_embeddings=256,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 64, "beta_fast": 32,
                                                    "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}),
    "q_proj_plain": dict(q_lora_rank=None, rope_interleave=False, max_position_embeddings=128,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/mla"))
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, extra) in enumerate(CASES.items()):
        torch.manual_seed(100 + i)
        cfg = DeepseekV3Config(**BASE, **extra)
        cfg._attn_implementation = "eager"
        attn = DeepseekV3Attention(cfg, layer_idx=0).eval()
        with torch.no_grad():
            for n, p in attn.named_parameters():
                p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 2 else 0.2) + (1.0 if p.ndim == 1 else 0.0))
            x = torch.randn(2, T, cfg.hidden_size)
            cos, sin = DeepseekV3RotaryEmbedding(cfg)(x, torch.arange(T)[None].expand(2, -1))
            mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(2, 1, T, T)
            y = attn(x, (cos, sin), mask)[0]
        numbers = {k: v for k, v in {**BASE, **extra}.items() if k != "rope_parameters"}
        np.savez(out / f"{name}.npz", x=x.numpy(), y=y.numpy(), cos=cos[0].numpy(), sin=sin[0].numpy(),
                 scaling=np.float64(attn.scaling), config=json.dumps({**numbers, "rope": extra["rope_parameters"]}),
                 transformers=transformers.__version__,
                 **{f"w/{n}": p.detach().numpy() for n, p in attn.named_parameters()})


if __name__ == "__main__":
    main()
