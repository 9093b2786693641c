"""Gemma 2 and Gemma 3 against transformers (tests/fixtures/hf: scripts/make_hf_fixture.py): logits (1e-4) and
greedy tokens (equal) on the 24 reference tokens and on the 420-token prompt (past the window of 16), on 1
device, ZeRO-3 (2,1,4) and through the pipeline executor's 1F1B schedule on (2,2,2), each stage holding a local and a global
layer; Gemma 3's multimodal folder (Gemma3ForConditionalGeneration, its config.json in the older Hub form) read as
its text model; import -> export bitwise; a 3-step run's export against transformers' logits of the committed one
(tests/fixtures/hf_trained); Gemma 2 training on (2,1,4) ZeRO-3 and 1F1B as on one device; unsupported features
refused in one line."""
import json
import shutil

import jax
import numpy as np
import pytest

from conftest import SGD, TINY, max_rel, run_steps, single_device
from hf_check import (FIX, LAYOUTS, check_both_prompts, cli, layout_cases, read_folder, round_trip, trainer_script,
                      write_st)

G2, G3, VLM = "gemma2_mixed_f32", "gemma3_mixed_bf16", "gemma3_vlm_f32"
TRAINED = FIX.parent / "hf_trained"
# the default run (the suite's budget): Gemma 2 on 1 device, the multimodal Gemma 3 on (2,1,4); -m slow: the
# other seven, the pipelines among them (each stage a local and a global layer)
DEFAULT = {(G2, "1dev"), (VLM, "zero3_2x1x4")}


@pytest.mark.parametrize("name,layout", layout_cases((G2, G3, VLM), DEFAULT))
def test_logits_and_greedy_tokens_match_transformers_on_both_prompts(name, layout):
    """1 device and (2,1,4): the forward on the params as imported, greedy tokens by KV-cache decoding (a
    full-length cache, each local layer masked to its window). The pipeline: the pipeline executor's own logits."""
    c = check_both_prompts(name, layout).model
    assert c.family == name.split("_")[0] and c.window == 16 and len(set(c.local_layers)) == 2, c
    assert c.embed_scale and c.norm_plus_one and c.query_scale != c.head_dim


def _text_names(name) -> dict:
    """A fixture's text tensors under Gemma3ForCausalLM's names (the multimodal folder's renamed, its vision
    tower's left out), read here independently of trainer code."""
    out = {}
    for k, v in read_folder(FIX / name).items():
        if k.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        out[k.replace("language_model.model.", "model.", 1)] = v
    return out


@pytest.mark.parametrize("name", [G2, G3])
def test_import_then_export_is_bitwise(name, tmp_path):
    """The (1 + w) gains and the sqrt(d) stay in the computation: every tensor comes back as transformers stored
    it (zero-centred norm weights included), and config.json keeps each Gemma field."""
    cfg, want = round_trip(name, tmp_path)
    keys = ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
            "final_logit_softcapping", "rope_parameters", "hidden_activation", "tie_word_embeddings")
    assert {k: cfg.get(k) for k in keys} == {k: want.get(k) for k in keys}
    assert cfg["architectures"] == want["architectures"]


