"""Reusable layer pieces, as pure functions: RMSNorm, RoPE (per-token positions too), projections, the swappable
kernels (the plain reference or models/kernels/fast_cpu.py's XLA:CPU fast paths, and the attention), the remat policies and
the mesh facts a program is built for (`Placement`).

Dimension letters as in models/transformer.py. Families (models/spec.py) build their layers from these.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.kernels import fast_cpu
from models.kernels.attention import attention, block_for
from models.config import ModelConfig
from models.spec import LOCAL, family


class Placement(NamedTuple):
    """What a model's program needs of the mesh it runs on, given by its caller (the trainer, from its mesh): the
    platform it is built for ("cpu", "gpu", "tpu"; None: the runtime's default device's), whose kernels and attention
    it runs (a TPU topology compiled ahead of time on a CPU host is "tpu"); and how many times each kv head is
    repeated before attention: with fewer kv heads than tensor-parallel ranks (their weights replicated), ranks / kv
    heads, so that each rank holds the kv head of its query heads, split like them (cuDNN's kernel takes q, k and v
    split alike only); and the collectives over logical axes its layers get (LayerCall.collectives; the local form
    by default: one rank)."""
    platform: str | None = None
    kv_repeat: int = 1
    collectives: Any = LOCAL
    # context parallelism (models/context_parallel/gather.py ContextPlan: each row's tokens split over `context`, the attention
    # strategy that attends a chunk, the tokens' original positions); None: whole rows, index causality
    context: Any = None
    # sequence parallelism: the residual stream split over `model` along the sequence (trainer/state.py rules_for);
    # each column-parallel matmul's gathered input is then recomputed in the backward, not kept (LayerCall.column)
    sequence_parallel: bool = False


def rms_norm(x, w, eps, plus_one: bool = False):
    """RMSNorm over the last axis in float32, gain w (Gemma's: 1 + w, the weight stored as HF stores it)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    gain = w.astype(jnp.float32)
    return (y * (1.0 + gain if plus_one else gain)).astype(x.dtype)


def rope_inv_freq(E: int, theta: float, scaling=None):
    """RoPE's E/2 inverse frequencies; `scaling` (ModelConfig.rope_scaling) as transformers' llama3 type."""
    inv = 1.0 / (theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E))
    if scaling is None:
        return inv
    factor, low, high, old_len = scaling
    wavelen = 2 * jnp.pi / inv
    # long wavelengths slowed down by `factor`, short ones kept, the band between interpolated
    scaled = jnp.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return jnp.where(medium, smoothed, scaled)


