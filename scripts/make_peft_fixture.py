"""Build the LoRA fixtures under tests/fixtures/peft/ (needs torch, transformers and peft 0.21: neither is a meshtrain
dependency; install them in a separate venv, as for scripts/make_hf_fixture.py, and run
    python scripts/make_peft_fixture.py [--meshtrain .venv/bin/python]).

  llama_base         a tiny random Llama (2 layers, 512 positions, untied head) saved by transformers
  peft_r4            an adapter made by peft on it: r 4, alpha 8, q/v/o/down_proj, init_lora_weights=False (A and B
                     random, B non-zero); reference.npz: PeftModel's logits on (2, 24) tokens and the last 8 of a
                     420-token prompt
  peft_r4_rslora     the same with use_rslora (scale alpha / sqrt(r))
  peft_r4_lm_head    the same with modules_to_save lm_head and embed_tokens, their copies moved by noise
  peft_mixtral_r4    an adapter peft drew (B non-zero, r 4) on the attention of tests/fixtures/hf/mixtral_e4k2_f32 (4
                     experts, k 2; the experts' own projections are not adapted: meshtrain refuses them for now), and
                     PeftModel's logits of it
  peft_mixtral_experts_r4  the same with its experts adapted too (target_parameters mlp.experts.gate_up_proj and
                     mlp.experts.down_proj: transformers 5's packed experts)
  peft_mixtral_fused_r4  the same with gate_up_proj's adapter at rank 8 and alpha 16 (rank_pattern/alpha_pattern
                     `.*\.gate_up_proj`: the form peft converts transformers 4's w1 and w3 adapters into)
  trained_mixtral    the same of tests/fixtures/hf/mixtral_e4k2_f32, the experts split over data, its attention and
                     its packed experts adapted
  sft                meshtrain's SFT with LoRA (rank 8 on every projection, the tied embedding trained whole) on
                     tests/fixtures/generate's Llama, 20 steps on tests/fixtures/chat's conversations (SFT, the
                     command in command.json), exported with `--format peft` (ensure_weight_tying: the head is the
                     trained embedding), loaded by PeftModel: its logits of (2, 32) tokens in reference.npz
  trained            meshtrain's own: 3 SGD steps of LoRA (r 4, alpha 8, q/v/o/down_proj) from llama_base on (2,1,4)
                     ZeRO-3 (the command below, run by this script with --meshtrain's Python), exported with
                     `meshtrain export --format peft`, then loaded by PeftModel.from_pretrained: its logits on the
                     same tokens and prompt, and the base's, in reference.npz; and `merged/`, meshtrain's
                     `export --format hf --merge`, loaded by transformers: its logits (merged_logits)
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
# meshtrain's run (recorded in trained/command.json, which tests/test_lora_peft.py trains again)
TRAIN = ["model.preset=tiny", "model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,v_proj,o_proj,down_proj]",
         "mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3", "train.optimizer=sgd", "train.lr=0.5",
         "train.grad_clip=0", "train.warmup_steps=0", "train.steps=3", "train.batch_size=4", "model.seq_len=32",
         "checkpoint.every=3", "run.log_every=1", "run.progress=false"]


def inputs(vocab: int):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (2, 24), generator=g), torch.randint(0, vocab, (1, 420), generator=g)


def logits_of(model, vocab: int) -> dict:
    tokens, long = inputs(vocab)
    with torch.no_grad():
        return dict(tokens=tokens.numpy().astype(np.int32), logits=model(tokens).logits.numpy().astype(np.float32),
                    long_prompt=long.numpy().astype(np.int32),
                    long_logits=model(long).logits[0, -8:].numpy().astype(np.float32))


def base(out: Path) -> Path:
    torch.manual_seed(11)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                      rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    d = out / "llama_base"
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True)
    np.savez_compressed(d / "reference.npz", **logits_of(model, cfg.vocab_size))
    return d


def peft_made(d: Path, out: Path, rslora: bool, saved: tuple = ()):
    """An adapter drawn by peft (B non-zero; the modules_to_save copies moved by noise), saved, and PeftModel's
    logits of it."""
    torch.manual_seed(13 + rslora + 2 * len(saved))
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, use_rslora=rslora,
                     task_type="CAUSAL_LM", modules_to_save=list(saved) or None)
    peft_model = get_peft_model(model, cfg).eval()
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "modules_to_save" in n:
                p.add_(0.05 * torch.randn_like(p))
    name = out / ("peft_r4_rslora" if rslora else "peft_r4_lm_head" if saved else "peft_r4")
    shutil.rmtree(name, ignore_errors=True)
    peft_model.save_pretrained(name)
    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(d, dtype=torch.float32), name).eval()
    ref = logits_of(loaded, 256)
    base_logits = np.load(d / "reference.npz")["logits"]
    moved = float(np.abs(ref["logits"] - base_logits).max())
    assert moved > 1e-2, f"the adapter moves the logits by {moved:.2e} only"
    np.savez_compressed(name / "reference.npz", moved=np.float64(moved), **ref)
    print(f"{name.name}: moves the logits by {moved:.3f}")


def peft_moe(out: Path, experts: bool = False, fused: bool = False):
    """peft's adapter on the attention of an MoE fixture (and with `experts`, on its packed experts' gate_up_proj and
    down_proj: peft's target_parameters), and PeftModel's logits of it."""
    from transformers import MixtralForCausalLM
    d = ROOT / "tests" / "fixtures" / "hf" / "mixtral_e4k2_f32"
    torch.manual_seed(17 + experts)
    load = lambda: MixtralForCausalLM.from_pretrained(d, dtype=torch.float32, experts_implementation="eager")  # noqa
    more = dict(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]) if experts else {}
    if fused:  # as peft's conversion of transformers 4's w1/w3 adapters writes the fused gate_up_proj: 2 r, 2 alpha
        more.update(rank_pattern={r".*\.gate_up_proj": 8}, alpha_pattern={r".*\.gate_up_proj": 16})
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM", **more)
    name = out / ("peft_mixtral_fused_r4" if fused else "peft_mixtral_experts_r4" if experts else "peft_mixtral_r4")
    shutil.rmtree(name, ignore_errors=True)
    get_peft_model(load(), cfg).save_pretrained(name)
    ref = logits_of(PeftModel.from_pretrained(load(), name).eval(), 256)
    moved = float(np.abs(ref["logits"] - logits_of(load().eval(), 256)["logits"]).max())
    assert moved > 1e-2, moved
    np.savez_compressed(name / "reference.npz", moved=np.float64(moved), **ref)
    print(f"{name.name}: moves the logits by {moved:.3f}")


def trained(d: Path, out: Path, python: str, name: str = "trained", extra: tuple = (), cls=LlamaForCausalLM,
            load: dict | None = None):
    """meshtrain's LoRA run from the base, its peft export loaded by peft, its merged export by transformers."""
    t, load = out / name, load or {}
    command = TRAIN + list(extra)
    shutil.rmtree(t, ignore_errors=True)
    run = t / "run"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    subprocess.run([python, "-m", "trainer.cli", "train", f"model.init_from={d}", f"run.dir={run}", *command],
                   check=True, cwd=ROOT, env=env)
    subprocess.run([python, "-m", "trainer.cli", "export", "--run", str(run), "--format", "peft", "--out",
                    str(t / "adapter")], check=True, cwd=ROOT, env=env)
    subprocess.run([python, "-m", "trainer.cli", "export", "--run", str(run), "--format", "hf", "--merge", "--out",
                    str(t / "merged")], check=True, cwd=ROOT, env=env)
    shutil.rmtree(run)
    (t / "command.json").write_text(json.dumps(command, indent=1) + "\n")
    config = json.loads((t / "adapter" / "adapter_config.json").read_text())
    print("adapter_config.json:", config)
    loaded = PeftModel.from_pretrained(cls.from_pretrained(d, dtype=torch.float32, **load), t / "adapter").eval()
    ref = logits_of(loaded, 256)
    merged = logits_of(cls.from_pretrained(t / "merged", dtype=torch.float32, **load).eval(), 256)
    moved = float(np.abs(ref["logits"] - logits_of(cls.from_pretrained(d, dtype=torch.float32, **load).eval(),
                                                   256)["logits"]).max())
    gap = float(np.abs(merged["logits"] - ref["logits"]).max())
    print(f"{name}: peft's logits move {moved:.3f} from the base's; merged vs peft {gap:.2e}")
    shutil.rmtree(t / "merged")  # the merged export is the test's to make again
    np.savez_compressed(t / "reference.npz", moved=np.float64(moved), merged_logits=merged["logits"],
                        merged_long_logits=merged["long_logits"], **ref)