def test_the_multimodal_folder_exports_its_text_model_bitwise_as_gemma3_for_causal_lm(tmp_path, caplog):
    """Gemma3ForConditionalGeneration: the text tensors (language_model.model.*) come back under
    Gemma3ForCausalLM's names, bitwise; the vision tower is left out with one log line; the export is a text
    model's config (text_config's fields, no vision_config)."""
    import logging
    from hf_check import loaded, save_run
    from trainer.ckpt.params import init_params
    save_run(VLM, tmp_path / "run")
    s = loaded(VLM, "1dev")[0]
    with caplog.at_level(logging.INFO, logger="trainer.ckpt.hf"):
        init_params(s, FIX / VLM)  # read once more here: loaded() keeps its params
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 1 and "Gemma3ForConditionalGeneration" in said[0] and "tensors" in said[0], said
    assert cli("export", "--format", "hf", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")) == 0
    got, want = read_folder(tmp_path / "hf"), _text_names(VLM)
    assert sorted(got) == sorted(want) and len(want) < len(read_folder(FIX / VLM))
    for k, (code, a) in want.items():
        assert got[k][0] == code and got[k][1].tobytes() == a.tobytes(), k
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    text = json.loads((FIX / VLM / "config.transformers5.json").read_text())["text_config"]
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert "vision_config" not in cfg and "text_config" not in cfg
    assert cfg["layer_types"] == text["layer_types"] and cfg["rope_parameters"] == text["rope_parameters"]


def test_the_older_hub_form_reads_as_transformers_5_writes_it(tmp_path):
    """The multimodal fixture's config.json is in the older Hub form (rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern); config.transformers5.json is what transformers 5 made of it. Both give
    the same model keys, as does the text config alone as a Gemma3ForCausalLM; the parity tests run on the older
    form. The text tensors under transformers 5's in-memory names (model.language_model.*) load the same."""
    from trainer.ckpt.hf import model_keys, text_config
    old, new = (json.loads((FIX / VLM / f).read_text()) for f in ("config.json", "config.transformers5.json"))
    assert "layer_types" not in old["text_config"] and "rope_parameters" not in old["text_config"]
    keys = [model_keys(text_config(hc, "x"), "x") for hc in
            (old, new, {**old["text_config"], "architectures": ["Gemma3ForCausalLM"]})]
    assert keys[0] == keys[1] == keys[2]
    got = {k: v for k, (v, _) in keys[0].items()}
    assert got["local_layers"] == [True, False] and got["rope_linear"] == 8.0 and got["rope_local_theta"] == 1e4
    assert got["rope_theta"] == 1e6 and got["family"] == "gemma3"
    d = tmp_path / "hf"
    d.mkdir()
    shutil.copyfile(FIX / VLM / "config.json", d / "config.json")
    write_st(d / "model.safetensors", {k.replace("language_model.model.", "model.language_model.", 1)
                                       .replace("vision_tower.", "model.vision_tower.", 1): a
                                       for k, (_, a) in read_folder(FIX / VLM).items()})
    from hf_check import loaded
    from trainer.ckpt.params import init_params
    s, want = loaded(VLM, "1dev")
    got = init_params(s, d)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _bad(tmp_path, edit) -> str:
    d = tmp_path / "hf"
    shutil.copytree(FIX / G3, d)
    c = json.loads((d / "config.json").read_text())
    edit(c)
    (d / "config.json").write_text(json.dumps(c))
    return str(d)


@pytest.mark.parametrize("edit,says", [
    (lambda c: c.update(hidden_activation="gelu"), "hidden_activation='gelu' is not supported"),
    (lambda c: c.update(use_bidirectional_attention=True), "use_bidirectional_attention=true is not supported"),
    (lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"),
     "rope_parameters.full_attention rope_type 'yarn' is not supported"),
    (lambda c: c.update(layer_types=["full_attention", "chunked_attention"] * 2),
     "layer_types holds ['chunked_attention']"),
], ids=["erf-gelu", "bidirectional", "yarn-rope", "chunked-layers"])
def test_an_unsupported_gemma_feature_is_one_line(tmp_path, capsys, edit, says):
    rc = cli("train", *TINY, f"model.init_from={_bad(tmp_path, edit)}", f"run.dir={tmp_path / 'run'}")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and says in err[0] and "config.json" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == G2 else pytest.mark.slow) for n in (G2, G3, VLM)])
def test_a_3_step_run_exported_gives_transformers_logits(name, tmp_path):
    """The committed export of a 3-step run (SGD, seq_len 32: twice the window), imported: its logits are
    transformers' for it (1e-4). The run retrained here and exported gives the committed tensors (1e-4 of each
    tensor's scale: 3 steps of lr 0.5 through the soft-caps carry one CPU's rounding, or another's, further than
    Mistral's), trained away from the fixture."""
    from models.transformer import forward
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    out = trainer_script().export_run(name, tmp_path / "run", tmp_path / "hf")
    mine, committed, start = read_folder(out), read_folder(TRAINED / name), _text_names(name)
    assert sorted(mine) == sorted(committed) == sorted(start)
    moved = 0.0
    for k, (code, a) in committed.items():
        assert mine[k][0] == code == "F32", k
        np.testing.assert_allclose(mine[k][1], a, rtol=1e-4, atol=1e-4 * np.abs(a).max(), err_msg=k)
        b = start[k][1].astype(np.float32)
        moved = max(moved, float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12)))
    assert moved > 1e-3, moved
    ref = np.load(TRAINED / name / "reference.npz")
    cfg = resolve(load_config(TINY + LAYOUTS["1dev"] + [f"model.init_from={TRAINED / name}", "model.seq_len=23"]))
    s = make_setup(cfg, jax.devices()[:1])
    got = np.asarray(jax.jit(lambda p, t: forward(s.model, p, t))(init_params(s, TRAINED / name), ref["tokens"]))
    assert np.abs(got - ref["logits"]).max() < 1e-4


ZERO3 = ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3"]
ONE_F1B = ["mesh.data=2", "mesh.stage=2", "mesh.model=1", "train.pipeline_schedule=1f1b", "train.microbatches=2"]
# Gemma 2 from scratch: a local and a global layer per stage, every Gemma feature on (soft-caps small enough to
# bend these scores and logits, query_pre_attn_scalar != head_dim)
GEMMA2 = ["model.family=gemma2", "model.n_layers=4", "model.window=8", "model.local_layers=[true,false,true,false]",
          "model.attn_softcap=5.0", "model.final_softcap=8.0", "model.query_scale=32", "model.attention_block=16",
          "model.seq_len=32"]


