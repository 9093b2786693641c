"""Multi-token prediction's modules (models/objectives/mtp.py `depth`, `shifted`) against transformers' MtpModel
(D = 2, and D = 1 for the first depth) on the DeepSeek-V3 fixture as the main model (tests/fixtures/mtp/deepseek_d2.npz, made by
scripts/make_mtp_fixture.py): each depth's logits within 1e-4 and its loss against the token d + 1 ahead within 1e-5,
the modules' weights laid out here from transformers' tensors. Feeding depth 1 the hidden state before the final
norm, or concatenating [h, embedding], fails it."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.batch import from_windows
from models.objectives import mtp
from test_deepseek import ONE, _loaded

FIX = Path(__file__).parent / "fixtures" / "mtp" / "deepseek_d2.npz"


def _module(d, c, i: int) -> dict:
    """Depth i + 1's weights in meshtrain's layout (a DeepSeek MoE layer's names, and the module's own)."""
    w = {k[len(f"w/layers.{i}."):]: d[k] for k in d.files if k.startswith(f"w/layers.{i}.")}
    a, m = "mtp_block.self_attn.", "mtp_block.mlp."
    H, E, Ev, D, F = c.n_heads, c.head_dim, c.v_dim, c.d_model, c.expert_d_ff
    gate_up = w[m + "experts.gate_up_proj"]
    out = {"enorm": w["enorm.weight"], "hnorm": w["hnorm.weight"], "eh_proj": w["eh_proj.weight"].T,
           "post_norm": w["post_norm.weight"], "attn_norm": w["mtp_block.input_layernorm.weight"],
           "mlp_norm": w["mtp_block.post_attention_layernorm.weight"],
           "wq_a": w[a + "q_a_proj.weight"].T, "q_norm": w[a + "q_a_layernorm.weight"],
           "wq_b": w[a + "q_b_proj.weight"].T.reshape(c.q_rank, H, E),
           "wkv_a": w[a + "kv_a_proj_with_mqa.weight"].T, "kv_norm": w[a + "kv_a_layernorm.weight"],
           "wkv_b": w[a + "kv_b_proj.weight"].T.reshape(c.kv_rank, H, c.nope_dim + Ev),
           "wo": w[a + "o_proj.weight"].T.reshape(H, Ev, D),
           "router": w[m + "gate.weight"].T, "router_bias": w[m + "gate.e_score_correction_bias"],
           "expert_gate": gate_up[:, :F].transpose(0, 2, 1), "expert_up": gate_up[:, F:].transpose(0, 2, 1),
           "expert_down": w[m + "experts.down_proj"].transpose(0, 2, 1),
           **{f"shared_{n}": w[m + f"shared_experts.{n}_proj.weight"].T for n in ("gate", "up", "down")}}
    return {k: jnp.asarray(v) for k, v in out.items()}


def _depths(s, params, d, final_norm_first=True, embed_first=True):
    """Each depth's (logits (B, T, V), loss) of the fixture's tokens (23 inputs: the window's 24), in one program."""
    batch = from_windows(d["tokens"])
    mods = [_module(d, s.model, i) for i in range(2)]
    logits, losses = jax.jit(_program, static_argnums=(0, 4, 5))(s.model, params, mods, batch, final_norm_first,
                                                                  embed_first)
    return [(np.asarray(a), float(b)) for a, b in zip(logits, losses)]


def _program(c, params, mods, batch, final_norm_first, embed_first):
    from models.families.deepseek import moe_layer
    from models.layers import rope_for
    from models.transformer import embed, final_norm, head_weight, layer_call, run_stacks
    x = embed(c, params, batch["tokens"], jnp.float32)
    h, _ = run_stacks(c, params, x)
    h = final_norm(c, params, h) if final_norm_first else h
    call = layer_call(c, rope_for(c, h.shape[1]), index=c.n_layers)
    logits, losses = [], []
    for i, p in enumerate(mods):
        f = mtp.shifted(batch, i + 1)
        ahead = embed(c, params, f["tokens"], jnp.float32)
        if not embed_first:
            p = {**p, "eh_proj": jnp.concatenate([p["eh_proj"][c.d_model:], p["eh_proj"][:c.d_model]])}
        h, _ = mtp.depth(c, p, h, ahead, call, moe_layer)
        w, layout = head_weight(c, params)  # the main model's output projection, on the module's normed output
        out = jnp.einsum("btd,dv->btv", h, w.T if layout == "vd" else w)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(out, -1), f["targets"][..., None], -1)[..., 0]
        logits.append(out)
        losses.append(jnp.sum(nll * f["loss_weight"]) / jnp.sum(f["loss_weight"]))
    return logits, losses


