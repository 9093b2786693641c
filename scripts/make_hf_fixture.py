"""Build the tiny Hugging Face fixtures under tests/fixtures/hf/ (needs torch + transformers).

Llama, Qwen2, Qwen3, Mistral, Gemma 2 and 3, and the Mixtures of Experts Mixtral, Qwen3-MoE and Qwen2-MoE.

Neither is a meshtrain dependency: install them once in a separate venv and run
    python scripts/make_hf_fixture.py [--out tests/fixtures/hf]
Each fixture folder holds what `save_pretrained` wrote, plus `reference.npz`: fixed token ids,
transformers' float32 logits for them, and its greedy continuation of a prompt. The tests read
only these files (safetensors + numpy), never transformers. The Mixture-of-Experts fixtures add a loss batch
with transformers' cross-entropy and load-balancing loss, and are drawn again (seed + 1000, + 2000, ...) until every
top-k choice on their reference sequences has a margin above MIN_MARGIN; reference.npz records the seed.
    python scripts/make_hf_fixture.py --reference FOLDER
writes only the reference.npz of a folder meshtrain exported (scripts/make_localsgd_fixture.py,
scripts/make_trained_hf_fixture.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3Config, Gemma3ForCausalLM,
                          Gemma3ForConditionalGeneration, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
         "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
         "gemma2": (Gemma2Config, Gemma2ForCausalLM), "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
         "gemma3_vlm": (Gemma3Config, Gemma3ForConditionalGeneration), "mixtral": (MixtralConfig, MixtralForCausalLM),
         "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM)}

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, attention_bias=False, mlp_bias=False, hidden_act="silu",
            bos_token_id=1, eos_token_id=2, pad_token_id=None)

# what the Mixture-of-Experts fixtures share: 4 experts, 2 per token, expert width 72 (not d = 64, so that a
# transposed expert matrix cannot pass), every layer sparse, 512 positions, vocabulary 256 (each folder < 0.8 MB)
MOE = dict(num_experts_per_tok=2, rope_theta=1e6, vocab_size=256, max_position_embeddings=512,
           initializer_range=0.25, output_router_logits=False)
QWEN_MOE = dict(num_experts=4, moe_intermediate_size=72, intermediate_size=128, decoder_sparse_step=1,
                mlp_only_layers=[], rms_norm_eps=1e-6)
MOE_SPEC = dict(dtype=torch.float32, shard=None, long_tokens=420, moe=True)
# the least gap between the k-th and (k+1)-th router logit on the reference sequences: softmax is monotone, so
# the logits' order is the choice, and float32 error in a logit (about 1e-6 here) cannot flip a gap of 1e-3
MIN_MARGIN = 1e-3

FIXTURES = {
    # grouped-query attention (4 query heads, 2 kv heads), untied head, float32, one file
    "gqa_untied_f32": dict(cfg=dict(num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                    rope_theta=10000.0), dtype=torch.float32, shard=None),
    # tied embeddings, Llama 3.x rope scaling, saved as bfloat16
    "tied_llama3_bf16": dict(cfg=dict(num_key_value_heads=1, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                      rope_theta=500000.0,
                                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                        high_freq_factor=4.0, original_max_position_embeddings=64)),
                             dtype=torch.bfloat16, shard=None),
    # a save sharded into two safetensors files with model.safetensors.index.json
    "sharded_f32": dict(cfg=dict(num_key_value_heads=4, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                 rope_theta=10000.0, num_hidden_layers=3), dtype=torch.float32, shard="400KB"),
    # its own head_dim (24, not hidden/heads = 16), a context of 512 positions (past meshtrain's default seq_len),
    # a generation config and a tokenizer of its own; the reference adds greedy tokens after a 400-token prompt
    "head_dim_long_f32": dict(cfg=dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, vocab_size=384,
                                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512),
                              dtype=torch.float32, shard=None, long_prompt=400, tokenizer=True),
    # Qwen2: q/k/v biases (random, non-zero), tied embeddings, rope theta 1e6, a sliding_window the config does
    # not use (use_sliding_window false, as on the hub); weights scaled up (initializer_range) so that greedy
    # decoding is not degenerate; the reference adds a 420-token prompt and its greedy tokens
    "qwen2_tied_bias_f32": dict(arch="qwen2", cfg=dict(num_key_value_heads=2, tie_word_embeddings=True,
                                                       rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=384,
                                                       max_position_embeddings=512, use_sliding_window=False,
                                                       sliding_window=64, max_window_layers=2,
                                                       initializer_range=0.25),
                                dtype=torch.float32, shard=None, long_tokens=420),
    # Qwen3: per-head q/k RMSNorm (random weights), head_dim 24 (not hidden/heads = 16), untied, saved as bfloat16
    "qwen3_head_dim_bf16": dict(arch="qwen3", cfg=dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
                                                       rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=384,
                                                       max_position_embeddings=512, use_sliding_window=False,
                                                       initializer_range=0.25),
                                dtype=torch.bfloat16, shard=None, long_tokens=420),
    # Mistral: a sliding window of 16 positions (the reference tokens are 24 long, the long prompt 420), GQA,
    # untied, 512 positions
    "mistral_window16_f32": dict(arch="mistral", cfg=dict(num_key_value_heads=2, tie_word_embeddings=False,
                                                          rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=384,
                                                          max_position_embeddings=512, sliding_window=16,
                                                          initializer_range=0.25),
                                 dtype=torch.float32, shard=None, long_tokens=420),
    # Gemma 2: 4 layers local, global, local, global (window 16), head_dim 24 with query_pre_attn_scalar 32,
    # soft-caps small enough to bend the scores and logits of these bumped weights, tied embeddings
    "gemma2_mixed_f32": dict(arch="gemma2", cfg=dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=24,
                                                     query_pre_attn_scalar=32, sliding_window=16,
                                                     layer_types=["sliding_attention", "full_attention"] * 2,
                                                     attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
                                                     rms_norm_eps=1e-6, vocab_size=384, max_position_embeddings=512,
                                                     tie_word_embeddings=True, initializer_range=0.25,
                                                     hidden_activation="gelu_pytorch_tanh"),
                             dtype=torch.float32, shard=None, long_tokens=420),
    # Gemma 3: q/k norms, local RoPE base 10^4 and global 10^6 with linear scaling x4, layers global first
    # (local, local, global, local would be the Hub's pattern; this order shows a swapped kind), bfloat16
    "gemma3_mixed_bf16": dict(arch="gemma3", cfg=dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=24,
                                                      query_pre_attn_scalar=32, sliding_window=16,
                                                      layer_types=["full_attention", "sliding_attention",
                                                                   "sliding_attention", "full_attention"],
                                                      rope_parameters={
                                                          "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                             "rope_theta": 1e6},
                                                          "sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 1e4}},
                                                      rms_norm_eps=1e-6, vocab_size=384, max_position_embeddings=512,
                                                      tie_word_embeddings=True, initializer_range=0.25,
                                                      hidden_activation="gelu_pytorch_tanh"),
                              dtype=torch.bfloat16, shard=None, long_tokens=420),
    # Gemma 3's multimodal model (a one-layer SigLIP tower, text weights under model.language_model.*), its
    # config.json in the older Hub form: rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern
    # (local, global), no layer_types; config.transformers5.json is the same config as transformers 5 saves it
    "gemma3_vlm_f32": dict(arch="gemma3_vlm", cfg=dict(
        text_config=dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24,
                         sliding_window=16, rms_norm_eps=1e-6, vocab_size=320, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.25, hidden_activation="gelu_pytorch_tanh"),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8),
        mm_tokens_per_image=4),
        hub_text=dict(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                      sliding_window_pattern=2),
        dtype=torch.float32, shard=None, long_tokens=420),
    # Mixtral: 4 experts, 2 per token (softmax, top 2, renormalised), untied, 2 KV heads, the Hub's aux-loss
    # weight 0.02
    "mixtral_e4k2_f32": dict(arch="mixtral", cfg=dict(**MOE, num_key_value_heads=2, intermediate_size=72,
                                                      num_local_experts=4, router_aux_loss_coef=0.02,
                                                      tie_word_embeddings=False, rms_norm_eps=1e-5),
                             **MOE_SPEC),
    # Qwen3-MoE, norm_topk_prob true: per-head q/k norms, head_dim 24 (not hidden/heads = 16), a dense
    # intermediate_size (128) that no layer uses (decoder_sparse_step 1, no mlp_only_layers), tied
    "qwen3_moe_norm_f32": dict(arch="qwen3_moe", cfg=dict(**MOE, **QWEN_MOE, num_key_value_heads=2, head_dim=24,
                                                          norm_topk_prob=True, tie_word_embeddings=True),
                               **MOE_SPEC),
    # Qwen3-MoE, norm_topk_prob false (the chosen probabilities as they are), head_dim = hidden/heads, untied;
    # config.json names the expert count num_experts, as the Hub's Qwen3-MoE configs do (transformers 5 writes
    # num_local_experts, as the other Qwen3-MoE fixture keeps it)
    "qwen3_moe_nonorm_f32": dict(arch="qwen3_moe", cfg=dict(**MOE, **QWEN_MOE, num_key_value_heads=2,
                                                            norm_topk_prob=False, tie_word_embeddings=False),
                                 hub_keys={"num_local_experts": "num_experts"}, **MOE_SPEC),
    # Qwen2-MoE: a shared expert of width 48 (neither d nor the routed width) behind a sigmoid gate, random q/k/v
    # biases, norm_topk_prob false (as Qwen1.5-MoE), tied
    "qwen2_moe_shared_f32": dict(arch="qwen2_moe", cfg=dict(**MOE, **QWEN_MOE, num_key_value_heads=2, qkv_bias=True,
                                                            shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                            tie_word_embeddings=True, use_sliding_window=False),
                                 **MOE_SPEC),
    # (last: each fixture's seed is 1234 + its place here) Mixtral of 4 layers with its own router_aux_loss_coef
    # (0.02, the Hub's) and output_router_logits true: the reference adds the load-balancing loss of several layers
    # and rows (aux_reference)
    "mixtral_l4_aux_f32": dict(arch="mixtral", cfg=dict(**{**MOE, "output_router_logits": True}, num_hidden_layers=4,
                                                        num_key_value_heads=2, intermediate_size=72,
                                                        num_local_experts=4, router_aux_loss_coef=0.02,
                                                        tie_word_embeddings=False, rms_norm_eps=1e-5),
                               aux=True, **MOE_SPEC),
}
LLAMA_ONLY = ("attention_bias", "mlp_bias")
NOT_GEMMA = ("hidden_act",)


def build(name: str, spec: dict, out: Path, seed: int):
    torch.manual_seed(seed)
    arch = spec.get("arch", "llama")
    config_cls, model_cls = ARCHS[arch]
    base = {k: v for k, v in BASE.items() if (arch == "llama" or k not in LLAMA_ONLY)
            and not (arch.startswith("gemma") and k in NOT_GEMMA)}
    if arch == "gemma3_vlm":  # the text model's keys under text_config, built from the older form's RoPE keys
        text = {**base, **spec["cfg"]["text_config"], **spec["hub_text"]}
        cfg = config_cls(**{**spec["cfg"], "text_config": text})
    else:
        cfg = config_cls(**{**base, **spec["cfg"]})
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random norms and biases too, so that a missing or swapped one shows in the logits
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model = model.to(spec["dtype"])
    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    kw = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
    model.save_pretrained(d, safe_serialization=True, **kw)
    if spec.get("hub_text"):
        hub_form(d, spec["hub_text"])
    if spec.get("hub_keys"):
        hub_keys(d, spec["hub_keys"])
    cfg = cfg.get_text_config()
    # the reference: float32 logits of the saved weights (bf16 values upcast exactly)
    # (an MoE's experts as transformers' per-expert loop: each expert's MLP on its tokens, weighted and summed)
    moe = {"experts_implementation": "eager"} if spec.get("moe") else {}
    ref = model_cls.from_pretrained(d, torch_dtype=torch.float32, **moe).eval()
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    prompt = tokens[:1, :6]
    with torch.no_grad():
        logits = ref(tokens).logits.numpy().astype(np.float32)
        # every prompt token attended (without the mask, generate would take the pad id 0 in a prompt as padding)
        greedy = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[:, prompt.shape[1]:].numpy()
    extra = {}
    if spec.get("tokenizer"):
        tok = tokenizer(d, cfg)
        # a text of at least long_prompt tokens under that tokenizer (this file's words, in order)
        words, text = Path(__file__).read_text().split(), ""
        while len(tok.encode(text).ids) < spec["long_prompt"]:
            text += words.pop(0) + " "
        long = torch.tensor([tok.encode(text).ids])
        with torch.no_grad():
            out = ref.generate(long, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        extra = dict(long_text=np.array(text), long_prompt=long.numpy().astype(np.int32),
                     long_greedy=out[:, long.shape[1]:].numpy().astype(np.int32))
    if spec.get("long_tokens"):  # a prompt of random ids, longer than any window: its last logits and greedy tokens
        long = torch.randint(0, cfg.vocab_size, (1, spec["long_tokens"]), generator=g)
        with torch.no_grad():
            long_logits = ref(long).logits[0, -8:].numpy().astype(np.float32)
            out = ref.generate(long, attention_mask=torch.ones_like(long), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        extra = dict(long_prompt=long.numpy().astype(np.int32), long_logits=long_logits,
                     long_greedy=out[:, long.shape[1]:].numpy().astype(np.int32))
    if spec.get("moe"):  # every sequence the reference routes: the tokens, the prompt and its greedy tokens, the long
        seqs = [tokens, torch.cat([prompt, torch.from_numpy(greedy)], 1),
                torch.cat([long, torch.from_numpy(extra["long_greedy"]).long()], 1)]
        extra.update(moe_reference(ref, seqs, g, seed))
    if spec.get("aux"):
        extra.update(aux_reference(ref, g, seed))
    np.savez_compressed(d / "reference.npz", tokens=tokens.numpy().astype(np.int32), logits=logits,
                        prompt=prompt.numpy().astype(np.int32), greedy=greedy.astype(np.int32), **extra)
    files = sorted(p.name for p in d.iterdir())
    print(f"{name}: {files}, {sum(p.stat().st_size for p in d.iterdir()) / 1e3:.0f} kB")


class SmallMargin(Exception):
    """A top-k choice of an MoE fixture's reference within MIN_MARGIN (router logit) of a flip."""


