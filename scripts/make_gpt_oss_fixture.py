"""Build the tiny gpt-oss fixtures under tests/fixtures/hf/ (needs torch + transformers; neither is a meshtrain
dependency: install them in a separate venv, as for scripts/make_hf_fixture.py, and run
    python scripts/make_gpt_oss_fixture.py [--out tests/fixtures/hf]).

  gpt_oss_f32    4 layers (sliding, full, sliding, full: transformers' default layer_types), a window of 16 (shorter
                 than the long prompt), 8 experts, k 2, YaRN with truncate false (asserted here to give other
                 frequencies than truncate true), every bias non-zero, sinks of std 2 (removing them, -inf, changes
                 the logits by more than 1e-2: asserted), swiglu_limit 1.5 so that each clamp (gate above the
                 limit, up above it, up below minus it) acts on some reference token (asserted, by hooks on the
                 experts), and the router's k-th against (k+1)-th biased logit margin above 1e-3 on every token
                 routed (drawn again, seed + 1000, ..., until it holds)
  gpt_oss_mxfp4  the same model with its experts' gate_up_proj and down_proj written in MXFP4 by this script
                 (`*_blocks` U8 [E, out, in / 32, 16], low nibble first; `*_scales` U8 [E, out, in / 32], the power of
                 two + 127; transformers cannot quantize on CPU) and config.json's quantization_config; its reference
                 is transformers' run of that folder loaded with Mxfp4Config(dequantize=True)

Each reference.npz holds fixed tokens and transformers' float32 logits, a prompt's greedy tokens, a >= 400-token
prompt's last logits and greedy tokens, a (4, 24) loss batch with transformers' cross-entropy (`loss`) and, with
output_router_logits on its first 23 positions (a meshtrain window's inputs, the next 23 the targets), its loss with
the balancing term (`loss_aux`, coefficient `aux_coef`) and that term (`aux_loss`), the least routing margin (`margin`) and the clamp counts (`clamps`: gate > limit, up > limit,
up < -limit)."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config

MIN_MARGIN = 1e-3
AUX_COEF = 0.05
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
           num_key_value_heads=2, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
           max_position_embeddings=512, rms_norm_eps=1e-5, swiglu_limit=1.5, router_aux_loss_coef=AUX_COEF,
           output_router_logits=False, tie_word_embeddings=False, initializer_range=0.1, rope_parameters=YARN,
           bos_token_id=1, eos_token_id=2, pad_token_id=None)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


class SmallMargin(Exception):
    pass


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 of w [E, out, in] (in divisible by 32): per block of 32 along `in`, the power of two that brings its
    largest magnitude to at most 6, each value rounded to the nearest e2m1; (blocks [E, out, G, 16], scales)."""
    E, O, I = w.shape
    b = w.reshape(E, O, I // 32, 32).astype(np.float64)
    top = np.maximum(np.abs(b).max(-1), 1e-30)
    exp = np.ceil(np.log2(top / 6.0)).astype(np.int32)
    x = b / np.ldexp(1.0, exp)[..., None]
    code = np.abs(np.abs(x)[..., None] - E2M1).argmin(-1).astype(np.uint8) | ((x < 0) << 3).astype(np.uint8)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + 127).astype(np.uint8)


