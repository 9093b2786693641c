"""One layer at one device's shapes, traced: the residuals JAX saves for its backward (trainer/plan/memory.py's
activations), under tensor parallelism's widths and context parallelism's collectives as one rank sees them."""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
from models import ModelConfig
from models.spec import LocalCollectives, family, widths_over_model


def no_remat(mc: ModelConfig) -> ModelConfig:
    return dataclasses.replace(mc, remat="none")


def device_view(mc: ModelConfig, tp: int) -> tuple[ModelConfig, int]:
    """One device's widths under tensor parallelism (heads, kv heads, d_ff, vocab / model; head_dim kept) as a model
    of those widths, and the kv heads' repeat there. With fewer kv heads than ranks (repeat > 1) every device
    projects all of them (their weights are replicated), repeats them and attends with its own slice of the
    repeated heads: one."""
    replicated = mc.n_kv_heads < tp
    view = dataclasses.replace(mc, n_heads=mc.n_heads // tp, n_kv_heads=mc.n_kv_heads if replicated else
                               mc.n_kv_heads // tp, d_ff=mc.d_ff // tp, vocab_size=mc.vocab_size // tp, remat="none")
    # an MoE's experts and shared expert: each one's hidden units over `model`, as the dense MLP's
    return dataclasses.replace(view, **widths_over_model(mc, tp)), tp // mc.n_kv_heads if replicated else 1


def device_kernels(c: ModelConfig, dtype, platform: str, kv_repeat: int, fused_qkv: bool):
    """The layer's kernels as one device of the model runs them, c its widths there: q, k and v projected as the
    whole model's program does (fused_qkv: written at its shapes, while one device's q and k may be alike); with
    repeated kv heads, the attention sees only this device's slice of them (what the sharding constraint after the
    repeat leaves it). cuDNN's fused attention (GPU, bfloat16), which cannot be traced without a GPU, is counted as
    the blockwise attention of models/kernels/fast_cpu.py: both save q, k, v, the output and one log-sum-exp per query."""
    from models.kernels.attention import block_for, select
    from models.kernels.fast_cpu import causal_attention
    from models.layers import kernels_for
    kn = kernels_for(c, platform)
    if dtype is not None and select(c.attention, dtype, platform, kn.name == "fast") == "cudnn":
        kn = kn._replace(attention=lambda q, k, v, segments=None, **kw: causal_attention(
            q, k, v, block_for(c.attention_block, platform)))
    if c.fused_qkv and not fused_qkv:  # a call of three weights is the fused q, k, v: made as the model makes it
        project = kn.project
        kn = kn._replace(project=lambda x, ws: project(x, ws[:1]) + project(x, ws[1:]) if len(ws) == 3 else
                         project(x, ws))
    if kv_repeat == 1:
        return kn
    # the repeat makes n_kv_heads x kv_repeat = mesh.model heads, one per rank
    return kn._replace(attention=lambda q, k, v, segments=None, **kw: kn.attention(q, k[:, :, :1], v[:, :, :1],
                                                                                    **kw))


def residuals(fn, *args) -> float:
    """Bytes JAX saves from fn's forward for its backward, less the weights (already counted as state) and LoRA's
    merged weights (counted with the weights the backward keeps: memory.buffer_bytes)."""
    # jax.ad_checkpoint.print_saved_residuals prints this list; the function behind it returns it
    from jax._src.ad_checkpoint import saved_residuals
    from models.lora import MERGED
    return float(sum(math.prod(aval.shape) * aval.dtype.itemsize for aval, where in saved_residuals(fn, *args)
                     if "argument w" not in where and f"named '{MERGED}'" not in where))


def only_half(n: int):
    """A LayerCall.half that runs only the n-th residual half of a layer (0 attention, 1 MLP), the other as
    the identity: a family's halves measured through its own layer function."""
    seen = []

    def half(f):
        seen.append(f)
        return f if len(seen) - 1 == n else (lambda p, x: x)
    return half


@functools.lru_cache(maxsize=512)
def per_row(mc: ModelConfig, tp: int, dtype: str, platform: str, what: str, context: tuple = (1, "all_gather"),
            stack: str = "layers") -> tuple[float, float]:
    """(fixed, per sequence) residual bytes of one layer (of `stack`, models/spec.py `stacks`) under a remat policy,
    of one of its halves without remat ("attention", "mlp"), or of the head and loss, on `platform`'s kernels."""
    one, two = (traced(mc, tp, dtype, platform, what, rows, context, stack) for rows in (1, 2))
    return 2 * one - two, two - one


@functools.lru_cache(maxsize=512)
def traced(mc: ModelConfig, tp: int, dtype: str, platform: str, what: str, rows: int,
           context: tuple = (1, "all_gather"), stack: str = "layers") -> float:
    """The residual bytes of _per_row's `what` at `rows` sequences, traced; with `context` = (C ranks splitting
    each row, their attention strategy), at one rank's seq_len / C tokens, the strategy's collectives shaped as
    one rank sees them (OneContextRank: the gathered K/V as large as the row's); a third entry M: sequence
    parallelism over M model ranks, the layer's input and output at T / M tokens (`one_model_rank`)."""
    from models.objectives.cross_entropy import cross_entropy
    from models.layers import REMAT, rope_for, sublayer_remat
    from models.spec import family
    from models.transformer import STACKS, head, inventory, layer_call
    (c, repeat), T, dt = device_view(mc, tp), mc.seq_len // context[0], jax.numpy.dtype(dtype)
    sp = context[2] if len(context) > 2 and what != "head" else 1
    w = lambda s: jax.ShapeDtypeStruct(s, jax.numpy.float32)  # noqa: E731
    D = c.d_model
    # the RoPE tables and the targets are made inside the traced function, as abstract as the rest: a plan of
    # any seq_len or head_dim allocates nothing (as constants they count the same bytes)
    x = jax.ShapeDtypeStruct((rows, T // sp, D), dt)
    if what == "head":  # an untied head: its weight, as the tied embedding's, is the same (V, D) numbers
        cfg = dataclasses.replace(c, tie_embeddings=False)
        weights = {k: w(p.shape) for k, p in inventory(cfg).items() if k not in ("embed", "mtp", *STACKS)}
        return residuals(lambda x, weights, r=rows: cross_entropy(
            head(cfg, weights, x), jax.numpy.zeros((r, T), jax.numpy.int32)), x, weights)
    weights = {k: w(p.shape) for k, p in inventory(c)[stack].items()}  # one layer's, at one device's shapes
    kn, spec = device_kernels(c, dt, platform, repeat, mc.fused_qkv), family(c.family)
    layer = spec.first_layer if stack == "first_layers" else spec.layer
    data = {k: jax.numpy.asarray(v)[0] for k, v in spec.layer_data(c).items()}  # layer 0's: same shapes
    half = {"attention": only_half(0), "mlp": only_half(1), "sublayer": sublayer_remat}.get(what)

    def fn(x, weights, half=half):
        call = layer_call(c, rope_for(c, T), kernels=kn, data=data, kv_repeat=repeat)
        if context[0] > 1:  # as models/transformer.py layer_stack runs it: per-token positions, the trainer's strategy
            from models.context_parallel.gather import ContextPlan
            coll, pos = OneContextRank(context[0]), jax.numpy.arange(T, dtype=jax.numpy.float32)
            plan = ContextPlan(context[0], context[1], tuple(range(mc.seq_len)))
            call = layer_call(c, rope_for(c, T, jax.numpy.broadcast_to(jax.numpy.arange(T), (rows, T))), kernels=kn,
                              data=data, kv_repeat=repeat, collectives=coll,
                              attention=plan.attention(kn.attention, coll, pos))
        if sp > 1:
            call = call._replace(constrain=one_model_rank(T, sp), column=sublayer_remat)
        run = lambda x, weights: layer(c, trained(c, stack, weights), x, call._replace(half=half) if half  # noqa
                                       else call)[0]
        if what not in ("none", "attention", "mlp", "sublayer"):
            run = jax.checkpoint(run, policy=REMAT[what], prevent_cse=False)
        return run(x, weights)
    return residuals(fn, x, weights)


def one_model_rank(T: int, M: int):
    """A constrain(x, logical) that shapes the residual stream as one of M sequence-parallel ranks holds it: the
    normed input of the column-parallel matmuls (batch, seq, embed) gathered from T / M to T tokens (a new buffer,
    as the all-gather's), the residual (batch, res_seq, embed) at T tokens cut to T / M (the reduce-scatter's)."""
    def constrain(x, logical):
        if logical == ("batch", "seq", "embed") and x.shape[1] == T // M:
            return jax.numpy.concatenate([x] * M, axis=1)
        if logical == ("batch", "res_seq", "embed") and x.shape[1] == T:
            return x[:, :T // M]
        return x
    return constrain


def trained(c, stack: str, weights: dict) -> dict:
    """One layer's weights as the step runs them: a frozen one behind a stop-gradient, LoRA's adapters merged into
    their weights (models/lora.py): its backward keeps what the step's does."""
    from models.lora import layer_splits, merged
    from models.transformer import inventory
    inv = inventory(c)[stack]
    weights = {k: v if inv[k].trainable else jax.lax.stop_gradient(v) for k, v in weights.items()}
    return merged(c, weights, layer_splits(c) if stack == "layers" else {})


class OneContextRank(LocalCollectives):
    """The collectives (meshes/collectives.py) as one of `ranks` context ranks sees them, for tracing one layer at
    one device's shapes: a gather over `seq` repeats the rank's block (the gathered K/V are the row's size), every
    other axis one rank (models/spec.py's local form)."""

    def __init__(self, ranks: int):
        self.ranks = ranks

    def axis_size(self, logical: str) -> int:
        return self.ranks if logical == "seq" else 1

    def all_gather(self, x, logical: str, axis: int = 0):
        return jax.numpy.concatenate([x] * self.ranks, axis) if logical == "seq" else x

    def all_to_all(self, x, logical: str, split_axis: int, concat_axis: int):
        if logical != "seq":
            return x
        return jax.numpy.concatenate(jax.numpy.split(x, self.ranks, split_axis), concat_axis)