def moe_reference(ref, seqs: list, g: torch.Generator, seed: int) -> dict:
    """An MoE fixture's additions to reference.npz: a (4, 24) loss batch (`loss_tokens`) with transformers'
    next-token cross-entropy (`loss`), its load-balancing loss (`aux_loss`, load_balancing_loss_func over the whole
    batch and every layer, as the model returns it with output_router_logits), the same function on each layer's
    rows one at a time (`aux_loss_rows`, (layers, rows)), the router logits ((layers, rows x positions, experts)), the
    least top-k margins over `seqs` and the loss batch (`margin_prob`, `margin_logit`) and the `seed`. Raises
    SmallMargin when a choice is within MIN_MARGIN (in router logit) of a flip."""
    E, k, coef = ref.num_experts, ref.num_experts_per_tok, ref.router_aux_loss_coef
    balance = sys.modules[type(ref).__module__].load_balancing_loss_func
    batch = torch.randint(0, ref.config.vocab_size, (4, 24), generator=g)
    with torch.no_grad():
        ce = ref(batch, labels=batch, output_router_logits=False).loss
        out = ref(batch, labels=batch, output_router_logits=True)
        routed = [ref(s, output_router_logits=True).router_logits for s in seqs] + [out.router_logits]
    router = torch.stack(out.router_logits)  # (layers, rows x positions, experts)
    assert abs(float(out.loss - ce - coef * out.aux_loss)) < 1e-6  # transformers' objective: ce + coef x aux
    rows = router.view(len(router), *batch.shape, E)
    aux_rows = [[float(balance((r,), E, k)) for r in layer] for layer in rows]
    logits = torch.cat([torch.cat(r) for r in routed]).float()
    top_p = torch.softmax(logits, -1).topk(k + 1, -1).values
    top_l = logits.topk(k + 1, -1).values
    margin_p, margin_l = float((top_p[:, k - 1] - top_p[:, k]).min()), float((top_l[:, k - 1] - top_l[:, k]).min())
    if margin_l <= MIN_MARGIN:
        raise SmallMargin(f"seed {seed}: a top-{k} logit margin of {margin_l:.2e} over {len(logits)} routings")
    print(f"seed {seed}: least top-{k} margin {margin_l:.2e} (logit), {margin_p:.2e} (probability) over "
          f"{len(logits)} routings; loss {float(ce):.6f}, aux {float(out.aux_loss):.6f}")
    return dict(loss_tokens=batch.numpy().astype(np.int32), loss=np.float64(ce), aux_loss=np.float64(out.aux_loss),
                aux_loss_rows=np.array(aux_rows), router_logits=router.numpy().astype(np.float32),
                margin_prob=np.float64(margin_p), margin_logit=np.float64(margin_l), seed=np.int64(seed))


