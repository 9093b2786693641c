"""A Llama-style decoder in Flax NNX, with a pure functional forward.

Dimension letters (tensor names carry their shape, e.g. x_BTD):
  B batch   T sequence   D d_model   H query heads   K kv heads   G = H/K
  E head_dim   F d_ff (MLP hidden)   V vocabulary   L layers

The module owns the parameters and their logical axis names; the math lives in pure
functions over a dict of arrays, so the trainer can jit, shard_map, pipeline and remat
it without going through the module. Layers are stacked on a leading `layers` axis and
run by one `lax.scan` (one compiled layer). The model never names a mesh axis: it calls
`constrain(x, logical_axes)`, supplied by the trainer from meshes.rules.

The math below is the plain reference: einsum projections with autodiff, jax.nn.silu, rotate-half
RoPE, jax.nn attention. `kernels_for` swaps in models/fast_cpu.py's equal but faster forms of
the projections, SiLU, RoPE and attention on XLA:CPU (model.kernels: auto | reference | fast).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models import fast_cpu
from models.attention import attention
from models.config import ModelConfig

Constrain = Callable[[jax.Array, tuple], jax.Array]


def _no_constrain(x, logical):
    return x


def _identity(p):
    return p


class Stack(nnx.Module):
    """The decoder layers' weights, stacked on a leading `layers` axis."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        L, D, H, K, E, F = c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff
        normal = nnx.initializers.normal(c.init_std)
        out_init = nnx.initializers.normal(c.init_std / (2 * L) ** 0.5)  # GPT-2 residual scaling

        # (L, ...) whatever the parallel layout or pipeline schedule, so that any checkpoint
        # restores onto any of them; a schedule that needs another order re-lays them out itself
        def param(init, shape, axes, decay=True):
            return nnx.Param(init(rngs.params(), shape, jnp.float32), logical_axes=axes, weight_decay=decay)

        ones = lambda key, shape, dtype: jnp.ones(shape, dtype)
        self.attn_norm = param(ones, (L, D), ("layers", "embed"), decay=False)
        self.wq = param(normal, (L, D, H, E), ("layers", "embed", "heads", "head_dim"))
        self.wk = param(normal, (L, D, K, E), ("layers", "embed", "kv_heads", "head_dim"))
        self.wv = param(normal, (L, D, K, E), ("layers", "embed", "kv_heads", "head_dim"))
        self.wo = param(out_init, (L, H, E, D), ("layers", "heads", "head_dim", "embed"))
        self.mlp_norm = param(ones, (L, D), ("layers", "embed"), decay=False)
        self.w_gate = param(normal, (L, D, F), ("layers", "embed", "mlp"))
        self.w_up = param(normal, (L, D, F), ("layers", "embed", "mlp"))
        self.w_down = param(out_init, (L, F, D), ("layers", "mlp", "embed"))


class Transformer(nnx.Module):
    """Token embedding -> L x (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU) -> head."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs):
        self.config = c
        # weight_decay: declared with each parameter; the optimizer reads it (trainer/optim.py)
        self.embed = nnx.Param(nnx.initializers.normal(c.init_std)(rngs.params(), (c.vocab_size, c.d_model)),
                               logical_axes=("vocab", "embed"), weight_decay=True)
        self.layers = Stack(c, rngs)
        self.final_norm = nnx.Param(jnp.ones((c.d_model,)), logical_axes=("embed",), weight_decay=False)
        if not c.tie_embeddings:
            self.lm_head = nnx.Param(nnx.initializers.normal(c.init_std)(rngs.params(), (c.d_model, c.vocab_size)),
                                     logical_axes=("embed", "vocab"), weight_decay=True)

    def __call__(self, tokens_BT, dtype=jnp.float32):
        return forward(self.config, params_of(self), tokens_BT, dtype=dtype)


def params_of(model: nnx.Module) -> dict:
    """The module's parameters as a plain nested dict of arrays."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def logical_axes_of(model: nnx.Module) -> dict:
    """The logical axis names of every parameter, as a dict shaped like params_of()."""
    state = nnx.state(model, nnx.Param)
    return nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata()["logical_axes"]), state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _metadata_of(model: nnx.Module, key: str) -> dict:
    """One metadata field of every parameter, as a dict shaped like params_of(); each must declare it."""
    def get(path, v):
        if key not in v.get_metadata():
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} does not declare {key}; declare it where "
                             "the parameter is created")
        return v.get_metadata()[key]
    return nnx.to_pure_dict(jax.tree_util.tree_map_with_path(get, nnx.state(model, nnx.Param),
                                                             is_leaf=lambda x: isinstance(x, nnx.Variable)))


