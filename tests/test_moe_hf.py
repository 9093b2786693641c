"""Mixtral, Qwen3-MoE (norm_topk_prob true and false) and Qwen2-MoE (a shared expert) against transformers
(tests/fixtures/hf, made by scripts/make_hf_fixture.py): logits (1e-4) and greedy tokens (equal) on the 24
reference tokens and on the 420-token prompt, on 1 device and ZeRO-3 (2,1,4); import then export bitwise; one lr-0
step's loss against transformers' cross-entropy and its aux/load_balance against transformers'
load_balancing_loss_func per layer and row; config features the families do not compute as one-line errors."""
import json
import shutil

import jax
import numpy as np
import pytest

from conftest import SGD, TINY
from hf_check import FIX, LAYOUTS, check_long_prompt, cli, edit_config, loaded, read_folder, round_trip
from models.batch import from_windows

NAMES = ["mixtral_e4k2_f32", "qwen3_moe_norm_f32", "qwen3_moe_nonorm_f32", "qwen2_moe_shared_f32"]
FAMILY = {"mixtral_e4k2_f32": "mixtral", "qwen3_moe_norm_f32": "qwen3_moe", "qwen3_moe_nonorm_f32": "qwen3_moe",
          "qwen2_moe_shared_f32": "qwen2_moe"}
# the default run takes one family per layout; -m slow: the other six
DEFAULT = {("mixtral_e4k2_f32", "1dev"), ("qwen2_moe_shared_f32", "zero3_2x1x4")}


def _cases(default: set, layouts=("1dev", "zero3_2x1x4")):
    return [pytest.param(n, lay, marks=() if (n, lay) in default else pytest.mark.slow, id=f"{n}-{lay}")
            for n in NAMES for lay in layouts]


def _one_forward(s, params, ref) -> np.ndarray:
    """The logits of one forward over four rows, each zero-padded to the longest (attention is causal and the
    dropless routing is per token, so the padding changes nothing before it): the two reference rows, the short
    prompt then its greedy tokens, the long prompt then its greedy tokens (teacher forcing: the greedy tokens
    are transformers' exactly when each position's argmax is the next one)."""
    from models.transformer import forward
    rows = [*ref["tokens"], np.concatenate([ref["prompt"][0], ref["greedy"][0]]),
            np.concatenate([ref["long_prompt"][0], ref["long_greedy"][0]])]
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    with jax.set_mesh(s.mesh):
        return np.asarray(jax.jit(lambda p, t: forward(s.model, p, t))(params, tokens))


@pytest.mark.parametrize("name,layout", _cases(DEFAULT))
def test_logits_and_greedy_tokens_match_transformers_on_both_prompts(name, layout):
    """The forward on the params as imported into the layout's shardings (the experts stacked (layers, experts,
    ...) from one tensor each): the reference tokens' logits and the long prompt's last 8 (1e-4), and each greedy
    token the argmax after the prompt and the greedy tokens before it. On 1 device, KV-cache decoding of the long
    prompt too (tests/test_moe.py holds decoding to the forward's greedy tokens on every router)."""
    s, params = loaded(name, layout)
    ref = np.load(FIX / name / "reference.npz")
    got = _one_forward(s, params, ref)
    T, P, G = ref["tokens"].shape[1], ref["prompt"].shape[1], ref["greedy"].shape[1]
    LP, LG = ref["long_prompt"].shape[1], ref["long_greedy"].shape[1]
    assert LP >= 400
    assert np.abs(got[:2, :T] - ref["logits"]).max() < 1e-4
    assert np.abs(got[3, LP - 8:LP] - ref["long_logits"]).max() < 1e-4
    np.testing.assert_array_equal(got[2, P - 1:P + G - 1].argmax(-1), ref["greedy"][0])
    np.testing.assert_array_equal(got[3, LP - 1:LP + LG - 1].argmax(-1), ref["long_greedy"][0])
    if layout == "1dev":
        check_long_prompt(s, params, ref)
    c = s.model
    assert (c.family, c.n_experts, c.n_experts_per_token, c.expert_d_ff) == (FAMILY[name], 4, 2, 72)
    assert c.router == ("topk_softmax" if name.startswith("mixtral") else "softmax_topk")
    assert c.shared_expert_d_ff == (48 if "shared" in name else None)
    if c.router == "softmax_topk":
        assert c.norm_topk_prob == ("_norm_" in name)