def write_mxfp4(src: Path, d: Path):
    """The folder `src` with every expert's gate_up_proj and down_proj ([E, in, out] in transformers) written as
    MXFP4 of its [E, out, in] transpose, and quantization_config set."""
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d)
    tensors = load_file(d / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize(np.swapaxes(tensors.pop(name), 1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((d / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router"]}
    (d / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


def clamp_hooks(model, counts: np.ndarray):
    """Hooks counting, on every expert row computed, gate > limit, up > limit and up < -limit (`_apply_gate`
    wrapped: the gate's input is no module's)."""
    def hook(module, args, out):
        limit = module.limit
        gate_up = args[0]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        counts[:] += [int((gate > limit).sum()), int((up > limit).sum()), int((up < -limit).sum())]
    return [_wrap_gate(layer.mlp.experts, hook) for layer in model.model.layers]


class _Handle:
    def __init__(self, experts, orig):
        self.experts, self.orig = experts, orig

    def remove(self):
        self.experts._apply_gate = self.orig


def _wrap_gate(experts, hook):
    orig = experts._apply_gate

    def gate(gate_up):
        hook(experts, (gate_up,), None)
        return orig(gate_up)
    experts._apply_gate = gate
    return _Handle(experts, orig)


def reference(ref, cfg, g, seed: int, check: bool) -> dict:
    """reference.npz's arrays of a loaded model (see the module's docstring); SmallMargin where a choice is close."""
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    prompt = tokens[:1, :6]
    long = torch.randint(0, cfg.vocab_size, (1, 420), generator=g)
    batch = torch.randint(0, cfg.vocab_size, (4, 24), generator=g)
    routed, clamps = [], np.zeros(3, np.int64)
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, o: routed.append(o[0].detach().numpy()))
             for layer in ref.model.layers] + clamp_hooks(ref, clamps)
    opts = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        logits = ref(tokens).logits.numpy().astype(np.float32)
        greedy = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, **opts)
        greedy = greedy[:, prompt.shape[1]:]
        long_logits = ref(long).logits[0, -8:].numpy().astype(np.float32)
        long_greedy = ref.generate(long, attention_mask=torch.ones_like(long), max_new_tokens=8, **opts)
        long_greedy = long_greedy[:, long.shape[1]:]
        ce = float(ref(batch, labels=batch).loss)
        # the balancing term over the 23 input positions a meshtrain window of the batch routes (the targets shifted
        # in: transformers' shift_labels)
        inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        out = ref(inputs, labels=targets, shift_labels=targets, output_router_logits=True)
        for s in (tokens, torch.cat([prompt, greedy], 1), torch.cat([long, long_greedy], 1)):
            ref(s)
    for h in hooks:
        h.remove()
    k = cfg.num_experts_per_tok
    top = np.sort(np.concatenate([r.reshape(-1, cfg.num_local_experts) for r in routed]), -1)
    margin = float((top[:, -k] - top[:, -k - 1]).min())
    if check and margin <= MIN_MARGIN:
        raise SmallMargin(f"seed {seed}: a top-{k} logit margin of {margin:.2e}")
    if check:
        assert (clamps > 0).all(), f"a clamp branch never acts: {clamps}"
    assert abs(float(out.loss) - ce - AUX_COEF * float(out.aux_loss)) < 1e-5  # ce + coef x the pooled term
    return dict(tokens=tokens.numpy().astype(np.int32), logits=logits, prompt=prompt.numpy().astype(np.int32),
                greedy=greedy.numpy().astype(np.int32), long_prompt=long.numpy().astype(np.int32),
                long_logits=long_logits, long_greedy=long_greedy.numpy().astype(np.int32),
                loss_tokens=batch.numpy().astype(np.int32), loss=np.float64(ce), loss_aux=np.float64(out.loss),
                aux_loss=np.float64(out.aux_loss), aux_coef=np.float64(AUX_COEF), margin=np.float64(margin),
                clamps=clamps, seed=np.int64(seed))


def yarn_differs(cfg) -> bool:
    """Whether truncate false gives other inverse frequencies than truncate true (transformers' own yarn init)."""
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"]
    a = init(cfg)[0]
    other = GptOssConfig(**{**CFG, "rope_parameters": {**YARN, "truncate": True}})
    return bool((a - init(other)[0]).abs().max() > 1e-4)


def build(out: Path, seed: int):
    torch.manual_seed(seed)
    cfg = GptOssConfig(**CFG)
    assert yarn_differs(cfg), "truncate does not change the YaRN frequencies: choose another factor or context"
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # every norm, bias and sink random, so that a missing or swapped one shows in the logits
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif n.endswith("sinks"):
                p.copy_(2.0 * torch.randn_like(p))
            elif n.endswith("router.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            elif n.endswith("gate_up_proj"):
                p.copy_(0.25 * torch.randn_like(p))
    d = out / "gpt_oss_f32"
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True)
    ref = GptOssForCausalLM.from_pretrained(d, dtype=torch.float32, experts_implementation="eager").eval()
    arrays = reference(ref, cfg, torch.Generator().manual_seed(seed + 1), seed, True)
    sunk = ref.model.layers
    with torch.no_grad():  # the sinks removed (-inf: no term in the softmax)
        saved = [layer.self_attn.sinks.clone() for layer in sunk]
        for layer in sunk:
            layer.self_attn.sinks.fill_(-float("inf"))
        no_sinks = ref(torch.from_numpy(arrays["tokens"]).long()).logits.numpy()
        for layer, s in zip(sunk, saved):
            layer.self_attn.sinks.copy_(s)
    effect = float(np.abs(no_sinks - arrays["logits"]).max())
    assert effect > 1e-2, f"removing the sinks changes the logits by {effect:.2e} only"
    np.savez_compressed(d / "reference.npz", sink_effect=np.float64(effect), **arrays)
    print(f"gpt_oss_f32 seed {seed}: margin {arrays['margin']:.2e}, clamps {arrays['clamps']}, sinks change the "
          f"logits by {effect:.3f}, ce {arrays['loss']:.6f}, aux {arrays['aux_loss']:.6f}")
    q = out / "gpt_oss_mxfp4"
    write_mxfp4(d, q)
    ref = GptOssForCausalLM.from_pretrained(q, dtype=torch.float32, experts_implementation="eager",
                                            quantization_config=Mxfp4Config(dequantize=True)).eval()
    arrays = reference(ref, cfg, torch.Generator().manual_seed(seed + 1), seed, False)
    np.savez_compressed(q / "reference.npz", **arrays)
    print(f"gpt_oss_mxfp4: margin {arrays['margin']:.2e}, clamps {arrays['clamps']}, ce {arrays['loss']:.6f}")
    for f in (d, q):
        print(f"{f.name}: {sorted(p.name for p in f.iterdir())}, "
              f"{sum(p.stat().st_size for p in f.iterdir()) / 1e3:.0f} kB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"))
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    for i in range(50):
        try:
            build(out, 5678 + 1000 * i)
            break
        except SmallMargin as e:
            print(f"gpt_oss_f32: {e}; drawn again")
    else:
        raise SystemExit(f"no seed of 50 gives margins above {MIN_MARGIN}")
    print({"torch": torch.__version__, "transformers": transformers.__version__})


if __name__ == "__main__":
    main()