def weight_decay_of(model: nnx.Module) -> dict:
    """Whether each parameter is weight-decayed, as declared where it was created (a dict like params_of())."""
    return _metadata_of(model, "weight_decay")


class Abstract(NamedTuple):
    params: dict  # ShapeDtypeStructs
    logical: dict  # logical axis names
    decay: dict  # weight decay on or off


def abstract_model(mc: ModelConfig, seed: int = 0) -> Abstract:
    """Parameter shapes, logical axes and weight-decay declarations, without allocating anything."""
    m = nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(seed)))
    return Abstract(params_of(m), logical_axes_of(m), weight_decay_of(m))


# ----------------------------------------------------------------------------- math

def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


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


def rope_tables(T: int, E: int, theta: float, scaling=None, positions_BT=None):
    """cos, sin (T, E/2) of positions 0..T-1, or (B, T, E/2) of each token's own position."""
    inv = rope_inv_freq(E, theta, scaling)
    pos = jnp.arange(T, dtype=jnp.float32) if positions_BT is None else positions_BT.astype(jnp.float32)
    ang = pos[..., None] * inv
    return jnp.cos(ang), jnp.sin(ang)


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


def project(x_BTD, weights):
    """[x @ w for w in weights], w of shape (D, ...); outputs named for the `dots` remat policy."""
    return [checkpoint_name(jnp.einsum("btd,d...->bt...", x_BTD, w), "projection") for w in weights]


class Kernels(NamedTuple):
    """The layer's swappable pieces: the plain ones above or models/fast_cpu.py's, and the attention."""
    name: str  # "reference" or "fast"
    project: Callable  # (x (B, T, D), weights (D, ...) of the same shape) -> [x @ w]
    silu: Callable
    rope: Callable  # apply_rope's signature
    attention: Callable  # (q (B, T, H, E), k, v (B, T, K, E), segments (B, T) or None) -> causal attention


def kernels_for(c: ModelConfig, platform: str | None = None) -> Kernels:
    """The kernels for c.kernels on a jax platform (default: c.target_platform):
    `auto` = the fast paths on CPU, the plain ones elsewhere."""
    platform = platform or c.target_platform
    fast = c.kernels == "fast" or (c.kernels == "auto" and platform == "cpu")
    # model.attention=auto follows attention.select: manual on CPU with the fast paths (XLA's with
    # the reference ones), cuDNN's on GPU for bfloat16, XLA's otherwise
    attn = functools.partial(attention, impl=c.attention, block=c.attention_block, platform=platform,
                             cpu_fast=fast)
    name = "fast" if fast else "reference"
    fns = (fast_cpu.project, fast_cpu.silu, fast_cpu.apply_rope) if fast else (project, jax.nn.silu, apply_rope)
    # each kernel's ops are scoped `kernels_<name>` in the program's metadata: which ones a compiled
    # program runs can be read from its HLO (tests/test_tpu_compile.py)
    return Kernels(name, *(_scoped(f"kernels_{name}", f) for f in fns), attn)


def _scoped(scope: str, f: Callable) -> Callable:
    @functools.wraps(f)
    def run(*args, **kwargs):
        with jax.named_scope(scope):
            return f(*args, **kwargs)
    return run


def layer(c: ModelConfig, p: dict, x_BTD, rope, constrain: Constrain = _no_constrain,
          kernels: Kernels | None = None, half: Callable = _identity, segments=None):
    """One decoder layer on weights `p` (no leading layers axis): attention half, MLP half, each through `half`.
    `segments` (B, T): each token's document (float32; None: one per row); attention stays inside it."""
    kn = kernels or kernels_for(c)
    x_BTD = half(functools.partial(attention_half, c, rope=rope, constrain=constrain, kernels=kn,
                                   segments=segments))(p, x_BTD)
    return half(functools.partial(mlp_half, c, constrain=constrain, kernels=kn))(p, x_BTD)


