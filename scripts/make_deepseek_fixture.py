"""Build the tiny DeepSeek-V3 fixtures under tests/fixtures/hf/ (needs torch + transformers; neither is a meshtrain
dependency: install them in a separate venv, as for scripts/make_hf_fixture.py, and run
    python scripts/make_deepseek_fixture.py [--out tests/fixtures/hf]).

  deepseek_v3_f32        2 dense + 2 MoE layers, 8 routed experts in 4 groups (the best 2 kept), k 2, 1 shared
                         expert, q_lora_rank 24, interleaved RoPE under YaRN with mscale 0.707 != mscale_all_dim 1.0
                         (so that the cos/sin factor is not 1); layer 3's correction bias drawn in [-1.2, 0.1], so
                         that masking the dropped groups with 0.0 instead of -inf chooses other experts on some token
                         (asserted here)
  kimi_k2_f32            Kimi-K2's shape: one group, 1 dense + 2 MoE layers, config.json's model_type `kimi_k2` (as
                         transformers' kimi_k25 names its text model)
  deepseek_v3_qproj_f32  q_lora_rank null (one q_proj), plain RoPE
  glm4_moe_lite_f32      GLM-4.7-Flash's form (Glm4MoeLiteForCausalLM): its dense layer by mlp_layer_types, 2 groups

Each folder holds what `save_pretrained` wrote and reference.npz: fixed tokens and transformers' float32 logits, a
prompt's greedy tokens, a >= 400-token prompt's last logits and greedy tokens, a (4, 24) loss batch with
transformers' cross-entropy, and the least routing margins over every sequence routed: `margin_group` (the
topk_group-th group score against the next) and `margin_expert` (the k-th biased score against the next within the
kept groups), each drawn again (seed + 1000, ...) until both exceed 1e-3."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

ARCHS = {"deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM), "glm": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM)}

MIN_MARGIN = 1e-3
# the >= 400-token prompt's routings (429 tokens x each MoE layer) hold margins of 1e-4 at best on any seed tried
# (sigmoid scores in (0, 1), 8 experts); float32's error in a score is about 1e-7
LONG_MARGIN = 1e-5
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=40, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, norm_topk_prob=True,
            routed_scaling_factor=2.5, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=None, hidden_act="silu")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}
FIXTURES = {
    "deepseek_v3_f32": dict(cfg=dict(num_hidden_layers=4, first_k_dense_replace=2, n_group=4, topk_group=2,
                                     q_lora_rank=24, rope_interleave=True, rope_parameters=YARN),
                            negative_bias_layer=3),
    "kimi_k2_f32": dict(cfg=dict(num_hidden_layers=3, first_k_dense_replace=1, n_group=1, topk_group=1,
                                 q_lora_rank=24, rope_interleave=True, rope_parameters=YARN),
                        model_type="kimi_k2"),
    "deepseek_v3_qproj_f32": dict(cfg=dict(num_hidden_layers=3, first_k_dense_replace=1, n_group=4, topk_group=2,
                                           q_lora_rank=None, rope_interleave=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # GLM-4.7-Flash's form: its dense layers by mlp_layer_types
    "glm4_moe_lite_f32": dict(arch="glm", cfg=dict(num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
                                                   n_group=2, topk_group=1, q_lora_rank=24, rope_interleave=True,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


class SmallMargin(Exception):
    pass


def margins(logits: np.ndarray, bias: np.ndarray, groups: int, kept: int, k: int) -> tuple[float, float, bool]:
    """(least group margin, least expert margin, whether 0.0-masking chooses otherwise on some token) of a layer's
    router logits (N, X): DeepSeek's choice written out in NumPy (float64)."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    biased = scores + bias
    N, X = biased.shape
    per = biased.reshape(N, groups, X // groups)
    gscore = np.sort(per, -1)[..., -min(2, X // groups):].sum(-1)
    order = np.sort(gscore, -1)
    g_margin = float((order[:, -kept] - order[:, -kept - 1]).min()) if kept < groups else np.inf
    keep = np.zeros((N, groups), bool)
    np.put_along_axis(keep, np.argsort(-gscore, -1)[:, :kept], True, -1)
    mask = np.repeat(keep, X // groups, -1)
    masked = np.where(mask, biased, -np.inf)
    top = np.sort(masked, -1)
    e_margin = float((top[:, -k] - top[:, -k - 1]).min())
    zero = np.where(mask, biased, 0.0)
    differs = bool((np.sort(np.argsort(-zero, -1)[:, :k], -1) != np.sort(np.argsort(-masked, -1)[:, :k], -1)).any())
    return g_margin, e_margin, differs


def build(name: str, spec: dict, out: Path, seed: int):
    torch.manual_seed(seed)
    config_cls, model_cls = ARCHS[spec.get("arch", "deepseek_v3")]
    cfg = config_cls(**{**BASE, **spec["cfg"]})
    model = model_cls(cfg).eval()
    first = getattr(cfg, "first_k_dense_replace", None)
    first = first if first is not None else cfg.mlp_layer_types.index("sparse")
    with torch.no_grad():  # random norms and biases, so that a missing or swapped one shows in the logits
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("mlp.gate.weight"):  # router logits of std ~2: sigmoid scores spread over (0, 1)
                p.copy_(0.25 * torch.randn_like(p))
        for i, layer in enumerate(model.model.layers):
            if i >= first:
                b = layer.mlp.gate.e_score_correction_bias
                lo, hi = (-1.2, 0.1) if i == spec.get("negative_bias_layer") else (-0.1, 0.1)
                b.copy_(lo + (hi - lo) * torch.rand_like(b))
    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True)
    ref = model_cls.from_pretrained(d, torch_dtype=torch.float32, experts_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    prompt = tokens[:1, :6]
    long = torch.randint(0, cfg.vocab_size, (1, 420), generator=g)
    batch = torch.randint(0, cfg.vocab_size, (4, 24), generator=g)
    routed = {}
    ref_hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: routed.setdefault(i, []).append(
        (o[0] if isinstance(o, tuple) else o).detach().reshape(-1, cfg.n_routed_experts).numpy()))
        for i, layer in enumerate(ref.model.layers) if i >= first]
    with torch.no_grad():
        logits = ref(tokens).logits.numpy().astype(np.float32)
        opts = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        greedy = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, **opts)
        greedy = greedy[:, prompt.shape[1]:].numpy()
        long_logits = ref(long).logits[0, -8:].numpy().astype(np.float32)
        long_out = ref.generate(long, attention_mask=torch.ones_like(long), max_new_tokens=8, **opts)
        long_greedy = long_out[:, long.shape[1]:].numpy()
        ce = float(ref(batch, labels=batch).loss)
        routed.clear()
        for s in (tokens, torch.cat([prompt, torch.from_numpy(greedy)], 1), batch):  # the short sequences, whole
            ref(s)
        short = {i: len(v) for i, v in routed.items()}
        ref(long_out)
    for h in ref_hooks:
        h.remove()
    g_m, e_m, long_m, differs = np.inf, np.inf, np.inf, {}
    for i, outs in routed.items():
        bias = ref.model.layers[i].mlp.gate.e_score_correction_bias.detach().numpy().astype(np.float64)
        kw = dict(groups=cfg.n_group, kept=cfg.topk_group, k=cfg.num_experts_per_tok)
        gm, em, diff = margins(np.concatenate(outs[:short[i]]), bias, **kw)
        g_m, e_m, differs[i] = min(g_m, gm), min(e_m, em), diff
        long_m = min(long_m, *margins(np.concatenate(outs[short[i]:]), bias, **kw)[:2])
    if min(g_m, e_m) <= MIN_MARGIN or long_m <= LONG_MARGIN:
        raise SmallMargin(f"seed {seed}: least margins group {g_m:.2e}, expert {e_m:.2e}, long prompt {long_m:.2e}")
    if "negative_bias_layer" in spec:
        assert differs[spec["negative_bias_layer"]], "0.0 masking chooses as -inf on every token: draw another bias"
    print(f"{name} seed {seed}: margins group {g_m:.2e} expert {e_m:.2e}, long prompt {long_m:.2e}; 0.0 masking differs {differs}; ce {ce:.6f}")
    if spec.get("model_type"):
        c = json.loads((d / "config.json").read_text())
        c["model_type"] = spec["model_type"]
        (d / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    np.savez_compressed(d / "reference.npz", tokens=tokens.numpy().astype(np.int32), logits=logits,
                        prompt=prompt.numpy().astype(np.int32), greedy=greedy.astype(np.int32),
                        long_prompt=long.numpy().astype(np.int32), long_logits=long_logits,
                        long_greedy=long_greedy.astype(np.int32), loss_tokens=batch.numpy().astype(np.int32),
                        loss=np.float64(ce), margin_group=np.float64(g_m), margin_expert=np.float64(e_m),
                        margin_long=np.float64(long_m),
                        zero_mask_differs=np.array(any(differs.values())), seed=np.int64(seed))
    print(f"{name}: {sorted(p.name for p in d.iterdir())}, {sum(p.stat().st_size for p in d.iterdir()) / 1e3:.0f} kB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"))
    ap.add_argument("--only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for j, (name, spec) in enumerate(FIXTURES.items()):
        if args.only not in (None, name):
            continue
        for i in range(50):
            try:
                build(name, spec, out, 4321 + j + 1000 * i)
                break
            except SmallMargin as e:
                print(f"{name}: {e}; drawn again")
        else:
            raise SystemExit(f"{name}: no seed of 50 gives margins above {MIN_MARGIN}")
    print({"torch": torch.__version__, "transformers": transformers.__version__})


if __name__ == "__main__":
    main()
