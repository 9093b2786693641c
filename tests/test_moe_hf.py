"""Mixtral, Qwen3-MoE (norm_topk_prob true and false) and Qwen2-MoE (a shared expert) against transformers
(tests/fixtures/hf, made by scripts/make_hf_fixture.py): logits (1e-4) and greedy tokens (equal) on the 24
reference tokens and on the 420-token prompt, on 1 device and ZeRO-3 (2,1,4); import then export bitwise; one lr-0
step's loss against transformers' cross-entropy and its aux/load_balance against transformers'
load_balancing_loss_func per layer and row, averaged; `meshtrain train` from a 4-layer Mixtral (mixtral_l4_aux_f32) with
its own router_aux_loss_coef against transformers' objective and gradient, and the gap to transformers' pooled
aux_loss that docs/models.md quotes; config features the families do not compute as one-line errors."""
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
    mean over layers and rows of transformers' load_balancing_loss_func, each call on one layer's one row
    (aux_loss_rows, 1e-5); nothing dropped, and the parameters do not move."""
    ref = np.load(FIX / name / "reference.npz")
    tokens = ref["loss_tokens"]
    weight = np.ones(tokens.shape, np.float32)
    weight[:, -1] = 0  # the 24th position predicts the appended token: transformers' loss has 23 per row
    m, moved = _lr0_step(name, layout, np.concatenate([tokens, tokens[:, :1]], axis=1), weight)
    assert abs(float(m["loss"]) - float(ref["loss"])) < 1e-5 * float(ref["loss"]), (float(m["loss"]), ref["loss"])
    want = float(ref["aux_loss_rows"].mean())  # (layers, rows): the mean over both
    assert abs(float(m["aux/load_balance"]) - want) < 1e-5 * want, (float(m["aux/load_balance"]), want)
    assert float(m["moe/dropped"]) == 0.0 and not moved


def _lr0_step(name, layout, windows, weight, *over):
    """One SGD step at lr 0 from the fixture imported into `layout` on `windows` (B, T+1) weighted by `weight`
    (B, T): (its metrics, whether a parameter moved)."""
    from trainer import load_config, resolve
    from trainer.ckpt.initial import state_from_params
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    B, T = weight.shape
    cfg = resolve(load_config(TINY + SGD + LAYOUTS[layout] + [
        f"train.batch_size={B}", "train.lr=0", f"model.init_from={FIX / name}", f"model.seq_len={T}", *over]))
    s = make_setup(cfg, jax.devices()[:int(np.prod([cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model]))])
    state = state_from_params(s, init_params(s, cfg.model.init_from))
    before = jax.tree.map(np.asarray, state["params"])
    with jax.set_mesh(s.mesh):
        state, m = jit_train_step(s)(state, jax.device_put(from_windows(windows, weight), s.batch_sharding()))
    after = jax.tree.leaves(jax.tree.map(np.asarray, state["params"]))
    return m, any(a.tobytes() != b.tobytes() for a, b in zip(after, jax.tree.leaves(before)))


AUX = "mixtral_l4_aux_f32"  # 4 layers, router_aux_loss_coef 0.02, transformers' objective on (4, 25) windows
# meshtrain's aux/load_balance and transformers' pooled aux_loss on the fixture's row 0 and its 4 rows, as
# docs/models.md quotes them (4 decimals)
QUOTED = {"one row": (2.1192, 1.9993), "four rows": (2.2984, 2.0643)}


def covariance_gap(router_LBTX, k: int) -> float:
    """X x sum over experts of the covariance over (layer, row) groups of f_e (the group's fraction of top-k choices
    of e) and P_e (its mean probability of e), from router logits in NumPy: the mean of the groups' X sum_e f_e P_e
    less X sum_e mean(f_e) mean(P_e), transformers' pooled value."""
    X = router_LBTX.shape[-1]
    lg = router_LBTX.astype(np.float64).reshape(-1, router_LBTX.shape[-2], X)  # (groups, positions, experts)
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    f = np.eye(X)[np.argsort(-lg, -1, kind="stable")[..., :k]].sum(axis=(1, 2)) / lg.shape[1]
    P = p.mean(axis=1)
    return float(X * ((f - f.mean(0)) * (P - P.mean(0))).mean(0).sum())


def _quoted_in_docs(case: str, ours: float, pooled: float):
    """The figures measured equal docs/models.md's (4 decimals), which quotes them."""
    from pathlib import Path
    assert (round(ours, 4), round(pooled, 4)) == QUOTED[case], (case, ours, pooled)
    text = " ".join((Path(__file__).parents[1] / "docs" / "models.md").read_text().split())
    want, have = QUOTED[case]
    assert f"{case}: {want:.4f} against {have:.4f}" in text, case


