"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, its own head_dim) in and out of Hugging Face: bitwise
round trips, the family picked from config.json, one-line errors for what the families do not compute, and
`generate` and `plan` on each new family's folder (tests/fixtures/hf, made by transformers:
scripts/make_hf_fixture.py). Parity with transformers' logits: tests/test_family_parity.py."""
import shutil

import pytest

from conftest import TINY
from hf_check import FIX, cli, edit_config, loaded, round_trip

QWEN = ["qwen2_tied_bias_f32", "qwen3_head_dim_bf16"]


@pytest.mark.parametrize("name", [pytest.param(QWEN[0], marks=pytest.mark.slow), QWEN[1]])  # -m slow: Qwen2's
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
    edit_config(d, **edit)
    rc = cli("train", *TINY, f"model.init_from={d}", f"run.dir={tmp_path / 'run'}")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0] and "config.json" in err[0], err
    assert not (tmp_path / "run").exists()


# -m slow: Qwen2's and Mistral's (Mistral's decoding through its ring runs in tests/test_family_parity.py)
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == QWEN[1] else pytest.mark.slow)
                                  for n in QWEN + ["mistral_window16_f32"]])
def test_generate_and_plan_work_on_the_folder(name, capsys):
    """`meshtrain generate --run FOLDER` decodes what KV-cache decoding from the parity-checked import gives (no
    tokenizer in the folder: bytes, so ids past 255 are never drawn, trainer/run/generate.py _Bytes); `meshtrain
    plan` counts the family's parameters (biases and norms included)."""
    import codecs
    import io
    import re

    import numpy as np

    from models import param_count
    from models.decode import generate
    from trainer.run.generate import generate_text
    s, params = loaded(name, "1dev")
    text = generate_text(str(FIX / name), "ab", 6, temperature=0.0, out=io.StringIO())
    want = np.concatenate(list(generate(s.model, params, np.asarray([list(b"ab")], np.int32), 6, vocab=256)))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    shown = "".join(decoder.decode(bytes([int(t)])) for t in want)
    assert text == shown + decoder.decode(b"", final=True), (text, want)
    assert cli("plan", *TINY, f"model.init_from={FIX / name}", "mesh.data=1") == 0
    kb = float(re.search(r"parameters\s+([\d.]+) KB", capsys.readouterr().out).group(1))
    assert abs(kb - param_count(s.model) * 4 / 1e3) < 0.01, (kb, param_count(s.model))