@pytest.mark.parametrize("name,layout", _cases({("qwen3_moe_nonorm_f32", "1dev")}))
def test_one_lr0_step_gives_transformers_loss_and_load_balancing(name, layout):
    """One SGD step at lr 0 on the fixture's (4, 24) loss batch, as transformers ran it (24 input positions: a 25th
    window token, its target weighted 0): its loss is transformers' cross-entropy (1e-5), its aux/load_balance the
    mean over rows of transformers' load_balancing_loss_func summed over layers, each call on one layer's one row
    (aux_loss_rows, 1e-5); nothing dropped, and the parameters do not move."""
    from trainer import load_config, resolve
    from trainer.ckpt.initial import state_from_params
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    ref = np.load(FIX / name / "reference.npz")
    cfg = resolve(load_config(TINY + SGD + LAYOUTS[layout] + [
        "train.batch_size=4", "train.lr=0", f"model.init_from={FIX / name}", "model.seq_len=24"]))
    s = make_setup(cfg, jax.devices()[:int(np.prod([cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model]))])
    state = state_from_params(s, init_params(s, cfg.model.init_from))
    before = jax.tree.map(np.asarray, state["params"])
    tokens = ref["loss_tokens"]
    weight = np.ones(tokens.shape, np.float32)
    weight[:, -1] = 0  # the 24th position predicts the appended token: transformers' loss has 23 per row
    batch = from_windows(np.concatenate([tokens, tokens[:, :1]], axis=1), weight)
    with jax.set_mesh(s.mesh):
        state, m = jit_train_step(s)(state, jax.device_put(batch, s.batch_sharding()))
    assert abs(float(m["loss"]) - float(ref["loss"])) < 1e-5 * float(ref["loss"]), (float(m["loss"]), ref["loss"])
    want = float(ref["aux_loss_rows"].sum(axis=0).mean())  # (layers, rows): summed over layers, mean over rows
    assert abs(float(m["aux/load_balance"]) - want) < 1e-5 * want, (float(m["aux/load_balance"]), want)
    assert float(m["moe/dropped"]) == 0.0
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, state["params"])), jax.tree.leaves(before)):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", NAMES)
def test_import_then_export_is_bitwise(name, tmp_path):
    """Imported into (2,1,4) ZeRO-3 (each expert's tensor read slice by slice into its shards) and written by the
    adapter (trainer/ckpt/hf_export.py write_hf, one tensor at a time from the shards): every tensor bitwise
    under its name, and the adapter's config.json holds the same model as the fixture's."""
    from trainer.ckpt.hf import model_keys
    from trainer.ckpt.hf_export import write_hf
    s, params = loaded(name, "zero3_2x1x4")
    write_hf(params, s.model, tmp_path / "own")
    src, got = read_folder(FIX / name), read_folder(tmp_path / "own")
    assert sorted(got) == sorted(src)
    for k, (code, a) in src.items():
        assert got[k][0] == code and got[k][1].shape == a.shape and got[k][1].tobytes() == a.tobytes(), k
    own, want = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "own", FIX / name))
    assert model_keys(own, "own") == model_keys(want, "fixture")
    for k in ("architectures", "model_type", "num_experts_per_tok", "hidden_size", "intermediate_size",
              "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size", "tie_word_embeddings"):
        assert own.get(k) == want.get(k), k
    assert own.get("num_local_experts", own.get("num_experts")) == 4


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_run_exported_by_the_cli_is_bitwise(name, tmp_path):
    """The fixture saved as a run's checkpoint and exported by `meshtrain export --format hf`: bitwise."""
    round_trip(name, tmp_path)


BAD = {
    "sparse_step": ("qwen3_moe_norm_f32", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
    "mlp_only_layers": ("qwen2_moe_shared_f32", {"mlp_only_layers": [1]}, "mlp_only_layers=[1] is not supported"),
    "first_k_dense": ("qwen3_moe_nonorm_f32", {"first_k_dense_replace": 1},
                      "first_k_dense_replace=1 is not supported"),
    "jitter": ("mixtral_e4k2_f32", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
    "one_expert": ("mixtral_e4k2_f32", {"num_local_experts": 1}, "num_local_experts=1: meshtrain's MoE families"),
    "no_shared": ("qwen2_moe_shared_f32", {"shared_expert_intermediate_size": 0},
                  "lacks shared_expert_intermediate_size"),
    "no_qkv_bias": ("qwen2_moe_shared_f32", {"qkv_bias": False}, "qkv_bias=false is not supported"),
    "k_above_experts": ("qwen3_moe_norm_f32", {"num_experts_per_tok": 5},
                        "model.n_experts_per_token=5 exceeds model.n_experts=4"),
}


def test_unsupported_hf_moe_configs_are_one_line_naming_the_field(tmp_path, capsys):
    """Each case: `meshtrain train` from the edited folder exits 2 with one line naming the field, no run.dir."""
    for case, (name, edit, msg) in BAD.items():
        folder, run = tmp_path / case / "hf", tmp_path / case / "run"
        shutil.copytree(FIX / name, folder)
        edit_config(folder, **edit)
        assert cli("train", *TINY, f"model.init_from={folder}", f"run.dir={run}") == 2, case
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and msg in err, (case, err)
        assert not run.exists(), case


def test_a_model_the_architecture_cannot_hold_is_refused_on_export():
    """A Mixtral whose router is Qwen's, or a Qwen2-MoE without its shared expert: exporting either is one line."""
    import dataclasses
    from hf_check import loaded
    from trainer.ckpt.hf_export import check_expressible
    from trainer.errors import UserError
    s, params = loaded("mixtral_e4k2_f32", "1dev")
    with pytest.raises(UserError, match="router=softmax_topk, which this architecture cannot express"):
        check_expressible(dataclasses.replace(s.model, router="softmax_topk"), params, "run")
    with pytest.raises(UserError, match="shared_expert_d_ff is null; this architecture has a shared expert"):
        check_expressible(dataclasses.replace(s.model, family="qwen2_moe", router="softmax_topk"), params, "run")
