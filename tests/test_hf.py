"""Hugging Face Llama folders in and out: transformers' logits and greedy tokens reproduced on 1 and 8
devices, bitwise round trips, and one-line errors for bad folders (tests/fixtures/hf, made by transformers)."""
import io
import json
import shutil

import jax
import numpy as np
import pytest

from conftest import TINY
from hf_check import (FIX, LAYOUTS, check_parity, check_pipeline, cli, edit_config, loaded, read_folder,
                      read_st, round_trip, save_run, write_st)

NAMES = ["gqa_untied_f32", "tied_llama3_bf16", "sharded_f32", "head_dim_long_f32"]


# -m slow: the sharded fixture runs every layout by default, the others 1 device (and one more layout each)
SLOW_PARITY = {("gqa_untied_f32", "pipe_2x2x2"), ("tied_llama3_bf16", "pipe_2x2x2"), ("gqa_untied_f32", "zero3_2x1x4")}


@pytest.mark.parametrize("name,layout", [
    pytest.param(n, lay, marks=[pytest.mark.slow] if (n, lay) in SLOW_PARITY else [], id=f"{n}-{lay}")
    for n in NAMES for lay in LAYOUTS])
def test_logits_and_greedy_tokens_match_transformers(name, layout):
    """1 device and ZeRO-3 (2,1,4): the forward on the params as loaded into that layout's shardings, greedy
    tokens by KV-cache decoding from them. The pipeline: the pipeline executor's own logits, loss and greedy tokens
    (`check_pipeline`; the 3-layer fixture on 3 stages)."""
    if layout == "pipe_2x2x2":
        check_pipeline(name)
    else:
        check_parity(name, layout)


@pytest.mark.parametrize("name", NAMES)
def test_import_export_round_trip_is_bitwise(name, tmp_path):
    cfg, want = round_trip(name, tmp_path)
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "architectures"):
        assert cfg[k] == want[k], k
    from trainer.ckpt.hf import model_keys  # rope theta and llama3 scaling survive the trip
    assert model_keys(cfg, "export") == model_keys(want, "fixture")
    if name == "sharded_f32":  # the same run, split into files of at most 400 KB, plus the index
        from trainer.ckpt.hf_export import export_hf
        export_hf(tmp_path / "run", tmp_path / "split", max_shard_bytes=400_000)
        index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
        files = sorted(p.name for p in (tmp_path / "split").glob("*.safetensors"))
        assert len(files) == 2 and sorted(set(index["weight_map"].values())) == files
        assert all(p.stat().st_size < 400_000 + 4096 for p in (tmp_path / "split").glob("*.safetensors"))
        split = read_folder(tmp_path / "split")
        assert all(split[k][1].tobytes() == a.tobytes() for k, (_, a) in read_folder(FIX / name).items())


def test_trained_run_exported_and_reimported_is_bitwise_equal(tmp_path):
    """5 steps from the GQA fixture on ZeRO-3, exported to HF, imported by a new run on another layout."""
    from trainer.ckpt.params import init_params, load_params
    from trainer import load_config, resolve
    from trainer.run.loop import train
    from trainer.state import make_setup
    run = tmp_path / "run"
    train(load_config(TINY + LAYOUTS["zero3_2x1x4"] + [f"model.init_from={FIX / 'gqa_untied_f32'}",
                                                       "train.steps=5", "train.eval_every=0", f"run.dir={run}"]))
    trained, _ = load_params(run, None, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    start = read_folder(FIX / "gqa_untied_f32")["model.embed_tokens.weight"][1]
    assert not np.array_equal(np.asarray(trained["embed"]), start)  # it trained
    assert cli("export", "--format", "hf", "--run", str(run), "--out", str(tmp_path / "hf")) == 0
    cfg = resolve(load_config(TINY + LAYOUTS["pipe_2x2x2"] + [f"model.init_from={tmp_path / 'hf'}"]))
    s = make_setup(cfg, jax.devices())
    again = init_params(s, cfg.model.init_from)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(trained)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _bad_copy(tmp_path, name="gqa_untied_f32"):
    d = tmp_path / "bad"
    shutil.copytree(FIX / name, d)
    return d




def _edit_tensors(d, fn):
    t = {k: a for k, (_, a) in read_st(d / "model.safetensors").items()}
    fn(t)
    write_st(d / "model.safetensors", t)


def _cut(d, n):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-n])