# -m slow, both (the suite's budget): tests/test_family.py trains per-layer data on every layout by default
@pytest.mark.slow
@pytest.mark.parametrize("mesh", [pytest.param(ZERO3, id="zero3-2x1x4"), pytest.param(ONE_F1B, id="1f1b-2x2x1")])
def test_gemma2_trains_as_on_one_device(mesh):
    """SGD: losses, grad norms and parameters against one device (1e-5)."""
    over = SGD + GEMMA2 + mesh
    r = run_steps(over)
    ref_losses, ref_params, ref_norms = single_device(over)
    np.testing.assert_allclose(r.losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(r.grad_norms, ref_norms, rtol=1e-5)
    assert max_rel(r.params, ref_params) < 1e-5 and ref_losses[-1] != ref_losses[0]
    c = r.setup.model
    assert c.embed_scale and c.norm_plus_one and c.attn_softcap == 5.0 and c.local_layers == (True, False) * 2


def test_a_mixed_stack_counts_each_layer_by_its_kind_against_xla():
    """FLOPs of a Gemma 2 stack of 4 layers, 2 local (window 16) and 2 global, at T = 64: the convention's attention
    term is each layer's keys counted by hand (min(i + 1, w) for a local layer, i + 1 for a global one; 2%: the
    convention's continuous form). A mixed stack masks its local layers, so XLA computes the whole T x T for every
    layer: its count is 6 N + 12 L H Dh T plus elementwise work (< 10%: the soft-caps' tanh, Gemma's four norms a
    layer, the tanh GELU)."""
    from models import flops_per_token, from_preset, loss_fn, matmul_param_count
    from models.batch import abstract
    T, W = 64, 16
    c = from_preset("tiny", family="gemma2", window=W, seq_len=T, n_layers=4, local_layers=(True, False) * 2,
                    embed_scale=True, norm_plus_one=True, attn_softcap=50.0, final_softcap=30.0, scan_layers=False)
    per_key = 12 * c.n_heads * c.head_dim  # one layer's
    attention = flops_per_token(c) - 6 * matmul_param_count(c)
    seen = sum(sum(min(i + 1, W) if local else i + 1 for i in range(T)) / T for local in c.local_layers)
    assert abs(attention / per_key - seen) < 0.02 * seen, (attention / per_key, seen)
    assert attention < 0.75 * (12 * c.n_layers * c.n_heads * c.head_dim * T / 2)  # the local layers count less
    compiled = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(c, p, b))).lower(
        __import__("models").abstract_model(c).params, abstract(4, T)).compile()
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"] / (4 * T)
    executed = 6 * matmul_param_count(c) + per_key * c.n_layers * T
    assert executed <= xla < 1.10 * executed, (xla, executed)


def test_a_gemma_key_for_another_family_is_one_line(tmp_path, capsys):
    """Gemma's own keys are valid only for the Gemma families (DESIGN.md): given to Llama, one line naming them."""
    rc = cli("train", *TINY, "model.attn_softcap=5.0", f"run.dir={tmp_path / 'run'}")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["meshtrain: error: model.attn_softcap is a key of gemma2, gemma3, not of "
                               "model.family='llama'; drop it or set model.family"], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_each_kind_runs_its_own_kernel_and_soft_caps_take_the_masked_path():
    """In a scanned mixed stack (the window traced) Gemma 3's layers run the fused kernels, the windowed one among
    them (lax.switch on the layer's window), never the masked path; Gemma 2's soft-capped scores take the masked
    path. Read from the lowered program's scopes (models/kernels/attention.py names each path's ops)."""
    from models import abstract_model, from_preset, loss_fn
    from models.batch import abstract
    base = dict(window=16, seq_len=64, n_layers=4, local_layers=(True, False) * 2, scan_layers=True,
                attention="manual", attention_block=16, embed_scale=True, norm_plus_one=True, query_scale=24.0)
    texts = {}
    for fam, extra in (("gemma3", dict(rope_local_theta=1e4)), ("gemma2", dict(attn_softcap=5.0))):
        c = from_preset("tiny", family=fam, **base, **extra)
        texts[fam] = jax.jit(lambda p, b: loss_fn(c, p, b)).lower(abstract_model(c).params, abstract(2, 64)).as_text(
            debug_info=True)
    assert "attention_manual" in texts["gemma3"] and "attention_masked" not in texts["gemma3"]
    assert "stablehlo.case" in texts["gemma3"]  # the kind picked at run time
    assert "attention_masked" in texts["gemma2"]