def aux_reference(ref, g: torch.Generator, seed: int) -> dict:
    """The several-layer fixture's additions to reference.npz, on (4, 25) windows `aux_windows` (each a meshtrain
    window: 24 inputs, the next 24 their targets), transformers run on the inputs with output_router_logits and the
    targets as `shift_labels`: the cross-entropy `aux_ce` and the model's pooled load-balancing loss `aux_pooled`
    (load_balancing_loss_func over every layer's rows at once, as the model adds it) of the 4 rows and of row 0 alone
    (`aux_ce_row0`, `aux_pooled_row0`); the router logits `aux_router_logits` (layers, rows, positions, experts);
    load_balancing_loss_func on each layer's each row alone (`aux_per_row`, (layers, rows)); the gradient norm over
    every parameter of cross-entropy + coef x the mean over layers and rows of those (meshtrain's objective: the
    4 rows `aux_grad_norm`, row 0 `aux_grad_norm_row0`). Raises SmallMargin as moe_reference."""
    E, k, coef = ref.num_experts, ref.num_experts_per_tok, ref.router_aux_loss_coef
    balance = sys.modules[type(ref).__module__].load_balancing_loss_func
    windows = torch.randint(0, ref.config.vocab_size, (4, 25), generator=g)
    out, extra = {}, {}
    for tag, rows in (("", windows), ("_row0", windows[:1])):
        inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        ref.zero_grad()
        o = ref(inputs, labels=targets, shift_labels=targets, output_router_logits=True)
        ce = o.loss - coef * o.aux_loss  # transformers' objective: ce + coef x the pooled aux_loss
        router = torch.stack(o.router_logits).view(len(o.router_logits), *inputs.shape, E)
        per_row = torch.stack([torch.stack([balance((r,), E, k) for r in layer]) for layer in router])
        (ce + coef * per_row.mean()).backward()
        norm = torch.sqrt(sum(torch.sum(p.grad.double() ** 2) for p in ref.parameters() if p.grad is not None))
        out.update({f"aux_ce{tag}": np.float64(ce.detach()), f"aux_pooled{tag}": np.float64(o.aux_loss.detach()),
                    f"aux_grad_norm{tag}": np.float64(norm)})
        if not tag:
            extra = dict(aux_router_logits=router.detach().numpy().astype(np.float32),
                         aux_per_row=per_row.detach().numpy().astype(np.float64))
    ref.zero_grad()
    top = np.sort(extra["aux_router_logits"].reshape(-1, E), axis=-1)
    margin = float((top[:, E - k] - top[:, E - k - 1]).min())
    if margin <= MIN_MARGIN:
        raise SmallMargin(f"seed {seed}: a top-{k} logit margin of {margin:.2e} on the aux windows")
    print(f"aux windows: margin {margin:.2e}; ce {out['aux_ce']:.6f}, pooled {out['aux_pooled']:.6f}, mean per "
          f"layer and row {extra['aux_per_row'].mean():.6f}, row 0 pooled {out['aux_pooled_row0']:.6f}, "
          f"mean per layer {extra['aux_per_row'][:, 0].mean():.6f}")
    return dict(aux_windows=windows.numpy().astype(np.int32), **out, **extra)


