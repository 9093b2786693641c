"""Sampling many completions at once with the KV cache (GRPO's rollouts, and any batch of prompts of different
lengths): the prompts left-padded to the longest, each row attending from its own first token (models/decode.py
`hidden` start_B), one prefill, then one cached step for every row at a time; a row stops at its first end token
(it draws nothing after), and decoding stops when every row has or after max_new tokens.

Each draw takes the logits at `temperature` (logits / temperature), keeps the top_k (0: all) and the smallest set of
tokens whose probability reaches top_p (1: all), and draws from what is kept with the step's key (fold_in(key, t)):
the same key, prompts and parameters draw the same tokens. Each drawn token's log-probability is reported under the
temperature's distribution before top-k/top-p (what the learner computes, models/objectives/grpo.py
`token_logps`), so that sampler and learner can be compared.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.decode import hidden, init_cache
from models.spec import family
from models.transformer import head


def filtered(logits_BV, temperature, top_k, top_p):
    """The logits / temperature with what top_k and top_p drop set to -inf (the most likely token always kept)."""
    V = logits_BV.shape[-1]
    scaled = logits_BV / temperature
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the probability of the tokens ranked above each
    rank = jnp.arange(V)[None, :]
    keep_ranked = (before < top_p) & ((top_k <= 0) | (rank < top_k))
    keep_ranked = keep_ranked.at[:, 0].set(True)
    keep = jnp.zeros_like(keep_ranked).at[jnp.arange(logits_BV.shape[0])[:, None], order].set(keep_ranked)
    return jnp.where(keep, scaled, -jnp.inf), scaled


@functools.lru_cache(maxsize=8)
def decode_step(c: ModelConfig, dtype):
    """One cached step for every row: (drawn tokens (B,), their log-probabilities (B,), each draw's margin (B,): the
    winner's perturbed logit above the runner-up's, how far the draw is from going the other way, cache)."""
    def step(params, tokens_BT, pos, cache, start_B, key, temperature, top_k, top_p, n_ids):
        x_BTD, cache = hidden(c, params, tokens_BT, pos, cache, dtype, linear=True, start_B=start_B)
        logits_BV = head(c, params, x_BTD[:, -1:])[:, 0]
        logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < n_ids, logits_BV, -jnp.inf)
        kept, scaled = filtered(logits_BV, temperature, top_k, top_p)
        perturbed = kept + jax.random.gumbel(key, kept.shape)  # a draw: the argmax of the Gumbel-perturbed logits
        top2 = jax.lax.top_k(perturbed, 2)[0]
        tok_B = jnp.argmax(perturbed, axis=-1).astype(jnp.int32)
        logp_B = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tok_B[:, None], axis=-1)[:, 0]
        return tok_B, logp_B, top2[:, 0] - top2[:, 1], cache
    return jax.jit(step, donate_argnums=3)


def host(x) -> np.ndarray:
    """A jax array's whole value on this host, gathered from the other processes where it is split over them."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@functools.lru_cache(maxsize=16)
def _empty_cache(c: ModelConfig, N: int, S: int, dtype, spread):
    """The KV cache's zeros made where they live (`spread`: each rank its rows' and heads' share, not a copy of all
    of it), jitted once per shape and layout."""
    return jax.jit(lambda: init_cache(c, N, S, dtype), out_shardings=spread)


def bucket(P: int) -> int:
    """The prompts' padded length: P rounded up to a multiple of a quarter of the power of two below it (at least
    16), so a few lengths per octave compile and padding adds under a quarter to the prefill and cache."""
    step = max(16, 1 << max(0, P.bit_length() - 3))
    return -(-P // step) * step


def sample_completions(c: ModelConfig, params: dict, prompts: list, max_new: int, key, *, temperature: float = 1.0,
                       top_k: int = 0, top_p: float = 1.0, end_ids=(), pad: int = 0, dtype=jnp.float32,
                       vocab: int | None = None, placement=(None, None), stop=None) -> dict:
    """Completions of each prompt (lists of token ids), drawn together: {"tokens": (N, max_new) int32, each row its
    tokens up to and including its first end token, then `pad`; "logps": (N, max_new) float32 (0 after the end);
    "lengths": (N,); "ended": (N,) bool, whether the row drew an end token; "margins": (N, max_new), each draw's
    margin (inf after the end): where every margin exceeds the rounding another layout adds, it draws the same}. A
    prompt plus max_new longer than the model's context is a ValueError (the caller says it in one line).
    `placement`: the shardings of the rows' arrays (N, ...) and of the cache (L, N, S, K, E) on the parameters'
    mesh (trainer/rl/rollout.py `placement`), else where jax puts them. `stop(row, tokens)`: whether a row that drew
    no end token stops after its tokens so far (a stop string in their text; its length is then theirs). The drawn
    arrays are read on every process (gathered where the rows are split over processes)."""
    if family(c.family).decode_cache is not None:
        raise ValueError(f"sampling prompts of different lengths together is not built for model.family={c.family} "
                         "(its own decoding cache)")
    N, P = len(prompts), max(len(p) for p in prompts)
    if P + max_new > c.seq_len:
        raise ValueError(f"a prompt of {P} tokens plus {max_new} new ones exceeds the model's context of {c.seq_len}")
    P = min(bucket(P), c.seq_len - max_new)  # more left padding: one compile per bucket, not per length
    tokens = np.full((N, P), pad, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):] = p
    rows, spread = placement
    put = (lambda x: jax.device_put(x, rows)) if rows is not None else jnp.asarray
    start = put(np.asarray(P - np.array([len(p) for p in prompts]), np.int32))
    step = decode_step(c, jnp.dtype(dtype))
    settings = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p), jnp.int32(vocab or c.vocab_size))
    cache = _empty_cache(c, N, P + max_new, dtype, spread)()
    out, logps = np.full((N, max_new), pad, np.int32), np.zeros((N, max_new), np.float32)
    margins = np.full((N, max_new), np.inf, np.float32)
    ended, ends = np.zeros(N, bool), np.asarray(sorted(end_ids), np.int32)
    stopped, cut = np.zeros(N, bool), np.full(N, max_new, np.int32)
    nxt, pos = tokens, 0
    for t in range(max_new):
        tok, logp, margin, cache = step(params, put(nxt), jnp.int32(pos), cache, start,
                                        jax.random.fold_in(key, t), *settings)
        pos += nxt.shape[1]
        tok, logp, margin = host(tok), host(logp), host(margin)
        live = ~(ended | stopped)
        out[live, t], logps[live, t], margins[live, t] = tok[live], logp[live], margin[live]
        ended |= live & np.isin(tok, ends)
        for r in np.flatnonzero(live & ~ended) if stop is not None else ():
            if stop(int(r), out[r, :t + 1]):
                stopped[r], cut[r] = True, t + 1
        if (ended | stopped).all():
            break
        nxt = tok[:, None]
    lengths = np.where(ended, np.argmax(np.isin(out, ends), axis=1) + 1, cut)  # up to its first end token
    return {"tokens": out, "logps": logps, "lengths": lengths.astype(np.int32), "ended": ended, "margins": margins}
