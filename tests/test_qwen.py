"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, its own head_dim) in and out of Hugging Face:
transformers' logits and greedy tokens on a short and a 420-token prompt, on 1 device and split over heads, a
pipeline train step, bitwise round trips, the family picked from config.json, one-line errors for what the
families do not compute (tests/fixtures/hf, made by transformers: scripts/make_hf_fixture.py)."""
import shutil

import jax
import numpy as np
import pytest

from conftest import TINY
from models.batch import from_windows
from test_hf import FIX, _cli, _edit_config, check_parity, loaded, ref_loss, round_trip

QWEN = ["qwen2_tied_bias_f32", "qwen3_head_dim_bf16"]


@pytest.mark.parametrize("layout", ["1dev", "zero3_2x1x4"])
@pytest.mark.parametrize("name", QWEN)
def test_logits_and_greedy_tokens_match_transformers(name, layout):
    """Short prompt on both layouts (biases and norms split with their heads over `model`, ZeRO-3 over data);
    the 420-token prompt's last logits and greedy tokens with the model's context of 512 on one device."""
    from models.decode import generate
    from models.transformer import forward
    s, params, ref = check_parity(name, layout)
    assert s.model.family == name.split("_")[0]
    if layout == "1dev":
        long = ref["long_prompt"]
        assert long.shape[1] >= 400
        with jax.set_mesh(s.mesh):
            last = np.asarray(jax.jit(lambda p, t: forward(s.model, p, t))(params, long))[0, -8:]
            cont = np.concatenate(list(generate(s.model, params, long, 8, context=512)))
        assert np.abs(last - ref["long_logits"]).max() < 1e-4
        np.testing.assert_array_equal(cont, ref["long_greedy"][0])


def test_a_pipeline_train_step_gives_the_reference_loss():
    from trainer.ckpt.initial import state_from_params
    from trainer.step import jit_train_step
    name = "qwen3_head_dim_bf16"
    s, params = loaded(name, "pipe_2x2x2")
    ref = np.load(FIX / name / "reference.npz")
    batch = from_windows(np.concatenate([ref["tokens"]] * 2))
    with jax.set_mesh(s.mesh):
        _, m = jit_train_step(s)(state_from_params(s, params), jax.device_put(batch, s.batch_sharding()))
    assert abs(float(m["loss"]) - ref_loss(ref["logits"], ref["tokens"])) < 1e-5


@pytest.mark.parametrize("name", QWEN)
def test_import_export_round_trip_is_bitwise(name, tmp_path):
    """Every tensor (biases, q/k norms) back bitwise, under its name, and a config.json of the family."""
    cfg, want = round_trip(name, tmp_path)
    for k in ("architectures", "model_type", "hidden_size", "num_key_value_heads", "head_dim", "tie_word_embeddings",
              "rms_norm_eps", "max_position_embeddings", "use_sliding_window"):
        assert cfg[k] == want.get(k, cfg[k]), k


BAD = {
    "qwen2_window": ("qwen2_tied_bias_f32", dict(use_sliding_window=True, sliding_window=64),
                     "use_sliding_window=true is not supported"),
    "qwen2_layer_types": ("qwen2_tied_bias_f32", dict(layer_types=["sliding_attention", "full_attention"]),
                          "layer_types=['full_attention', 'sliding_attention'] is not supported"),
    "qwen3_bias": ("qwen3_head_dim_bf16", dict(attention_bias=True), "attention_bias=True is not supported"),
    "qwen3_yarn": ("qwen3_head_dim_bf16", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
                   "rope scaling of type 'yarn' is not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_config_feature_the_family_does_not_compute_is_one_line(case, tmp_path, capsys):
    name, edit, message = BAD[case]
    d = tmp_path / "hf"
    shutil.copytree(FIX / name, d)
    _edit_config(d, **edit)
    rc = _cli("train", *TINY, f"model.init_from={d}", f"run.dir={tmp_path / 'run'}")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0] and "config.json" in err[0], err
    assert not (tmp_path / "run").exists()