def draw(name: str, spec: dict, out: Path, seed: int, tries: int = 50):
    """build; an MoE fixture again with seed + 1000, + 2000, ... until its top-k margins pass."""
    for i in range(tries):
        try:
            return build(name, spec, out, seed + 1000 * i)
        except SmallMargin as e:
            print(f"{name}: {e}; drawn again")
    raise SystemExit(f"{name}: no seed of {tries} gives top-k margins above {MIN_MARGIN}")


def hub_form(d: Path, hub_text: dict):
    """config.json rewritten in the older Hub form (the text config's RoPE and layer kinds as hub_text's keys),
    transformers' own form kept as config.transformers5.json; transformers reads the older form back to it."""
    new = json.loads((d / "config.json").read_text())
    (d / "config.transformers5.json").write_text(json.dumps(new, indent=2) + "\n")
    old = json.loads(json.dumps(new))
    for k in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        old["text_config"].pop(k, None)
    old["text_config"].update(hub_text)
    (d / "config.json").write_text(json.dumps(old, indent=2) + "\n")
    back = transformers.AutoConfig.from_pretrained(d).get_text_config()
    assert back.layer_types == new["text_config"]["layer_types"], back.layer_types
    assert back.rope_parameters == new["text_config"]["rope_parameters"], back.rope_parameters