def test_depths_equal_transformers_mtp():
    s, params = _loaded("deepseek_v3_f32", ONE, T=23)
    d = np.load(FIX)
    for i, (logits, loss) in enumerate(_depths(s, params, d)):
        n = 23 - (i + 1)  # the positions whose token d ahead is inside the window
        assert np.abs(logits[:, :n] - d[f"logits_{i + 1}"][:, :n]).max() < 1e-4, i
        assert abs(loss - float(d[f"loss_{i + 1}"])) < 1e-5, (i, loss)
        if i == 0:  # transformers' MtpModel(main, 1), built apart with the first module's weights
            assert np.abs(logits[:, :n] - d["d1_logits_1"][:, :n]).max() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["pre_norm_hidden", "hidden_first"])
def test_a_wrong_module_fails(wrong):
    s, params = _loaded("deepseek_v3_f32", ONE, T=23)
    d = np.load(FIX)
    logits, _ = _depths(s, params, d, final_norm_first=wrong != "pre_norm_hidden",
                        embed_first=wrong != "hidden_first")[0]
    assert np.abs(logits[:, :22] - d["logits_1"][:, :22]).max() > 1e-3


@pytest.mark.slow
def test_the_objective_adds_each_depth_as_transformers_computes_it():
    """model.mtp_depth=2 on the DeepSeek fixture with the modules' weights of transformers' MtpModel: the step's
    parts hold each depth's cross-entropy sum, whose mean over its counted targets (the metrics' aux/mtp_<d>) is
    transformers' loss (1e-5); the objective is the main loss plus model.mtp_weight x their mean."""
    import dataclasses
    from models.objectives.objective import aux_counts, objective, part_metrics, scales
    s, params = _loaded("deepseek_v3_f32", ONE, T=23)
    d = np.load(FIX)
    c = dataclasses.replace(s.model, mtp_depth=2, mtp_weight=0.3)
    mods = [_module(d, c, i) for i in range(2)]
    params = {**params, "mtp": {k: jnp.stack([m[k] for m in mods]) for k in mods[0]}}
    batch = {k: jnp.asarray(v) for k, v in from_windows(d["tokens"]).items()}
    value, parts = jax.jit(lambda p, b: objective(c, p, b, scales(c, b)))(params, batch)
    m = part_metrics(parts, aux_counts(c, batch))
    for i in (1, 2):
        assert abs(float(m[f"aux/mtp_{i}"]) - float(d[f"loss_{i}"])) < 1e-5, (i, m)
    want = float(parts["loss"]) + 0.3 * (float(d["loss_1"]) + float(d["loss_2"])) / 2
    assert abs(float(value) - want) < 1e-5, (float(value), want)


