"""Build tests/fixtures/mtp/deepseek_d2.npz (needs torch + transformers, in a venv of their own, as
scripts/make_hf_fixture.py): transformers' multi-token-prediction modules (`transformers.modeling_layers.MtpModel`,
D = 2) on the DeepSeek-V3 fixture (tests/fixtures/hf/deepseek_v3_f32) as the main model, randomised, and their
training form written out: depth d at position t reads the token d ahead (token t + d) with the previous depth's
output (depth 1: the main model's hidden state after its final norm), positions the tokens' own; `forward_layer`
then `_project_to_logits` give each depth's logits, and the cross-entropy against the token d + 1 ahead over the
positions that have one. The npz holds the modules' weights under transformers' names (`w/...`), the tokens, each
depth's logits and loss, and the depth-1 logits of MtpModel(main, 1) built apart with the first module's weights
(`d1_logits_1`).

    python scripts/make_mtp_fixture.py
"""
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel

ROOT = Path(__file__).resolve().parents[1]
D = 2


def main():
    torch.manual_seed(7)
    main_model = DeepseekV3ForCausalLM.from_pretrained(ROOT / "tests" / "fixtures" / "hf" / "deepseek_v3_f32",
                                                       torch_dtype=torch.float32, experts_implementation="eager").eval()
    mtp = MtpModel(main_model, D).eval()
    own = {n: p for n, p in mtp.named_parameters() if n.startswith("layers.")}
    with torch.no_grad():
        for n, p in own.items():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("gate.weight"):
                p.copy_(0.25 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for layer in mtp.layers:
            b = layer.mtp_block.mlp.gate.e_score_correction_bias
            b.copy_(-0.1 + 0.2 * torch.rand_like(b))
    tokens = torch.randint(0, main_model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(8))
    T = tokens.shape[1]
    out = {}
    with torch.no_grad():
        h = main_model.model(tokens).last_hidden_state  # after the final norm
        pos = torch.arange(T)[None].expand(2, T)
        for d in range(1, D + 1):
            ahead = torch.nn.functional.pad(tokens[:, d:], (0, d))  # token t + d (0 past the window)
            h = mtp.forward_layer(d - 1, h, pos, None, input_ids=ahead)
            logits = mtp._project_to_logits(h)
            n = T - d - 1  # positions with a token d + 1 ahead
            ce = torch.nn.functional.cross_entropy(logits[:, :n].reshape(-1, logits.shape[-1]),
                                                   tokens[:, d + 1:].reshape(-1))
            out[f"logits_{d}"], out[f"loss_{d}"] = logits.numpy().astype(np.float32), np.float64(ce)
            print(f"depth {d}: loss {float(ce):.6f}")
        # D = 1: its own MtpModel, holding the first module's weights: the same depth-1 logits
        one = MtpModel(main_model, 1).eval()
        one.layers[0].load_state_dict(mtp.layers[0].state_dict())
        ahead = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
        h1 = one.forward_layer(0, main_model.model(tokens).last_hidden_state, pos, None, input_ids=ahead)
        out["d1_logits_1"] = one._project_to_logits(h1).numpy().astype(np.float32)
        print("D = 1 against depth 1 of D = 2:", float(np.abs(out["d1_logits_1"] - out["logits_1"]).max()))
        gate = mtp.layers[0].mtp_block.mlp.gate
        print("router bias in", float(gate.e_score_correction_bias.min()), float(gate.e_score_correction_bias.max()))
    weights = {f"w/{n}": p.detach().numpy().astype(np.float32) for n, p in mtp.state_dict().items()
               if n.startswith("layers.")}
    np.savez_compressed(ROOT / "tests" / "fixtures" / "mtp" / "deepseek_d2.npz", tokens=tokens.numpy().astype(np.int32),
                        **out, **weights)
    release_folder(main_model, mtp)


def release_folder(main_model, mtp):
    """tests/fixtures/hf/deepseek_v3_mtp_f32: the DeepSeek fixture with the modules written as DeepSeek's release
    writes its MTP layer, `model.layers.{L + i}.*`: the decoder layer's tensors under the main layers' names (one
    tensor per expert), enorm, hnorm, eh_proj, shared_head.norm (transformers' post_norm) and the release's copies
    of the main model's embed_tokens and head (shared_head.head); config.json's num_nextn_predict_layers = D."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    src = ROOT / "tests" / "fixtures" / "hf" / "deepseek_v3_f32"
    dst = ROOT / "tests" / "fixtures" / "hf" / "deepseek_v3_mtp_f32"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    (dst / "reference.npz").unlink()
    tensors = load_file(dst / "model.safetensors")
    L = main_model.config.num_hidden_layers
    for i, layer in enumerate(mtp.layers):
        pre = f"model.layers.{L + i}."
        for n, t in layer.state_dict().items():
            n = n.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
            if n.endswith("experts.gate_up_proj"):
                F = t.shape[1] // 2
                for e in range(t.shape[0]):
                    tensors[pre + f"mlp.experts.{e}.gate_proj.weight"] = t[e, :F].contiguous()
                    tensors[pre + f"mlp.experts.{e}.up_proj.weight"] = t[e, F:].contiguous()
            elif n.endswith("experts.down_proj"):
                for e in range(t.shape[0]):
                    tensors[pre + f"mlp.experts.{e}.down_proj.weight"] = t[e].contiguous()
            else:
                tensors[pre + n] = t.detach().contiguous()
        tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((dst / "config.json").read_text())
    c["num_nextn_predict_layers"] = len(mtp.layers)
    (dst / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