SFT = ["train.steps=20", "train.batch_size=8", "model.seq_len=128", "train.lr=3e-3", "train.warmup_steps=2",
       "train.eval_every=0", "run.log_every=1", "run.progress=false", "data.document_mask=true", "model.lora.rank=8",
       "model.lora.alpha=16", "model.lora.targets=[all-linear]", "model.lora.modules=[embed_tokens]"]


def sft(out: Path, python: str):
    """meshtrain's SFT run with LoRA and the tied embedding trained, its peft export loaded by peft."""
    gen, chats, t = ROOT / "tests" / "fixtures" / "generate", ROOT / "tests" / "fixtures" / "chat", out / "sft"
    shutil.rmtree(t, ignore_errors=True)
    t.mkdir(parents=True)
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    data, run = t / "chats.bin", t / "run"
    subprocess.run([python, "-m", "trainer.cli", "prepare", str(chats / "conversations.jsonl"), "--out", str(data),
                    "--tokenizer", str(gen), "--no-progress", "--heldout", "0"], check=True, cwd=ROOT, env=env)
    subprocess.run([python, "-m", "trainer.cli", "train", f"data.source={data}", f"model.init_from={gen}",
                    f"run.dir={run}", *SFT], check=True, cwd=ROOT, env=env)
    subprocess.run([python, "-m", "trainer.cli", "export", "--run", str(run), "--format", "peft", "--out",
                    str(t / "adapter")], check=True, cwd=ROOT, env=env)
    shutil.rmtree(run)
    for p in t.glob("chats.bin*"):  # the prepared file and its sidecars
        p.unlink()
    (t / "command.json").write_text(json.dumps(SFT, indent=1) + "\n")
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(gen, dtype=torch.float32), t / "adapter").eval()
    tokens = torch.tensor(np.arange(64).reshape(2, 32) % 1025)
    with torch.no_grad():
        logits = model(tokens).logits.numpy().astype(np.float32)
    np.savez_compressed(t / "reference.npz", tokens=tokens.numpy().astype(np.int32), logits=logits)
    print(f"sft: peft's logits of meshtrain's export, max |logit| {np.abs(logits).max():.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "peft"))
    ap.add_argument("--meshtrain", default=str(ROOT / ".venv" / "bin" / "python"),
                    help="the Python with meshtrain (none: leave trained/ as it is)")
    ap.add_argument("--only", choices=["sft", "fused"], help="make this fixture alone (the others left as they are)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only:
        return sft(out, args.meshtrain) if args.only == "sft" else peft_moe(out, experts=True, fused=True)
    d = base(out)
    peft_made(d, out, False)
    peft_made(d, out, True)
    peft_made(d, out, False, ("lm_head", "embed_tokens"))
    peft_moe(out)
    peft_moe(out, experts=True)
    peft_moe(out, experts=True, fused=True)
    if args.meshtrain != "none":
        sft(out, args.meshtrain)
        trained(d, out, args.meshtrain)
        from transformers import MixtralForCausalLM
        trained(ROOT / "tests" / "fixtures" / "hf" / "mixtral_e4k2_f32", out, args.meshtrain, "trained_mixtral",
                ("train.expert_parallel=true", "model.lora.targets=[q_proj,k_proj,v_proj,o_proj,"
                 "mlp.experts.gate_up_proj,mlp.experts.down_proj]"), MixtralForCausalLM,
                {"experts_implementation": "eager"})
    import peft
    (out / "versions.json").write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                                   "peft": peft.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