def yarn_inv_freq(E: int, theta: float, factor: float, original_max: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True):
    """YaRN's E/2 inverse frequencies (transformers' `yarn` rope type): the frequencies that turn fewer than
    `beta_slow` times over the original context interpolated (divided by `factor`), those that turn more than
    `beta_fast` times kept, a linear ramp over the dimensions between (its ends rounded outwards where `truncate`)."""
    def dim_of(turns):  # the dimension whose frequency turns `turns` times over the original context
        return E * math.log(original_max / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, E - 1)
    pos = theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E)
    span = (high + 0.001 if high == low else high) - low  # one dimension: a step, not a division by 0
    kept = 1 - jnp.clip((jnp.arange(E // 2, dtype=jnp.float32) - low) / span, 0, 1)
    return 1.0 / (factor * pos) * (1 - kept) + 1.0 / pos * kept


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times the original: 0.1 m ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """The factor YaRN multiplies the RoPE tables' cos and sin by: yarn_mscale(factor), or with DeepSeek's two
    corrections (both set and nonzero) their ratio, yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_softmax_factor(factor: float, mscale_all_dim: float) -> float:
    """What DeepSeek's attention multiplies its softmax scale (1 / sqrt(query width)) by under YaRN:
    yarn_mscale(factor, mscale_all_dim) squared."""
    return yarn_mscale(factor, mscale_all_dim) ** 2


def rope_tables(T: int, E: int, theta: float, scaling=None, positions_BT=None, linear: float | None = None):
    """cos, sin (T, E/2) of positions 0..T-1, or (B, T, E/2) of each token's own position; `linear`: the
    frequencies divided by that factor (transformers' `linear` rope type)."""
    inv = rope_inv_freq(E, theta, scaling)
    if linear:
        inv = inv / linear
    pos = jnp.arange(T, dtype=jnp.float32) if positions_BT is None else positions_BT.astype(jnp.float32)
    ang = pos[..., None] * inv
    return jnp.cos(ang), jnp.sin(ang)


def rope_for(c: ModelConfig, T: int, positions_BT=None) -> tuple:
    """The RoPE tables a layer of c gets (LayerCall.rope): its family's (ModelSpec.rope: Gemma 3's per layer kind),
    else (cos, sin) of c.rope_theta and c.rope_scaling."""
    own = family(c.family).rope
    if own is not None:
        return own(c, T, positions_BT)
    return rope_tables(T, c.head_dim, c.rope_theta, c.rope_scaling, positions_BT)


def rope_at(cos, sin, T: int, offset=0):
    """The tables broadcast against (B, T, N, E/2): per-token ones as they are, shared ones from offset."""
    if cos.ndim == 3:  # (B, T, E/2): each token's own position
        return cos[:, :, None, :], sin[:, :, None, :]
    return (jax.lax.dynamic_slice_in_dim(cos, offset, T)[:, None, :],  # (T, 1, E/2)
            jax.lax.dynamic_slice_in_dim(sin, offset, T)[:, None, :])


def apply_rope(x_BTNE, cos_TE2, sin_TE2, offset=0):
    """Rotate pairs (first half, second half) of head_dim by the angles of positions offset.. (rotate-half);
    per-token tables (B, T, E/2) give each token its own angles."""
    cos, sin = rope_at(cos_TE2, sin_TE2, x_BTNE.shape[1], offset)
    x1, x2 = jnp.split(x_BTNE.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNE.dtype)


def attend(attention, q_BTHE, k_BTKE, v_BTKE, scale: float | None = None, **kw):
    """`attention` (a LayerCall's: any context strategy, any kernel, each of which takes one width for q, k and v
    and the scale width ** -0.5) of values of another width than the queries' and keys' (multi-head latent
    attention's v_head_dim against qk_nope + qk_rope) and of another scale (default the queries' width ** -0.5):
    all three padded with zeros to the wider width (a zero column adds nothing to a score, and gives an output
    column that is cut off), the scale folded into the queries."""
    E, Ev = q_BTHE.shape[-1], v_BTKE.shape[-1]
    W = max(E, Ev)
    if scale is not None or W != E:
        q_BTHE = q_BTHE * jnp.asarray((E ** -0.5 if scale is None else scale) * W ** 0.5, q_BTHE.dtype)

    def pad(x):
        return x if x.shape[-1] == W else jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, W - x.shape[-1]),))
    return attention(pad(q_BTHE), pad(k_BTKE), pad(v_BTKE), **kw)[..., :Ev]

def project(x_BTD, weights):
    """[x @ w for w in weights], w of shape (D, ...); outputs named for the `dots` remat policy."""
    return [checkpoint_name(jnp.einsum("btd,d...->bt...", x_BTD, w), "projection") for w in weights]


class Kernels(NamedTuple):
    """The layer's swappable pieces: the plain ones above or models/kernels/fast_cpu.py's, and the attention."""
    name: str  # "reference" or "fast"
    project: Callable  # (x (B, T, D), weights (D, ...) of the same shape) -> [x @ w]
    silu: Callable
    rope: Callable  # apply_rope's signature
    attention: Callable  # (q (B, T, H, E), k, v (B, T, K, E), segments (B, T) or None) -> causal attention
    platform: str = "cpu"  # the platform they are for (an MoE layer picks its grouped matmul by it, models/families/moe.py)


def kernels_for(c: ModelConfig, platform: str | None = None) -> Kernels:
    """The kernels for c.kernels on a jax platform (default: the runtime's default device's):
    `auto` = the fast paths on CPU, the plain ones elsewhere."""
    platform = platform or jax.devices()[0].platform
    fast = c.kernels == "fast" or (c.kernels == "auto" and platform == "cpu")
    # model.attention=auto follows attention.select: manual on CPU with the fast paths (XLA's with
    # the reference ones) and on TPU, cuDNN's on GPU for bfloat16, XLA's otherwise
    attn = functools.partial(attention, impl=c.attention, block=block_for(c.attention_block, platform),
                             platform=platform, cpu_fast=fast, **({"window": c.window} if c.uniform_window else {}))
    name = "fast" if fast else "reference"
    fns = (fast_cpu.project, fast_cpu.silu, fast_cpu.apply_rope) if fast else (project, jax.nn.silu, apply_rope)
    # each kernel's ops are scoped `kernels_<name>` in the program's metadata: which ones a compiled
    # program runs can be read from its HLO (tests/test_tpu_compile.py)
    return Kernels(name, *(_scoped(f"kernels_{name}", f) for f in fns), attn, platform)


def _scoped(scope: str, f: Callable) -> Callable:
    @functools.wraps(f)
    def run(*args, **kwargs):
        with jax.named_scope(scope):
            return f(*args, **kwargs)
    return run



REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # projection outputs: plain dots, or the fast path's `projections` outputs (a custom_vjp,
    # opaque to the dots policy, so they are named); attention is recomputed
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("projection")),
}