def _garble(d):
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:24] = b"\x00{not json at al"
    f.write_bytes(bytes(raw))


BAD = {
    "no_config": (lambda d: (d / "config.json").unlink(), "has no config.json of a Hugging Face model folder"),
    "unknown_arch": (lambda d: edit_config(d, architectures=["GPTNeoXForCausalLM"]),
                     "describes GPTNeoXForCausalLM; meshtrain imports DeepseekV3ForCausalLM, Gemma2ForCausalLM, "
                     "Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Glm4MoeLiteForCausalLM, GptOssForCausalLM, "
                     "LlamaForCausalLM, "
                     "MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, "
                     "Qwen3MoeForCausalLM"),
    "missing_tensor": (lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       "lacks tensor 'model.layers.1.mlp.up_proj.weight' (shape [96, 64])"),
    "unexpected_tensor": (lambda d: _edit_tensors(d, lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})),
        "has tensor 'model.layers.0.self_attn.q_proj.bias' that a LlamaForCausalLM"),
    "wrong_shape": (lambda d: _edit_tensors(d, lambda t: t.update(
        {"model.layers.1.self_attn.k_proj.weight": np.zeros((24, 64), np.float32)})),
        "tensor 'model.layers.1.self_attn.k_proj.weight' has shape [24, 64], config.json implies [32, 64]"),
    "corrupt_header": (_garble, "has a corrupt safetensors header"),
    "truncated": (lambda d: _cut(d, 100), "is truncated: 'model.norm.weight' ends at byte"),
    "rope_yarn": (lambda d: edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
                  "rope scaling of type 'yarn' is not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_hf_folder_is_one_line_exit_2_and_writes_nothing(case, tmp_path, capsys):
    edit, msg = BAD[case]
    d = _bad_copy(tmp_path)
    edit(d)
    run = tmp_path / "run"
    assert cli("train", *TINY, f"model.init_from={d}", f"run.dir={run}") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and msg in err, err
    assert not run.exists()


def test_explicit_model_key_contradicting_config_json_names_both(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli("train", *TINY, f"model.init_from={FIX / 'tied_llama3_bf16'}", "model.d_model=128",
                f"run.dir={run}") == 2
    err = capsys.readouterr().err.strip()
    assert "model.d_model=128 contradicts" in err and "hidden_size=64" in err and "\n" not in err
    assert not run.exists()


def test_plan_takes_shapes_from_config_json(capsys):
    assert cli("plan", *TINY, f"model.init_from={FIX / 'sharded_f32'}", "mesh.data=8") == 0
    out = capsys.readouterr().out
    from trainer import load_config, resolve
    from trainer.config import model_config
    mc = model_config(resolve(load_config(TINY + [f"model.init_from={FIX / 'sharded_f32'}"])))
    assert (mc.n_layers, mc.d_model, mc.n_kv_heads, mc.d_ff) == (3, 64, 4, 96) and out


def test_export_hf_of_a_shape_hf_cannot_express_is_one_line(tmp_path, capsys):
    """An export whose config has n_heads not a multiple of n_kv_heads: no --out written."""
    save_run("gqa_untied_f32", tmp_path / "run")
    assert cli("export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "orbax")) == 0
    meta = json.loads((tmp_path / "orbax" / "meta.json").read_text())
    meta["config"]["model"]["n_kv_heads"] = 3
    (tmp_path / "orbax" / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert cli("export", "--format", "hf", "--run", str(tmp_path / "orbax"), "--out", str(tmp_path / "hf")) == 2
    err = capsys.readouterr().err.strip()
    assert "n_heads=4 is not a multiple of n_kv_heads=3" in err and "\n" not in err, err
    assert not (tmp_path / "hf").exists()


def _word_tokenizer(path):
    """A 256-word tokenizer ('w0' ... 'w255', 'w0' the end of text) saved as an HF tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["w0"])
    tok.save(str(path))
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w0"}))  # as HF folders name it


@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["bytes", "tokenizer"])
def test_generate_from_an_hf_folder(with_tokenizer, tmp_path):
    """`meshtrain generate --run HF_FOLDER` decodes greedily from the folder's weights: the tokens equal KV-cache
    decoding from the parity-checked import; with a tokenizer.json in the folder, prompt and output go through it."""
    from models.decode import generate
    from trainer.run.generate import generate_text
    d = tmp_path / "hf"
    shutil.copytree(FIX / "gqa_untied_f32", d)
    s, params = loaded("gqa_untied_f32", "1dev")
    if with_tokenizer:
        _word_tokenizer(d / "tokenizer.json")
        prompt, ids = "w97 w98", [97, 98]
    else:
        prompt, ids = "ab", list(b"ab")
    text = generate_text(str(d), prompt, 6, temperature=0.0, out=io.StringIO())
    want = np.concatenate(list(generate(s.model, params, np.asarray([ids], np.int32), 6)))
    if with_tokenizer:
        assert text.split() == [f"w{t}" for t in want], (text, want)
    else:
        assert text == bytes(int(t) for t in want).decode("utf-8", errors="replace"), (text, want)


def test_generate_keeps_the_hf_models_context():
    """An HF model with a context of 512 (past the default seq_len, 128): `meshtrain generate` on a 405-token
    prompt (its tokenizer's) gives transformers' greedy tokens; the cache holds prompt + new tokens."""
    from tokenizers.decoders import DecodeStream

    from models.decode import generate
    from trainer.data.prepare import load_tokenizer
    from trainer.run.generate import generate_text
    d = FIX / "head_dim_long_f32"
    ref = np.load(d / "reference.npz")
    text = generate_text(str(d), str(ref["long_text"]), 8, temperature=0.0, out=io.StringIO())
    tok = load_tokenizer(str(d / "tokenizer.json"))[0]
    assert ref["long_prompt"].shape[1] >= 400 and tok.encode(str(ref["long_text"])).ids == ref["long_prompt"][0].tolist()
    stream = DecodeStream(skip_special_tokens=False)  # transformers' tokens as generate streams them
    assert text == "".join(stream.step(tok, int(t)) or "" for t in ref["long_greedy"][0]), (text, ref["long_greedy"])
    # the trained context (seq_len 23 here) instead of the model's: another continuation
    s, params = loaded("head_dim_long_f32", "1dev")
    short = np.concatenate(list(generate(s.model, params, ref["long_prompt"], 8)))
    assert not np.array_equal(short, ref["long_greedy"][0])


def test_a_prompt_past_the_context_says_how_many_tokens_it_dropped(caplog):
    from models.decode import generate
    s, params = loaded("gqa_untied_f32", "1dev")
    prompt = np.arange(40, dtype=np.int32)[None] % 256
    with caplog.at_level("WARNING"):
        got = np.concatenate(list(generate(s.model, params, prompt, 3, context=16)))
    want = np.concatenate(list(generate(s.model, params, prompt[:, -8:], 3, context=16)))
    assert [r.getMessage() for r in caplog.records] == [
        "generate: the prompt's 40 tokens exceed the model's context of 16 positions; its first 32 tokens were dropped"]
    np.testing.assert_array_equal(got, want)


def test_export_of_a_run_from_an_hf_folder_keeps_its_context_and_tokenizer(tmp_path):
    """The run keeps the folder's config, generation config and tokenizer when it starts (the folder may be gone
    when it is exported); the export keeps max_position_embeddings, special ids, head_dim and those files."""
    from trainer import load_config
    from trainer.run.loop import train
    src, run = tmp_path / "src", tmp_path / "run"
    shutil.copytree(FIX / "head_dim_long_f32", src)
    train(load_config(TINY + LAYOUTS["zero3_2x1x4"] + [f"model.init_from={src}", "train.steps=2",
                                                       "train.eval_every=0", f"run.dir={run}",
                                                       "data.tokenizer_check=false"]))  # bytes: meant here
    shutil.rmtree(src)
    assert cli("export", "--format", "hf", "--run", str(run), "--out", str(tmp_path / "hf")) == 0
    got, want = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", FIX / "head_dim_long_f32"))
    assert {k: got[k] for k in want if k not in ("dtype",)} == {k: v for k, v in want.items() if k != "dtype"}
    assert got["max_position_embeddings"] == 512 and got["head_dim"] == 24 and got["eos_token_id"] == 2
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / f).read_bytes() == (FIX / "head_dim_long_f32" / f).read_bytes(), f