@pytest.mark.slow  # 19 s: the 8-device step's compile and the checkpoint at the end
def test_train_from_a_several_layer_mixtral_adds_its_coefficient_times_the_mean_over_layers(tmp_path):
    """`meshtrain train` from the 4-layer Mixtral with its own router_aux_loss_coef (config.json's 0.02), one lr-0
    SGD step on the fixture's row 0 (a token file of that window and one token more: every window drawn is it;
    nothing held out), on all 8 devices (a batch of 8 copies of that row: the row's means): loss + coef x
    aux/load_balance, the objective, equals transformers' cross-entropy + coef x the mean over layers of
    load_balancing_loss_func on each layer's router logits (1e-5), grad_norm the norm of transformers' gradient of
    that objective (1e-5); aux/load_balance exceeds transformers' pooled aux_loss by covariance_gap (1e-5), by the
    figure docs/models.md quotes."""
    ref = np.load(FIX / AUX / "reference.npz")
    coef = json.loads((FIX / AUX / "config.json").read_text())["router_aux_loss_coef"]
    row = ref["aux_windows"][0]
    data, run = tmp_path / "row0.bin", tmp_path / "run"
    np.concatenate([row, row[:1]]).astype(np.uint16).tofile(data)
    assert cli("train", *TINY, *SGD, "mesh.data=8", f"model.init_from={FIX / AUX}", "model.seq_len=24",
               f"model.router_aux_loss={coef}", "train.batch_size=8", "train.expert_parallel=false",
               "train.steps=1", "train.lr=0", f"data.source={data}", "data.bin_dtype=uint16",
               "data.heldout_fraction=0", "train.eval_every=0", "run.log_every=1", f"run.dir={run}") == 0
    (m,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    per_layer = ref["aux_per_row"][:, 0]  # transformers' function on each layer's logits of row 0
    assert abs(m["aux/load_balance"] - per_layer.mean()) < 1e-5 * per_layer.mean(), (m, per_layer)
    want = float(ref["aux_ce_row0"] + coef * per_layer.mean())
    assert abs(m["loss"] + coef * m["aux/load_balance"] - want) < 1e-5 * want, (m, want)
    assert abs(m["grad_norm"] / ref["aux_grad_norm_row0"] - 1) < 1e-5, (m["grad_norm"], ref["aux_grad_norm_row0"])
    gap = covariance_gap(ref["aux_router_logits"][:, :1], 2)
    assert abs(m["aux/load_balance"] - ref["aux_pooled_row0"] - gap) < 1e-5, (m, ref["aux_pooled_row0"], gap)
    _quoted_in_docs("one row", m["aux/load_balance"], float(ref["aux_pooled_row0"]))


def test_several_rows_average_over_layers_and_rows_as_transformers_per_row_and_layer():
    """One lr-0 step on the 4-layer fixture's 4 windows on one device with its coefficient: loss is
    transformers' cross-entropy, aux/load_balance the mean over layers and rows of load_balancing_loss_func on each
    layer's one row, grad_norm the norm of transformers' gradient of ce + coef x that (each 1e-5); aux/load_balance
    exceeds transformers' pooled aux_loss by covariance_gap over the (layer, row) groups (1e-5), by the figure
    docs/models.md quotes."""
    ref = np.load(FIX / AUX / "reference.npz")
    coef = json.loads((FIX / AUX / "config.json").read_text())["router_aux_loss_coef"]
    windows = ref["aux_windows"]
    m, moved = _lr0_step(AUX, "1dev", windows, np.ones((4, 24), np.float32), f"model.router_aux_loss={coef}")
    m = {k: float(v) for k, v in m.items()}
    assert abs(m["loss"] - ref["aux_ce"]) < 1e-5 * ref["aux_ce"], (m, ref["aux_ce"])
    want = ref["aux_per_row"].mean()
    assert abs(m["aux/load_balance"] - want) < 1e-5 * want, (m, want)
    assert abs(m["grad_norm"] / ref["aux_grad_norm"] - 1) < 1e-5, (m["grad_norm"], ref["aux_grad_norm"])
    gap = covariance_gap(ref["aux_router_logits"], 2)
    assert abs(m["aux/load_balance"] - ref["aux_pooled"] - gap) < 1e-5, (m, ref["aux_pooled"], gap)
    _quoted_in_docs("four rows", m["aux/load_balance"], float(ref["aux_pooled"]))
    assert not moved


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