@pytest.mark.slow
def test_a_release_folder_imports_its_modules_and_exports_bitwise(tmp_path):
    """tests/fixtures/hf/deepseek_v3_mtp_f32, the modules written as DeepSeek's release writes them
    (model.layers.{4,5}.*, one tensor per expert, shared_head.norm, and copies of embed_tokens and the head), imported
    with model.mtp_depth=2 on (2,1,4) ZeRO-3 with the experts split: each depth's loss is transformers' (1e-5);
    exported from that run, every tensor of the folder, the copies included, bitwise."""
    from hf_check import cli, read_folder
    from models.objectives.objective import aux_counts, objective, part_metrics, scales
    from test_deepseek import EP
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.ckpt.initial import state_from_params
    s, params = _loaded("deepseek_v3_mtp_f32", EP, "model.mtp_depth=2", T=23)
    d = np.load(FIX)
    batch = jax.device_put(from_windows(np.concatenate([d["tokens"]] * 2)), s.batch_sharding())
    with jax.set_mesh(s.mesh):
        _, parts = jax.jit(lambda p, b: objective(s.model, p, b, scales(s.model, b)))(params, batch)
    m = part_metrics(parts, aux_counts(s.model, batch))
    for i in (1, 2):
        assert abs(float(m[f"aux/mtp_{i}"]) - float(d[f"loss_{i}"])) < 1e-5, (i, m)
    ck = Checkpointer(s, tmp_path / "run", log=lambda m: None)
    ck.save(1, state_from_params(s, params))
    ck.close()
    assert cli("export", "--format", "hf", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")) == 0
    src, got = read_folder(FIX.parents[1] / "hf" / "deepseek_v3_mtp_f32"), read_folder(tmp_path / "hf")
    assert sorted(got) == sorted(src) and any(".5.shared_head.head." in k for k in got)
    for k, (code, a) in src.items():
        assert got[k][0] == code and got[k][1].tobytes() == a.tobytes(), k


@pytest.mark.slow
def test_with_mtp_off_the_folders_modules_come_back_untouched(tmp_path):
    """The release folder fine-tuned with model.mtp_depth=0 (one SGD step through the CLI, on 8 devices with the
    experts split) and exported: the main model's tensors moved, the MTP layers' (model.layers.4.*, .5.*, their
    copies included) come back bitwise as the folder had them, and config.json still declares them."""
    import json
    from conftest import SGD, TINY
    from hf_check import cli, read_folder
    from test_deepseek import EP
    src = FIX.parents[1] / "hf" / "deepseek_v3_mtp_f32"
    run = tmp_path / "run"
    assert cli("train", *TINY, *SGD, *EP, f"model.init_from={src}", "model.mtp_depth=0", "train.steps=1",
               "train.batch_size=4", "model.seq_len=32", f"run.dir={run}") == 0
    assert cli("export", "--format", "hf", "--run", str(run), "--out", str(tmp_path / "hf")) == 0
    before, after = read_folder(src), read_folder(tmp_path / "hf")
    assert sorted(after) == sorted(before)
    mtp_names = [k for k in before if k.startswith(("model.layers.4.", "model.layers.5."))]
    assert len(mtp_names) > 20
    for k in mtp_names:
        assert after[k][0] == before[k][0] and after[k][1].tobytes() == before[k][1].tobytes(), k
    assert after["model.layers.3.self_attn.o_proj.weight"][1].tobytes() != \
        before["model.layers.3.self_attn.o_proj.weight"][1].tobytes()  # training moved the main model
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 2


def test_a_folder_that_declares_modules_and_holds_none(tmp_path):
    """As transformers saves a DeepSeek-V3 (config.json's num_nextn_predict_layers 1, no model.layers.4.*): read by its
    tensors, MTP off imports it, and model.mtp_depth=1 is refused in one line naming what it holds."""
    import json
    import shutil
    from trainer.errors import UserError
    d = tmp_path / "saved"
    shutil.copytree(FIX.parents[1] / "hf" / "deepseek_v3_f32", d)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "num_nextn_predict_layers": 1}))
    s, params = _loaded(d, ONE, T=16)
    assert "mtp" not in params and s.model.mtp_depth == 0
    with pytest.raises(UserError, match=r"^model.mtp_depth=1: .* holds 0 multi-token-prediction layers \(by its "
                                        r"tensors; its config.json declares 1\); set model.mtp_depth=0 or less$"):
        _loaded(d, ONE, "model.mtp_depth=1", T=16)


@pytest.mark.slow
def test_one_step_with_the_modules_then_export_holds_what_trained(tmp_path):
    """The release folder trained one SGD step with model.mtp_depth=2 (CLI, (2,1,4) ZeRO-3 with the experts split),
    exported: every tensor is the checkpoint's parameter bitwise (the modules' included, read back by a fresh import of
    the export), the modules' copies of embed_tokens and shared_head.head equal the trained main model's, and the
    modules moved."""
    from conftest import SGD, TINY
    from hf_check import cli, read_folder
    from test_deepseek import EP
    from trainer.ckpt.params import load_params
    src = FIX.parents[1] / "hf" / "deepseek_v3_mtp_f32"
    run, out = tmp_path / "run", tmp_path / "hf"
    assert cli("train", *TINY, *SGD, *EP, f"model.init_from={src}", "model.mtp_depth=2", "train.steps=1",
               "train.batch_size=4", "model.seq_len=32", f"run.dir={run}") == 0
    assert cli("export", "--format", "hf", "--run", str(run), "--out", str(out)) == 0
    got = read_folder(out)
    for i in (4, 5):
        assert got[f"model.layers.{i}.embed_tokens.weight"][1].tobytes() == got["model.embed_tokens.weight"][1].tobytes()
        assert got[f"model.layers.{i}.shared_head.head.weight"][1].tobytes() == got["lm_head.weight"][1].tobytes()
    assert got["model.layers.4.eh_proj.weight"][1].tobytes() != read_folder(src)["model.layers.4.eh_proj.weight"][1].tobytes()
    trained, _ = load_params(str(run), None, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    back, cfg = load_params(str(out), None, jax.sharding.SingleDeviceSharding(jax.devices()[0]), mtp_present=True)
    assert cfg.model.mtp_depth == 2
    flat = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(t)}  # noqa
    a, b = flat(trained), flat(back)
    assert sorted(a) == sorted(b) and any("mtp" in k for k in a)
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k
