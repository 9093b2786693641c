"""KV-cache decoding: prefill a prompt, then one token per step, as pure functions.

Dimension letters as in models/transformer.py, plus S = cache length (positions held).
The cache holds every layer's RoPE'd keys and values, k/v of shape (L, B, S, K, E); slots at
positions >= the current one are garbage and masked out. With a sliding window (model.window) it is a ring of
the window's length: the key of position p in slot p % window.
"""
from __future__ import annotations

import functools
import logging
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.kernels.attention import masked_attention
from models.layers import kernels_for, rope_for
from models.lora import A as LORA_A, layer_splits, merged
from models.spec import LOCAL, LayerCall, family, stacks
from models.transformer import _identity, _no_constrain, embed, head, inventory

log = logging.getLogger(__name__)


def init_cache(c: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> dict:
    """Every layer's cache, {name: (L, B, S, ...)}: the family's own (ModelSpec.decode_cache: latent attention's
    latent and RoPE key), else the RoPE'd keys and values, k/v (L, B, S, K, E)."""
    own = family(c.family).decode_cache
    if own is not None:
        return own(c, batch, length, dtype)
    # decoding runs on one device: the kv heads are never repeated (Placement.kv_repeat 1)
    shape = (c.n_layers, batch, length, c.n_kv_heads, c.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


class CacheView:
    """One layer's own cache in decoding (LayerCall.cache, for a family with ModelSpec.decode_cache): its arrays
    {name: (B, S, ...)} in position order, the new tokens' positions `q_pos` (T,) and the slots' `k_pos` (S,); the
    layer writes its new tokens' entries (`write`) and attends to what it gets back, causal by position."""

    def __init__(self, arrays: dict, pos, T: int):
        self.arrays, self.pos, self.written = arrays, pos, {}
        self.q_pos = pos + jnp.arange(T)
        self.k_pos = jnp.arange(next(iter(arrays.values())).shape[1])

    def write(self, **new) -> dict:
        """The arrays with the new tokens' entries {name: (B, T, ...)} written at pos.."""
        self.written = {k: jax.lax.dynamic_update_slice_in_dim(a, new[k].astype(a.dtype), self.pos, axis=1)
                        for k, a in self.arrays.items()}
        return self.written


def _stacked(c: ModelConfig, layers: dict, stack: str = "layers") -> dict:
    """Layer weights with one leading layers axis (a circular pipeline stores them (V, L/V, ...))."""
    name, p = next(iter(inventory(c)[stack].items()))
    if layers[name].ndim == len(p.shape) + 2:
        return jax.tree.map(lambda w: w.reshape((-1,) + w.shape[2:]), layers)
    return layers


def layer_runner(c: ModelConfig, rope, attend, pos, T: int, dtype):
    """run(layer, p, x, i, mine, data): one layer function (the family's, or a multi-token-prediction module) on
    weights p against its cache `mine`: it writes the new tokens' keys and values (or, for a family with its own
    cache, ModelSpec.decode_cache, gets it as LayerCall.cache) and attends with the mask (window by layer), soft-cap
    and scale the layer asks for; (x, the layer's cache written). `data`: the layer's tables (default: layer i's)."""
    spec, kernels = family(c.family), kernels_for(c)
    tables = {k: jnp.asarray(v) for k, v in spec.layer_data(c).items()}
    # the weights the inventory reads as stored (an MoE's router: float32 whatever the compute dtype) stay so
    stored = {k for stack in stacks(c) for k, v in inventory(c)[stack].items() if v.as_stored}

    splits = layer_splits(c)

    def run(layer, p, x_BTD, i, mine, data=None):
        p = merged(c, p, splits) if splits and any(k.endswith(LORA_A) for k in p) else p  # an MTP module: no adapter
        p = {k: w if k in stored else jax.tree.map(lambda a: a.astype(dtype), w) for k, w in p.items()}
        new = {}

        def attention(q_BTHE, k_BTKE, v_BTKE, segments=None, window=None, softcap=None, scale=None, windows=None,
                      sinks=None):
            o_BTHE, new["k"], new["v"] = attend(q_BTHE, k_BTKE, v_BTKE, mine["k"], mine["v"], window, softcap, scale,
                                                sinks)
            return o_BTHE

        own = CacheView(mine, pos, T) if spec.decode_cache is not None else None
        # one device: the collectives' local form (every logical axis one rank); decoding drops no token
        call = LayerCall(rope, _no_constrain, kernels, _identity, None, attention, i,
                         {k: v[i] for k, v in tables.items()} if data is None else data, collectives=LOCAL,
                         decoding=True, cache=own)
        x_BTD, _ = layer(c, p, x_BTD, call)
        return x_BTD, (own.written if own is not None else new)

    return run


def hidden(c: ModelConfig, params: dict, tokens_BT, pos, cache: dict, dtype=jnp.float32, linear: bool = False,
           start_B=None):
    """Run tokens at positions pos..pos+T-1 against the cache: (the last layer's output (B, T, D), before the final
    norm; cache). Each layer is the family's layer function (models/transformer.py `layer`, or the family's own; each
    stack's, models/spec.py `stacks`) through `layer_runner`. `linear`: a cache in position order even for a
    sliding window (speculative decoding's, whose rejected drafts must not take a ring's slots). `start_B`: each
    row's first slot that holds a token (left-padded prompts of different lengths, models/sampler.py); the slots
    before it are never attended to (RoPE is relative: a row's shifted positions give its tokens the same scores)."""
    spec = family(c.family)
    B, T = tokens_BT.shape
    S = next(iter(cache.values())).shape[2]
    if start_B is not None:
        rope, attend = position_cache(c, (B, T), pos, S, dtype, start_B)
    else:
        rope, attend = (_ring if c.uniform_window and not linear else position_cache)(c, (B, T), pos, S, dtype)
    run = layer_runner(c, rope, attend, pos, T, dtype)

    def body(layer, x_BTD, xs):
        p, i, mine = xs
        return run(layer, p, x_BTD, i, mine)

    x_BTD = embed(c, params, tokens_BT, dtype)
    first, out = spec.first_layers(c), []
    for stack, rows in stacks(c).items():
        lo = 0 if stack == "first_layers" else first
        layer = spec.first_layer if stack == "first_layers" else spec.layer
        xs = (_stacked(c, params[stack], stack), jnp.arange(lo, lo + rows, dtype=jnp.int32),
              {k: v[lo:lo + rows] for k, v in cache.items()})
        x_BTD, part = jax.lax.scan(functools.partial(body, layer), x_BTD, xs)
        out.append(part)
    return x_BTD, (out[0] if len(out) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *out))


def extend(c: ModelConfig, params: dict, tokens_BT, pos, cache: dict, dtype=jnp.float32):
    """`hidden`, then the last position's logits (B, V): (logits, cache)."""
    x_BTD, cache = hidden(c, params, tokens_BT, pos, cache, dtype)
    return head(c, params, x_BTD[:, -1:])[:, 0], cache


def position_cache(c: ModelConfig, shape, pos, S: int, dtype, start_B=None):
    """(RoPE tables, attend) for a cache of S slots in position order: the new keys are written at pos.., and a
    query at pos + t sees slots 0..pos + t (its own key is written first), within its layer's window if it has one
    (a mixed stack's local layers); with `start_B`, row b's slots from start_B[b] on only."""
    B, T = shape
    q_pos = pos + jnp.arange(T)
    ahead_TS = q_pos[:, None] - jnp.arange(S)[None, :]
    slot = jnp.arange(S)[None, None, :]
    # a row's slots from its first token on; a padding position before it sees its own slot (never an empty row,
    # whose softmax would be NaN and reach the real tokens through the next layer's keys)
    rows_B1TS = True if start_B is None else ((slot >= start_B[:, None, None]) | (slot == q_pos[None, :, None]))[
        :, None]

    def attend(q_BTHE, k_BTKE, v_BTKE, k_BSKE, v_BSKE, window=None, softcap=None, scale=None, sinks=None):
        k_BSKE = jax.lax.dynamic_update_slice_in_dim(k_BSKE, k_BTKE.astype(k_BSKE.dtype), pos, axis=1)
        v_BSKE = jax.lax.dynamic_update_slice_in_dim(v_BSKE, v_BTKE.astype(v_BSKE.dtype), pos, axis=1)
        keys, values = k_BSKE.astype(dtype), v_BSKE.astype(dtype)
        window = c.uniform_window if window is None else window  # a model-wide window (a ring's, when not linear)
        if window is None and softcap is None and scale is None and sinks is None:
            o = jax.nn.dot_product_attention(q_BTHE, keys, values, mask=(ahead_TS >= 0)[None, None] & rows_B1TS)
        else:
            keep = (ahead_TS >= 0) & (True if window is None else ahead_TS < window)
            keep = keep if start_B is None else keep[None, None, None] & rows_B1TS[:, :, None]
            o = masked_attention(q_BTHE, keys, values, keep, softcap, scale, sinks)
        return o, k_BSKE, v_BSKE

    return rope_for(c, T, jnp.broadcast_to(q_pos, (B, T))), attend


def _ring(c: ModelConfig, shape, pos, R: int, dtype):
    """The same for a sliding window: the cache is a ring of R slots (R = the window, or less for a short run),
    the key of position p in slot p % R. The new tokens attend to the ring's keys and their own (those fewer than
    `window` positions back); then the last min(T, R) of them take their slots."""
    B, T = shape
    W = c.window
    q_pos = pos + jnp.arange(T)
    slot_pos = pos - 1 - jnp.mod(pos - 1 - jnp.arange(R), R)  # the newest position before pos in each slot
    k_pos = jnp.concatenate([jnp.where(slot_pos >= 0, slot_pos, -W - T), q_pos])  # empty slots: out of reach
    ahead_TK = q_pos[:, None] - k_pos[None, :]
    mask_11TK = ((ahead_TK >= 0) & (ahead_TK < W))[None, None]
    m = min(T, R)
    slots = jnp.mod(q_pos[T - m:], R)

    def attend(q_BTHE, k_BTKE, v_BTKE, k_BRKE, v_BRKE, window=None, softcap=None, scale=None, sinks=None):
        # every layer has the window W (a uniform window): the ring holds it
        keys = jnp.concatenate([k_BRKE.astype(dtype), k_BTKE], axis=1)
        values = jnp.concatenate([v_BRKE.astype(dtype), v_BTKE], axis=1)
        if softcap is None and scale is None and sinks is None:
            o = jax.nn.dot_product_attention(q_BTHE, keys, values, mask=mask_11TK)
        else:
            o = masked_attention(q_BTHE, keys, values, mask_11TK[0, 0], softcap, scale, sinks)
        k_BRKE = k_BRKE.at[:, slots].set(k_BTKE[:, T - m:].astype(k_BRKE.dtype))
        v_BRKE = v_BRKE.at[:, slots].set(v_BTKE[:, T - m:].astype(v_BRKE.dtype))
        return o, k_BRKE, v_BRKE

    return rope_for(c, T, jnp.broadcast_to(q_pos, (B, T))), attend


def sample(logits_BV, key, temperature, top_k):
    """Next tokens (B,): argmax at temperature 0, else a draw from the top_k (0 = all) softmax.

    temperature and top_k may be traced, so one compiled step serves every setting.
    """
    V = logits_BV.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth_B1 = jnp.sort(logits_BV, axis=-1)[:, V - k][:, None]
    kept_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    drawn_B = jax.random.categorical(key, kept_BV / jnp.where(temperature > 0, temperature, 1.0))
    return jnp.where(temperature > 0, drawn_B, jnp.argmax(logits_BV, axis=-1)).astype(jnp.int32)


@functools.lru_cache(maxsize=8)
def _step_fn(c: ModelConfig, dtype):
    """extend + sample, jitted once per model (compiled for the prefill and the one-token shapes)."""
    def step(params, tokens_BT, pos, cache, key, temperature, top_k, n_ids):
        logits_BV, cache = extend(c, params, tokens_BT, pos, cache, dtype)
        known_V = jnp.arange(logits_BV.shape[-1]) < n_ids  # a padded vocabulary's last rows are no token's
        return sample(jnp.where(known_V, logits_BV, -jnp.inf), key, temperature, top_k), cache
    return jax.jit(step, donate_argnums=3)


def fit_prompt(prompt_BT, context: int) -> np.ndarray:
    """The prompt as `generate` keeps it in a context of that many positions: whole, or, longer than that, its last
    context/2 tokens, the log saying how many were dropped (call it before printing, so the line stands alone)."""
    tokens = np.asarray(prompt_BT, np.int32)
    P = tokens.shape[1]
    if P <= context:
        return tokens
    log.warning("generate: the prompt's %d tokens exceed the model's context of %d positions; its first %d "
                "tokens were dropped", P, context, P - context // 2)
    return tokens[:, -(context // 2):]


def generate(c: ModelConfig, params: dict, prompt_BT, n: int, *, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, dtype=jnp.float32, context: int | None = None,
             vocab: int | None = None) -> Iterator[np.ndarray]:
    """Yield n new tokens (B,) one at a time: one prefill, then one cached step per token; ids from `vocab` on (the
    rows a padded vocabulary adds, which no token uses) are never drawn.

    The cache holds the prompt and the new tokens, up to `context` positions (the model's context; default
    c.seq_len, the trained one). A prompt longer than that keeps its last context/2 tokens and the log says how
    many were dropped; when the cache is full, the last half of the tokens is prefilled again into an empty
    cache and decoding continues from there.
    """
    C = context or c.seq_len
    tokens = fit_prompt(prompt_BT, C)
    B = tokens.shape[0]
    S = min(tokens.shape[1] + n, C)
    step = _step_fn(c, jnp.dtype(dtype))
    temperature, top_k, n_ids = jnp.float32(temperature), jnp.int32(top_k), jnp.int32(vocab or c.vocab_size)
    key = jax.random.key(seed)
    context_BT = tokens
    R = min(S, c.uniform_window) if c.uniform_window else S  # slots: a sliding window keeps only its own keys (a ring)
    cache, pos, nxt = init_cache(c, B, R, dtype), 0, context_BT
    for _ in range(n):
        key, sub = jax.random.split(key)
        tok_B, cache = step(params, jnp.asarray(nxt), jnp.int32(pos), cache, sub, temperature, top_k, n_ids)
        pos += nxt.shape[1]
        tok_B = np.asarray(tok_B)
        yield tok_B
        context_BT = np.concatenate([context_BT, tok_B[:, None]], axis=1)
        if pos == S:  # full: keep the last half as context and prefill it again
            context_BT = context_BT[:, -(S // 2):]
            cache, pos, nxt = init_cache(c, B, R, dtype), 0, context_BT
        else:
            nxt = tok_B[:, None]