def sublayer_remat(f: Callable) -> Callable:
    """model.remat=sublayer on a layer half f(p, x) (-> x, or (x, aux) for an MLP half), and sequence parallelism's
    norm + column-parallel projections (-> a tuple of them, LayerCall.column): its backward recomputes it from its
    saved input."""
    # A custom vjp rather than jax.checkpoint(nothing_saveable): XLA:CPU merged that recomputation
    # with the forward pass (both halves' internals live at once again; measured: no memory saved).
    def half(p, x):
        g, consts = jax.closure_convert(f, p, x)  # the tables and indices it closes over, as arguments

        @jax.custom_vjp
        def run(p, x, *consts):
            return g(p, x, *consts)

        def bwd(res, dy):
            def recompute(dy):
                dp, dx, *dconsts = jax.vjp(g, *res)[1](dy)
                return dx, dp, tuple(dconsts)

            def never(dy):
                p, x, *consts = res
                return jnp.zeros_like(x), jax.tree.map(jnp.zeros_like, p), tuple(map(jnp.zeros_like, consts))

            # A conditional XLA cannot decide: XLA:CPU drops optimization barriers before CSE,
            # which would then merge a recomputation with the forward pass (remat undone), but it
            # does not merge across computations.
            taken = jax.lax.rng_uniform(jnp.int32(1), jnp.int32(2), ()) == 1  # always
            dx, dp, dconsts = jax.lax.cond(taken, recompute, never, dy)
            return dp, dx, *dconsts

        run.defvjp(lambda *a: (g(*a), a), bwd)
        return run(p, x, *consts)

    return half


def column_remat(platform: str | None) -> Callable:
    """LayerCall.column under sequence parallelism, for the devices of `platform` (None: the runtime's default's): the
    norm and column projections recomputed in the backward from the split input. XLA:CPU: sublayer_remat (it merges
    jax.checkpoint's recomputation with the forward). Elsewhere jax.checkpoint saving nothing: XLA:TPU keeps that
    recomputation apart, where sublayer_remat's conditional cost it memory (the small preset at (2,1,4), remat none,
    v5p:2x2x2: 86.4 MB of temp with it, 95.5 MB with the conditional, 91.3 MB without sequence parallelism) and
    failed libtpu 0.0.50's partitioner inside ZeRO-3's manual shard_map."""
    if (platform or jax.devices()[0].platform) == "cpu":
        return sublayer_remat
    return lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=True)
