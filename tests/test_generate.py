"""KV-cache decoding equals full recomputation; sampling; stop tokens, --chat, BOS and --stop against
transformers' greedy `generate` (the CLI's streaming test is in test_observe.py)."""
import functools
import io
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Transformer, forward, from_preset, params_of
from models.decode import extend, generate, init_cache


@pytest.fixture(scope="module")
def model():
    # a wide init spreads the logits, so greedy ties cannot hide behind float rounding
    c = from_preset("tiny", init_std=0.5)
    return c, jax.jit(lambda: params_of(Transformer(c, rngs=nnx.Rngs(1))))()


def _tokens(b, t):
    return np.random.default_rng(0).integers(0, 256, (b, t)).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _jit_forward(c):
    return jax.jit(functools.partial(forward, c))


def _greedy_recompute(c, params, prompt_BT, n, vocab=None):
    """Greedy decoding by running the whole window through `forward` for every token (over the first `vocab` ids).

    The window is right-padded to seq_len (one compile): the model is causal, so the logits at
    the window's last real token do not see the padding.
    """
    fwd = _jit_forward(c)
    seq, start, out = np.asarray(prompt_BT), 0, []
    for _ in range(n):
        if seq.shape[1] - start > c.seq_len:  # the documented window: keep the last half
            start = seq.shape[1] - c.seq_len // 2
        window = seq[:, start:]
        padded = np.pad(window, ((0, 0), (0, c.seq_len - window.shape[1])))
        logits_BV = fwd(params, jnp.asarray(padded))[:, window.shape[1] - 1]
        tok = np.asarray(jnp.argmax(logits_BV[:, :vocab], axis=-1), np.int32)
        out.append(tok)
        seq = np.concatenate([seq, tok[:, None]], axis=1)
    return np.stack(out, axis=1)


@pytest.mark.parametrize("prompt_len,n,past", [(8, 20, False), (20, 30, True)], ids=["within-context", "past-context"])
def test_greedy_kv_cache_equals_recompute(model, prompt_len, n, past):
    c, params = model
    assert (prompt_len + n > c.seq_len) == past  # past-context refills the cache once
    prompt = _tokens(2, prompt_len)
    cached = np.stack(list(generate(c, params, prompt, n)), axis=1)
    np.testing.assert_array_equal(cached, _greedy_recompute(c, params, prompt, n))


def test_cached_logits_match_forward(model):
    c, params = model
    tokens = jnp.asarray(_tokens(2, 24))
    full_BTV = _jit_forward(c)(params, tokens)
    ext = jax.jit(functools.partial(extend, c))
    logits, cache = ext(params, tokens[:, :16], 0, init_cache(c, 2, c.seq_len))
    errs = [float(jnp.abs(logits - full_BTV[:, 15]).max())]
    for t in range(16, 24):
        logits, cache = ext(params, tokens[:, t:t + 1], t, cache)
        errs.append(float(jnp.abs(logits - full_BTV[:, t]).max()))
    assert max(errs) < 1e-4 * float(jnp.abs(full_BTV).max())


def test_sampling_top1_is_greedy_and_seeded(model):
    c, params = model
    prompt = _tokens(2, 8)
    greedy = np.stack(list(generate(c, params, prompt, 6)), axis=1)
    top1 = np.stack(list(generate(c, params, prompt, 6, temperature=1.0, top_k=1, seed=3)), axis=1)
    np.testing.assert_array_equal(top1, greedy)
    a, b, d = (np.stack(list(generate(c, params, prompt, 12, temperature=1.0, seed=s)), axis=1) for s in (5, 5, 6))
    np.testing.assert_array_equal(a, b)
    assert (a != d).any()


def test_the_cli_counts_tokens_not_bytes(capsys):
    """`--tokens` counts the run's tokens; only a byte-level run's tokens are bytes."""
    from trainer.cli import main
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    entry = text[text.rindex("--tokens TOKENS"):].split(" --", 1)[0]  # the option's entry, not the usage line
    assert "tokens to sample" in entry and "of the run's tokenizer" in entry and "bytes to generate" not in entry, \
        entry


# ------------------------------------------------------------------ stop tokens, chat and BOS as transformers'
# tests/fixtures/generate/ (scripts/make_generate_fixture.py): a tiny Llama trained to answer two chats and finish
# a sentence, and transformers' greedy `generate` ids for it, stopped by its generation config's eos list.

FIX = Path(__file__).parent / "fixtures" / "generate"
IM_END, EOT = 2, 0  # the fixture tokenizer's <|im_end|> and <|endoftext|>