def attention_half(c: ModelConfig, p: dict, x_BTD, rope, constrain: Constrain = _no_constrain,
                   kernels: Kernels | None = None, segments=None):
    """x + attention(norm(x)): norm, q/k/v, RoPE, attention, output projection, residual add."""
    kn = kernels or kernels_for(c)
    p = {k: p[k].astype(x_BTD.dtype) for k in ("attn_norm", "wq", "wk", "wv", "wo")}
    q_BTHE, k_BTKE, v_BTKE = qkv(c, p, x_BTD, rope, constrain, kernels=kn)
    if c.kv_repeat > 1:  # kv head i becomes heads i*r .. i*r+r-1: one per rank, next to its query heads
        k_BTKE, v_BTKE = (constrain(jnp.repeat(a, c.kv_repeat, axis=2), ("batch", "seq", "heads", "head_dim"))
                          for a in (k_BTKE, v_BTKE))
    o_BTHE = kn.attention(q_BTHE, k_BTKE, v_BTKE, segments=segments)
    return attn_out(c, p, x_BTD, o_BTHE, constrain, kn)


def qkv(c: ModelConfig, p: dict, x_BTD, rope, constrain: Constrain = _no_constrain, offset=0,
        kernels: Kernels | None = None):
    """One layer's queries, keys and values, RoPE'd for tokens at positions offset, offset+1, ..."""
    kn = kernels or kernels_for(c)
    h_BTD = rms_norm(x_BTD, p["attn_norm"], c.norm_eps)
    # same-shaped weights in one call: the fast path shares their backward
    if c.fused_qkv:
        q_BTHE, k_BTKE, v_BTKE = kn.project(h_BTD, (p["wq"], p["wk"], p["wv"]))
    else:
        (q_BTHE,) = kn.project(h_BTD, (p["wq"],))
        k_BTKE, v_BTKE = kn.project(h_BTD, (p["wk"], p["wv"]))
    q_BTHE = constrain(kn.rope(q_BTHE, *rope, offset), ("batch", "seq", "heads", "head_dim"))
    k_BTKE = constrain(kn.rope(k_BTKE, *rope, offset), ("batch", "seq", "kv_heads", "head_dim"))
    return q_BTHE, k_BTKE, constrain(v_BTKE, ("batch", "seq", "kv_heads", "head_dim"))


def attn_out_mlp(c: ModelConfig, p: dict, x_BTD, o_BTHE, constrain: Constrain = _no_constrain,
                 kernels: Kernels | None = None):
    """The layer after attention: output projection and SwiGLU MLP, each added to the residual."""
    kn = kernels or kernels_for(c)
    return mlp_half(c, p, attn_out(c, p, x_BTD, o_BTHE, constrain, kn), constrain, kn)


def attn_out(c: ModelConfig, p: dict, x_BTD, o_BTHE, constrain: Constrain = _no_constrain,
             kernels: Kernels | None = None):
    """x + the attention output projected back to d_model."""
    kn = kernels or kernels_for(c)
    B, T, D = x_BTD.shape
    HE = c.n_heads * c.head_dim
    o_BTX = constrain(o_BTHE, ("batch", "seq", "heads", "head_dim")).reshape(B, T, HE)
    (o_BTD,) = kn.project(o_BTX, (p["wo"].astype(x_BTD.dtype).reshape(HE, D),))
    return constrain(x_BTD + o_BTD, ("batch", "seq", "embed"))


def mlp_half(c: ModelConfig, p: dict, x_BTD, constrain: Constrain = _no_constrain,
             kernels: Kernels | None = None):
    """x + SwiGLU(norm(x))."""
    kn = kernels or kernels_for(c)
    p = {k: p[k].astype(x_BTD.dtype) for k in ("mlp_norm", "w_gate", "w_up", "w_down")}
    h_BTD = rms_norm(x_BTD, p["mlp_norm"], c.norm_eps)
    gate_BTF, up_BTF = kn.project(h_BTD, (p["w_gate"], p["w_up"]))
    a_BTF = constrain(kn.silu(gate_BTF) * up_BTF, ("batch", "seq", "mlp"))
    (down_BTD,) = kn.project(a_BTF, (p["w_down"],))
    return constrain(x_BTD + down_BTD, ("batch", "seq", "embed"))


REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # projection outputs: plain dots, or the fast path's `projections` outputs (a custom_vjp,
    # opaque to the dots policy, so they are named); attention is recomputed
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("projection")),
}