def hub_keys(d: Path, renames: dict):
    """config.json's keys renamed to the Hub's names (transformers reads the same config back)."""
    new = json.loads((d / "config.json").read_text())
    old = {renames.get(k, k): v for k, v in new.items()}
    (d / "config.json").write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
    back = transformers.AutoConfig.from_pretrained(d).to_dict()
    want = transformers.AutoConfig.for_model(**new).to_dict()
    assert {**back, "_name_or_path": ""} == want, (back, want)


def tokenizer(d: Path, cfg):
    """A byte-level BPE of at most vocab_size ids trained on this file, saved as transformers saves one, and a
    generation config with the model's special ids (what an export must keep)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(Path(__file__).read_text().splitlines(), trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", model_max_length=cfg.max_position_embeddings)
    fast.save_pretrained(d)
    gen = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, max_length=cfg.max_position_embeddings,
                                        do_sample=False)
    gen.save_pretrained(d)
    return tok


def reference(d: Path, seed: int = 99):
    """reference.npz of an existing folder (any family, by its config.json): fixed tokens and transformers'
    float32 logits for them."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    assert type(ref).__name__ in json.loads((d / "config.json").read_text())["architectures"]
    tokens = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = ref(tokens).logits.numpy().astype(np.float32)
    np.savez_compressed(d / "reference.npz", tokens=tokens.numpy().astype(np.int32), logits=logits)
    (d / "versions.json").write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__},
                                                indent=1) + "\n")
    print(f"{d}: reference.npz written")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"))
    ap.add_argument("--reference", help="only write reference.npz for this existing folder")
    ap.add_argument("--only", help="build only this fixture (the others are left as they are)")
    args = ap.parse_args()
    if args.reference:
        return reference(Path(args.reference))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, spec) in enumerate(FIXTURES.items()):
        if args.only in (None, name):
            draw(name, spec, out, seed=1234 + i)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    (out / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")
    print(versions)


if __name__ == "__main__":
    main()
