"""KV-cache decoding equals full recomputation; sampling (the CLI's test is in test_observe.py)."""
import functools

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


def _greedy_recompute(c, params, prompt_BT, n):
    """Greedy decoding by running the whole window through `forward` for every token.

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
        tok = np.asarray(jnp.argmax(logits_BV, axis=-1), np.int32)
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
