"""The form in which the strategies that attend with models/kernels/flash_blocks.py (the all-gather and the ring,
models/context_parallel/gather.py and ring.py) take a layer's attention call."""
from __future__ import annotations

import jax.numpy as jnp

from models.kernels import flash_blocks as fb
from models.kernels.fast_cpu import _group, _kv, _ungroup

Q, KV = ("batch", "seq", "heads", "head_dim"), ("batch", "seq", "kv_heads", "head_dim")


def blockwise(kernel, coll, positions_T, core):
    """(q, k, v, segments=, window=, softcap=, scale=) -> o (the LayerCall.attention form) in a region manual over
    every mesh axis, each rank running core(opts, q (B, K, G, T, E), k, v (B, K, T, E), positions (T,), segments
    (B, T) or None, window, sinks (K, G) or None) -> o (B, K, G, T, E); opts = (scale, softcap, tile). The attention of the strategies that
    attend by models/kernels/flash_blocks.py whatever `kernel`'s implementation: they read its window (a uniform
    one, models/layers.py) and its query block (model.attention_block: the tile); a family's own window, soft-cap
    and scale come as options. The window travels as a float32 array (a stack whose layers differ in window traces
    it, and a custom_vjp takes no tracer among its static arguments), None where there is none."""
    keywords = getattr(kernel, "keywords", {})
    tile = keywords.get("block") or fb.TILE

    def attend(q_BTHE, k_BTKE, v_BTKE, segments=None, window=None, softcap=None, scale=None, windows=None,
               sinks=None):
        window = keywords.get("window") if window is None else window
        window = None if window is None or (isinstance(window, int) and not window) else jnp.asarray(window,
                                                                                                    jnp.float32)

        def rank(q, k, v, pos, seg, window, z):
            K, E = k.shape[2], q.shape[-1]
            opts = (E ** -0.5 if scale is None else scale, softcap, tile)
            z = None if z is None else z.reshape(K, -1)  # the rank's heads' sinks, grouped as q
            return _ungroup(core(opts, _group(q, K), _kv(k), _kv(v), pos, seg, window, z))
        # the window an argument (a replicated scalar), not a closure: a traced one belongs to the mesh outside
        args, axes = (q_BTHE, k_BTKE, v_BTKE, positions_T, segments, window, sinks), (Q, KV, KV, ("seq",))
        axes += (None if segments is None else ("batch", "seq"), None if window is None else (),
                 None if sinks is None else ("heads",))
        # manual over every axis: a collective over `context` whose operand the compiler partitions over `model` is
        # replicated over it first (XLA gathered every kv head over `model`, then ran every rank's attention on all
        # of them), and with any axis automatic (`stage` of size 1 too) the reduce-scatter's reduction holds a
        # sharding annotation that XLA:CPU's bfloat16 promotion aborts on; each rank's heads attend alone
        return coll.region(rank, axes, Q)(*args)
    return attend