def sublayer_remat(f: Callable) -> Callable:
    """model.remat=sublayer on a layer half f(p, x): its backward recomputes it from its saved input."""
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
                p, _, *consts = res
                return dy, jax.tree.map(jnp.zeros_like, p), tuple(map(jnp.zeros_like, consts))

            # A conditional XLA cannot decide: XLA:CPU drops optimization barriers before CSE,
            # which would then merge a recomputation with the forward pass (remat undone), but it
            # does not merge across computations.
            taken = jax.lax.rng_uniform(jnp.int32(1), jnp.int32(2), ()) == 1  # always
            dx, dp, dconsts = jax.lax.cond(taken, recompute, never, dy)
            return dp, dx, *dconsts

        run.defvjp(lambda *a: (g(*a), a), bwd)
        return run(p, x, *consts)

    return half


def layer_stack(c: ModelConfig, layers: dict, x_BTD, *, constrain: Constrain = _no_constrain,
                gather: Callable[[dict], dict] = _identity, remat: str | None = None, documents=None):
    """Run a stack of layers (leading axis = layers), optionally remat'd, scanned or unrolled
    (c.scan_layers).

    `gather` maps one layer's (possibly ZeRO-sharded) weights to the weights it computes with;
    it runs per layer (inside the scan body when scanned), so ZeRO-3 all-gathers one layer at a
    time. `documents` = (segment_ids, positions), each (B, T), or None (one document per row).
    """
    remat = c.remat if remat is None else remat
    segments, positions = (None, None) if documents is None else documents
    # segment ids travel as float32 (exact below 2^24): every constant a remat'd half closes over is then
    # differentiable, as jax.closure_convert and the sub-layer remat's branches need
    segments = None if segments is None else segments.astype(jnp.float32)
    rope = rope_tables(x_BTD.shape[1], c.head_dim, c.rope_theta, c.rope_scaling, positions)
    kernels = kernels_for(c)

    L = jax.tree.leaves(layers)[0].shape[0]
    # auto: unroll short stacks without remat. With remat the loop stays: unrolled, XLA has been
    # seen to merge a recomputed ZeRO-3 all-gather with the forward one (memory not freed).
    scan = c.scan_layers or (c.scan_layers is None and (L > 8 or remat != "none"))
    half = sublayer_remat if remat == "sublayer" else _identity

    def body(x, p):
        return layer(c, gather(p), x, rope, constrain, kernels, half, segments), None

    if remat in REMAT:
        # prevent_cse: outside a scan, XLA's CSE could merge the recomputation with the forward
        # pass (remat undone); inside one it cannot, and the barrier only costs.
        body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=not scan)
    if scan:
        x_BTD, _ = jax.lax.scan(body, x_BTD, layers)
        return x_BTD
    # Unrolled: one copy of the layer per layer in the program. Longer compiles, but no loop:
    # residuals are not stacked into (L, ...) buffers and read back with dynamic slices.
    # lax.split: its transpose is one concatenate (indexing w[i] would transpose to L zero-padded
    # full-size gradients summed together).
    leaves, tree = jax.tree.flatten(layers)
    parts = [jax.lax.split(w, [1] * L) for w in leaves]
    for i in range(L):
        x_BTD, _ = body(x_BTD, tree.unflatten([ps[i][0] for ps in parts]))
    return x_BTD


def embed(c: ModelConfig, params: dict, tokens_BT, dtype, constrain: Constrain = _no_constrain):
    x = jnp.take(params["embed"], tokens_BT, axis=0).astype(dtype)
    return constrain(x, ("batch", "seq", "embed"))


def head(c: ModelConfig, params: dict, x_BTD, constrain: Constrain = _no_constrain):
    """Final norm and output projection; logits in float32."""
    x = rms_norm(x_BTD, params["final_norm"], c.norm_eps)
    w_DV = params["embed"].T if c.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("btd,dv->btv", x, w_DV.astype(x.dtype), preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", "vocab"))


def forward(c: ModelConfig, params: dict, tokens_BT, *, dtype=jnp.float32,
            constrain: Constrain = _no_constrain, gather: Callable[[dict], dict] = _identity,
            remat: str | None = None):
    """Logits (B, T, V) in float32 for integer tokens (B, T)."""
    x = embed(c, params, tokens_BT, dtype, constrain)
    x = layer_stack(c, params["layers"], x, constrain=constrain, gather=gather, remat=remat)
    return head(c, params, x, constrain)