@pytest.fixture(scope="module")
def ref():
    return {c["name"]: c for c in json.loads((FIX / "reference.json").read_text(encoding="utf-8"))["cases"]}


def ref_encodings() -> list[dict]:
    """The reference's tokenizer(prompt) under tokenizer_config.json flags, with and without the post-processor."""
    return json.loads((FIX / "reference.json").read_text(encoding="utf-8"))["encodings"]


def _args(case):
    """The CLI arguments of a reference case."""
    if "messages" not in case:
        return ["--prompt", case["prompt"]] + [a for s in case.get("stop", []) for a in ("--stop", s)]
    (user,) = [m["content"] for m in case["messages"] if m["role"] == "user"]
    system = [a for m in case["messages"] if m["role"] == "system" for a in ("--system", m["content"])]
    return ["--chat", "--prompt", user] + system


def _ours(run, case, **kw):
    """completion() on a reference case, greedy, with transformers' token limit."""
    from trainer.run.generate import completion
    messages = case.get("messages")
    if messages is None:
        return completion(str(run), case["prompt"], 32, temperature=0.0, out=io.StringIO(),
                          stops=tuple(case.get("stop", ())), **kw)
    by_role = {m["role"]: m["content"] for m in messages}
    return completion(str(run), by_role["user"], 32, temperature=0.0, out=io.StringIO(), chat=True,
                      system=by_role.get("system"), **kw)


def test_generate_chat_equals_transformers_token_for_token(ref, capsys):
    """--chat renders the user message (and --system) with the folder's template, as apply_chat_template with
    add_generation_prompt=True; greedy decoding gives transformers' ids and stops where it stopped, at
    <|im_end|>, which is not printed."""
    from trainer.cli import main
    assert main(["generate", "--run", str(FIX), "--temperature", "0", "--tokens", "32"] + _args(ref["chat1"])) == 0
    assert capsys.readouterr().out == ref["chat1"]["text"] + "\n"  # the reply alone, without <|im_end|>
    for name in ("chat0", "chat1"):
        got = _ours(FIX, ref[name])
        assert got.prompt_ids == ref[name]["prompt_ids"], name
        assert got.ids == ref[name]["new_ids"] and got.ids[-1] == IM_END and got.stopped, (name, got.ids)


def test_generate_plain_prompt_gets_bos_and_stops_as_transformers(ref, capsys):
    """A plain prompt is encoded as transformers' tokenizer(prompt): the BOS that tokenizer.json's post-processor
    puts first; decoding stops at <|endoftext|> (the generation config's second eos), not printed."""
    from trainer.cli import main
    case = ref["plain"]
    assert main(["generate", "--run", str(FIX), "--temperature", "0", "--tokens", "32"] + _args(case)) == 0
    assert capsys.readouterr().out == case["prompt"] + case["text"] + "\n"
    got = _ours(FIX, case)
    assert got.prompt_ids == case["prompt_ids"] and got.prompt_ids[0] == 1024  # <|begin_of_text|>
    assert got.ids == case["new_ids"] and got.ids[-1] == EOT and got.stopped, got.ids


def _variant(d: Path, enc: dict):
    """FIX copied to d with a reference encoding's tokenizer_config.json flags, and tokenizer.json without its
    post-processor where the encoding was made without it."""
    shutil.copytree(FIX, d)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**conf, **enc["tokenizer_config"]}))
    if not enc["post_processor"]:
        tok = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
        (d / "tokenizer.json").write_text(json.dumps({**tok, "post_processor": None}), encoding="utf-8")
    return d


def test_generate_bos_follows_tokenizer_json_as_transformers(ref, tmp_path):
    """transformers 5 takes the BOS from tokenizer.json's post-processor alone: the reference records
    tokenizer(prompt) under tokenizer_config.json's add_bos_token / add_eos_token, with the post-processor (a BOS
    first, even with add_bos_token false) and without it (none, even with add_bos_token true and a bos_token named);
    the prompt's ids here equal each, so neither never nor always putting the BOS first passes."""
    from trainer.run.generate import completion
    encodings = ref_encodings()
    assert {e["ids"][0] == 1024 for e in encodings} == {True, False}  # both kinds are there
    for k, enc in enumerate(encodings):
        d = _variant(tmp_path / str(k), enc)
        got = completion(str(d), enc["prompt"], 32, temperature=0.0, out=io.StringIO())  # 32: one compiled step
        assert got.prompt_ids == enc["ids"], (enc["tokenizer_config"], enc["post_processor"])


