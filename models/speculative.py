"""Speculative decoding with the multi-token-prediction modules (model.mtp_depth = D, models/objectives/mtp.py) as
the drafts and the main model as the judge, greedy: the output is the main model's greedy output, token for token.

Tokens g_0 .. g_{A-1} known (the prompt's and those generated), the step keeps this invariant: the main model's
cache holds positions 0..A-2 (the newest token not fed yet) and its hidden states h0 there (after the final norm);
module d's cache and outputs hd hold positions 0..A-1-d, every position whose read token (t + d) is known.

- Drafts: y_d = argmax head(hd at A-2), d = 1..D. Module 1 at A-2 read g_{A-1}; module d > 1 read the draft y_{d-1}.
- Verify: one forward of the main model on [g_{A-1}, y_1, .., y_D] at positions A-1..A-1+D gives its greedy z_0..z_D;
  the drafts up to the first with y_d != z_{d-1} are accepted (k of them), and z_0..z_k are the new tokens: k + 1
  tokens for one forward. The cache's entries past the accepted ones are overwritten by the next step.
- Catch up: module d runs on positions A-d .. A'-2 (A' = A + k + 1): the k + 1 whose read tokens are now known,
  then d - 1 reading the next step's drafts y'_1 .. y'_{d-1}, which the modules before it have just made at A'-2.
  The last position's output is the next draft y'_d. Module d's inputs at a position are exactly those of training
  (the token d ahead, depth d-1's output there), so each draft is the module's teacher-forced prediction.

The caches are in position order (a sliding window is masked, never a ring: a rejected draft must not take a slot).
One sequence at a time; its prompt and tokens within the model's context.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.decode import position_cache, hidden, init_cache, layer_runner
from models.objectives import mtp
from models.spec import family
from models.transformer import embed, final_norm, head


@dataclass
class Stats:
    """What the drafts did: `forwards` of the main model (the prompt's included), `drafted` and `accepted` drafts,
    and the position whose module outputs made each step's first draft (module 1 at A-2)."""
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    positions: list = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_forward(self) -> float:
        """New tokens per forward of the main model."""
        return self.tokens / self.forwards if self.forwards else 0.0

    def summary(self) -> str:
        return (f"generate --speculative: {self.accepted} of {self.drafted} drafts accepted (acceptance rate "
                f"{self.acceptance:.3f}); {self.tokens} tokens in {self.forwards} forwards of the main model "
                f"({self.per_forward:.2f} tokens per forward, the prompt's included)")


def _greedy(logits, n_ids):
    known = jnp.arange(logits.shape[-1]) < n_ids  # a padded vocabulary's last rows are no token's
    return jnp.argmax(jnp.where(known, logits, -jnp.inf), axis=-1).astype(jnp.int32)


@functools.lru_cache(maxsize=8)
def _verify_fn(c: ModelConfig, dtype):
    """The main model on tokens (1, T) at pos..: (its greedy next tokens (1, T), hidden states after the final norm
    (1, T, D), cache)."""
    def verify(params, tokens_BT, pos, cache, n_ids):
        x_BTD, cache = hidden(c, params, tokens_BT, pos, cache, dtype, linear=True)
        return _greedy(head(c, params, x_BTD), n_ids), final_norm(c, params, x_BTD), cache
    return jax.jit(verify, donate_argnums=3)


@functools.lru_cache(maxsize=8)
def _module_fn(c: ModelConfig, dtype):
    """Module d (traced: one program serves every depth) on its read tokens (1, T) and depth d-1's outputs (1, T, D)
    at pos..: (its greedy predictions (1, T), its outputs after its own norm (1, T, D), its cache)."""
    def module(params, d, tokens_BT, h_BTD, pos, cache, n_ids):
        B, T = tokens_BT.shape
        S = next(iter(cache.values())).shape[2]
        rope, attend = position_cache(c, (B, T), pos, S, dtype)
        run = layer_runner(c, rope, attend, pos, T, dtype)
        p = {k: jax.lax.dynamic_index_in_dim(w, d - 1, keepdims=False) for k, w in params["mtp"].items()}
        ahead = embed(c, params, tokens_BT, dtype)
        step = functools.partial(_module_layer, ahead=ahead, layer=family(c.family).layer)
        # as in training (models/objectives/mtp.py sums): layer index n_layers + d - 1, no per-layer tables
        h_BTD, mine = run(step, p, h_BTD.astype(dtype), c.n_layers + d - 1, {k: v[0] for k, v in cache.items()}, {})
        return _greedy(head(c, params, h_BTD, normed=True), n_ids), h_BTD, {k: v[None] for k, v in mine.items()}
    return jax.jit(module, donate_argnums=5)


def _module_layer(c, p, h_BTD, call, *, ahead, layer):
    return mtp.depth(c, p, h_BTD, ahead, call, layer)


def speculative(c: ModelConfig, params: dict, prompt, n: int, stats: Stats, *, dtype=jnp.float32,
                vocab: int | None = None) -> Iterator[int]:
    """Yield the main model's n greedy tokens after the 1-D prompt, drafting with the modules; `stats` is filled
    as they come."""
    D = c.mtp_depth
    prompt = [int(t) for t in prompt]
    P = len(prompt)
    S = P + n + 2 * D + 1  # room for the drafts' entries past the last token
    n_ids = jnp.int32(vocab or c.vocab_size)
    dt = jnp.dtype(dtype)
    cache = init_cache(c, 1, S, dt)
    shapes = jax.eval_shape(lambda: init_cache(c, 1, S, dt))
    caches = [{k: jnp.zeros((1,) + v.shape[1:], v.dtype) for k, v in shapes.items()} for _ in range(D)]
    H = [np.zeros((S, c.d_model), np.float32) for _ in range(D)]  # h0 .. h(D-1) by position
    verify = _verify_fn(c, dt)

    z, h0, cache = verify(params, jnp.asarray([prompt], jnp.int32), jnp.int32(0), cache, n_ids)
    stats.forwards += 1
    H[0][:P] = np.asarray(h0[0])
    g = prompt + [int(z[0, -1])]
    drafts = _catch_up(c, dt, params, caches, H, g, 1, n_ids)
    stats.tokens += 1
    yield g[-1]
    while stats.tokens < n:
        A = len(g)
        stats.positions.append(A - 2)
        z, h0, cache = verify(params, jnp.asarray([[g[-1]] + drafts], jnp.int32), jnp.int32(A - 1), cache, n_ids)
        stats.forwards += 1
        z = [int(t) for t in np.asarray(z[0])]
        k = next((j for j in range(D) if drafts[j] != z[j]), D)
        new = z[:k + 1][:n - stats.tokens]
        stats.drafted += min(D, n - stats.tokens)  # the drafts this step could use (the last step may need fewer)
        stats.accepted += min(k, len(new))
        H[0][A - 1:A + k] = np.asarray(h0[0, :k + 1])
        g += new
        stats.tokens += len(new)
        yield from new
        if stats.tokens < n:
            drafts = _catch_up(c, dt, params, caches, H, g, A, n_ids)


def _catch_up(c, dt, params, caches, H, g, A: int, n_ids) -> list[int]:
    """Run module d on positions A-d .. len(g)-2 (from 0 after the prompt, A = 1), each reading the token d ahead
    (g, then the drafts the modules before it made at the last position) and depth d-1's outputs; returns the
    next drafts y_1 .. y_D."""
    D, last = c.mtp_depth, len(g) - 2
    drafts: list[int] = []
    for d in range(1, D + 1):
        lo = max(A - d, 0)
        T = last + 1 - lo
        L = T if A == 1 else 2 * D  # a step's runs (k + d <= 2D positions) padded to one shape
        read = (g + drafts)[lo + d:lo + d + T]
        tokens = np.zeros((1, L), np.int32)
        tokens[0, :T] = read
        h = np.zeros((1, L, c.d_model), np.float32)
        h[0, :T] = H[d - 1][lo:lo + T]
        pred, out, caches[d - 1] = _module_fn(c, dt)(params, jnp.int32(d), jnp.asarray(tokens), jnp.asarray(h),
                                                     jnp.int32(lo), caches[d - 1], n_ids)
        if d < D:
            H[d][lo:lo + T] = np.asarray(out[0, :T], np.float32)
        drafts.append(int(pred[0, T - 1]))
    return drafts