def test_a_run_on_prepared_text_sees_the_bos_in_its_data_and_in_generate(ref, tmp_path, monkeypatch):
    """prepare encodes a text document as transformers' tokenizer(text) (the fixture's BOS first), then the
    end-of-text token, and records the BOS in the sidecar; generate prompts a run trained on that .bin with the same
    ids, and an empty prompt with the BOS. A .bin whose sidecar predates the record holds no BOS, and generate adds
    none: the prompt is tokenizer(prompt) of the tokenizer without its post-processor, an empty one the end-of-text
    token."""
    import models.decode
    import trainer.ckpt.params
    from trainer.config import replace
    from trainer.data.prepare import prepare
    from trainer.run.generate import completion
    case = ref["plain"]
    (tmp_path / "doc.txt").write_text(case["prompt"])
    out = tmp_path / "d.bin"
    prepare([str(tmp_path / "doc.txt")], str(out), tokenizer=str(FIX), heldout=0, log=lambda *a: None,
            show_progress=False)
    assert np.fromfile(out, np.uint16).tolist() == case["prompt_ids"] + [EOT]
    load = trainer.ckpt.params.load_params

    def trained_on_it(run_dir, step, shardings, **kw):  # FIX's weights, with the config of a run trained on the .bin
        params, cfg = load(run_dir, step, shardings, **kw)
        return params, replace(cfg, data={"source": str(out), "tokenizer": str(FIX / "tokenizer.json")})
    monkeypatch.setattr(trainer.ckpt.params, "load_params", trained_on_it)
    # what the model is prompted with, not what it says: a step that ends at once spares the compiles
    monkeypatch.setattr(models.decode, "_step_fn", lambda c, dtype: lambda p, toks, *a: (jnp.full((1,), EOT), a[1]))

    def prompt_ids(prompt):
        return completion(str(FIX), prompt, 1, temperature=0.0, out=io.StringIO()).prompt_ids
    assert prompt_ids(case["prompt"]) == case["prompt_ids"] and prompt_ids("") == [1024]
    side = out.with_name(out.name + ".json")
    side.write_text(json.dumps({k: v for k, v in json.loads(side.read_text()).items() if k != "text_specials"}))
    (bare,) = [e for e in ref_encodings() if not e["post_processor"]]
    assert prompt_ids(bare["prompt"]) == bare["ids"] and prompt_ids("") == [EOT]



def test_generate_stop_text_as_transformers_stop_strings(ref):
    """--stop TEXT ends where transformers' stop_strings ends (the token that completes the text, last); the
    text is not printed: what comes before it is."""
    from trainer.run.generate import completion
    case, out = ref["stop_string"], io.StringIO()
    got = completion(str(FIX), case["prompt"], 32, temperature=0.0, out=out, stops=(" lazy",))
    assert got.ids == case["new_ids"] and got.stopped, got.ids
    assert case["text"].endswith(" lazy")
    assert out.getvalue() == case["prompt"] + case["text"].removesuffix(" lazy") + "\n"


def test_generate_stops_at_the_templates_end_of_turn_and_at_stop_tokens(ref, tmp_path):
    """With a generation config that names only <|endoftext|>, --chat still stops at <|im_end|>: the token the
    template writes after an assistant turn. Without the template, the same prompt written out runs past it,
    unless --stop names it."""
    from tokenizers import Tokenizer

    from trainer.run.generate import completion
    case = ref["chat0"]
    d = tmp_path / "eot_only"
    shutil.copytree(FIX, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": EOT}))
    assert _ours(d, case).ids == case["new_ids"]
    (d / "chat_template.jinja").unlink()
    text = Tokenizer.from_file(str(FIX / "tokenizer.json")).decode(case["prompt_ids"][1:], skip_special_tokens=False)
    run_on = completion(str(d), text, 32, temperature=0.0, out=io.StringIO())
    assert run_on.prompt_ids == case["prompt_ids"]  # the BOS, then the rendered chat
    assert run_on.ids[:len(case["new_ids"])] == case["new_ids"] and len(run_on.ids) > len(case["new_ids"])
    stopped = completion(str(d), text, 32, temperature=0.0, out=io.StringIO(), stops=("<|im_end|>",))
    assert stopped.ids == case["new_ids"] and stopped.stopped


def test_generate_long_prompt_warning_stands_on_its_own_line(monkeypatch):
    """The warning that a prompt was cut to the context comes on a line of its own (stderr, before anything is
    printed), not inside the streamed text, even when stdout and stderr are one terminal."""
    import models.decode
    from trainer.cli import main
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    # where the lines go, not what the model says: a step that always answers "P" spares the 128-token compile
    monkeypatch.setattr(models.decode, "_step_fn", lambda c, dtype: lambda p, toks, *a: (jnp.full((1,), 53), a[1]))
    prompt = "The quick brown fox jumps over the lazy dog. " * 12  # past the fixture's 256 positions
    assert main(["generate", "--run", str(FIX), "--prompt", prompt, "--tokens", "2", "--temperature", "0"]) == 0
    lines = screen.getvalue().split("\n")
    assert lines[0].startswith("meshtrain: warning: generate: the prompt's "), lines[0][:120]
    assert "exceed the model's context of 256 positions" in lines[0]
    assert lines[1].startswith(prompt) and "warning" not in "\n".join(lines[1:]), lines[1:]


@pytest.mark.parametrize("args,msg", [
    (["--run", str(FIX), "--system", "Be brief."], "--system is a chat's system message; add --chat"),
    (["--run", str(FIX), "--stop", ""], "--stop '' is empty"),
    (["--run", str(Path(__file__).parent / "fixtures" / "hf" / "gqa_untied_f32"), "--chat"],
     "--chat needs a chat template"),
], ids=["system-without-chat", "empty-stop", "chat-without-template"])
def test_generate_chat_and_stop_bad_input(args, msg, capsys):
    from trainer.cli import main
    assert main(["generate", "--tokens", "1"] + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain: error: ") and msg in err and err.count("\n") == 1, err


def _padded_fixture(ref, tmp_path) -> Path:
    """The fixture's 1025 rows padded to 1032 (a vocabulary padded up to a multiple of mesh.model), each new row 100 x
    the row of the token transformers' greedy decoding of chat0 picks first: drawn from, they would win."""
    from trainer.ckpt.safetensors import read_header, write
    padded = tmp_path / "padded"
    shutil.copytree(FIX, padded)
    config = json.loads((FIX / "config.json").read_text())
    (padded / "config.json").write_text(json.dumps({**config, "vocab_size": 1032}))
    tensors = {k: np.array(t.array()) for k, t in read_header(FIX / "model.safetensors").items()}
    embed = tensors["model.embed_tokens.weight"]
    top = embed[ref["chat0"]["new_ids"][:1]]
    tensors["model.embed_tokens.weight"] = np.concatenate([embed, np.repeat(100 * top, 7, 0)])
    write(padded / "model.safetensors", [(k, v.shape, v.dtype) for k, v in tensors.items()], tensors.__getitem__)
    return padded


def test_ids_past_the_tokenizers_are_never_drawn(model, ref, tmp_path, monkeypatch):
    """Issue 65 item 11: a vocabulary padded past the tokenizer's (rows no token uses) must not be drawn from.
    decode.generate with vocab=200 of the model's 256: greedy equals recomputation whose logits past 200 are dropped
    by hand (and without the limit greedy draws from them); sampling stays below 200. `meshtrain generate` limits
    a model of 1032 rows to its tokenizer's 1025 ids."""
    import models.decode
    from trainer.run.generate import completion
    c, params = model
    prompt = _tokens(2, 8)
    free = np.stack(list(generate(c, params, prompt, 20)), axis=1)
    limited = np.stack(list(generate(c, params, prompt, 20, vocab=200)), axis=1)
    drawn = np.stack(list(generate(c, params, prompt, 20, temperature=1.0, seed=3, vocab=200)), axis=1)
    assert (free >= 200).any() and drawn.max() < 200, (free, drawn)
    np.testing.assert_array_equal(limited, _greedy_recompute(c, params, prompt, 20, vocab=200))
    limits = []

    def step(p, toks, pos, cache, key, temperature, top_k, n_ids):  # what the step is given; no compile
        limits.append(int(n_ids))
        return jnp.full((1,), EOT), cache
    monkeypatch.setattr(models.decode, "_step_fn", lambda c, dtype: step)
    completion(str(_padded_fixture(ref, tmp_path)), "Hello", 1, temperature=0.0, out=io.StringIO())
    assert limits == [1025]


@pytest.mark.slow
def test_a_padded_vocabulary_generates_what_the_unpadded_model_does(ref, tmp_path):
    """Issue 65 item 11: a vocabulary padded up to a multiple of mesh.model (rows no token uses) must not be drawn
    from. The fixture's 1025 rows padded to 1032, each new row 100 x the row of the token transformers' greedy
    decoding picks first (so that, drawn from, they would win): greedy decoding still gives transformers' tokens."""
    assert _ours(_padded_fixture(ref, tmp_path), ref["chat0"]).ids == ref["chat0"]["new_ids"]
