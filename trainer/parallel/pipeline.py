"""Table-driven pipeline executor (GPipe, circular GPipe, 1F1B, interleaved 1F1B): loss and
gradients in one scan, no autodiff through it.

The schedule is a static table (trainer/parallel/schedules.py): at each tick a stage runs the forward of a
microbatch (storing its input in a buffer slot), the backward of one (`jax.vjp` of the stage body
recomputed from the stored input, with the cotangent received from the next stage), or nothing.
Every tick each stage sends its output to the next stage and its input cotangent to the previous
one by `ppermute`; the receiver files them in the slots the table assigned. So a stage holds only
the inputs between a microbatch's forward and backward (at most S for 1F1B, against M for GPipe).

Stage 0 embeds the microbatch's tokens itself and accumulates the embedding gradient; the last
stage applies the head and cross-entropy as it finishes a microbatch's forward and seeds its
backward with the gradient of the microbatch's loss sum (loss_weight x token loss) over the step's
counted tokens (trainer/step.py): the head runs once per microbatch, on one stage. Every batch
field is split into microbatches alike (trainer/parallel/microbatch.py).
Layer gradients accumulate per stage, in the stored (L/S, ...) layout (circular blocks map back
through the vjp of `circular_blocks`).

The shard_map is manual over `stage` and `data` (tensor parallelism over `model` stays with the
compiler): each data shard accumulates the gradients of its own rows over all ticks, and the
data-parallel sync (train.grad_sync's reducer, trainer/parallel/sync.py) runs once per step after the scan:
an all-reduce for ZeRO 0/1, a reduce-scatter that keeps the gradient sharded for ZeRO 2/3. ZeRO-3
weights arrive sharded and the stage's whole slice of layers (and the embedding and head) is
all-gathered once per step before the scan, not per layer: a stage holds its L/S layers unsharded
for the step, the price of a tick loop that runs any layer block at any tick.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models.loss import chunk_tokens, head_loss, scales, token_losses, zero_parts
from models.transformer import embed, head, layer_stack, scale_embedding
from trainer.parallel import schedules, sync
from trainer.parallel.circular import circular_blocks
from trainer.parallel.microbatch import split_microbatches


@functools.lru_cache(maxsize=None)
def table_plan(schedule: str, stages: int, microbatches: int, repeats: int):
    """(table, plan) of a schedule; cached since every trace of the step asks again."""
    table = schedules.build(schedule, stages, microbatches, repeats)
    return table, schedules.plan(table, repeats)


def _embed(c, params, tokens_BT, dtype, constrain, split_vocab: bool):
    """`embed`; with the vocabulary split over `model` as a one-hot product instead (2*V*D FLOPs
    a token, forward and backward): XLA's SPMD partitioner aborts on the gather inside the
    scan's conditional then (jax 0.10.2, CPU)."""
    if not split_vocab:
        return embed(c, params, tokens_BT, dtype, constrain)
    onehot = jax.nn.one_hot(tokens_BT, params["embed"].shape[0], dtype=params["embed"].dtype)
    x = jnp.einsum("btv,vd->btd", onehot, params["embed"]).astype(dtype)
    return constrain(scale_embedding(c, x), ("batch", "seq", "embed"))


def _cross_entropy(logits_BTV, targets_BT, weight_BT):
    """`cross_entropy` (a weighted sum) with the target logit picked by comparing with an iota
    (models/loss.py), not gathered (as above); XLA fuses the compare into the sum, so no (B, T, V)
    one-hot exists."""
    V = logits_BTV.shape[-1]
    return jnp.sum(token_losses(logits_BTV.reshape(-1, V), targets_BT.reshape(-1)) * weight_BT.reshape(-1))


def _put(buf, i, x):
    """buf[i] = x in place, nothing where i == len(buf) (a scatter's mode="drop" is a while loop on CPU)."""
    j = jnp.minimum(i, buf.shape[0] - 1)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(i < buf.shape[0], x, buf[j]), j, 0)


def loss_and_grads(s, params, batch, scale, keep_logits: bool = False):
    """(parts, gradient) of the objective (models/loss.py): scale["loss"] x the loss sum of a batch (loss_weight
    x token loss, models/batch.py) plus each layer aux sum x its scale, summed over the data ranks, pipelined
    over `stage` by the table of train.pipeline_schedule. The stage body returns (h, aux): its forward adds the
    aux pairs up, its backward seeds each aux sum with its scale. keep_logits: (parts, gradient, logits), the
    (B, T, V) float32 logits of the hidden states the last stage finished each microbatch with (`step_logits`)."""
    c, t, mesh = s.model, s.cfg.train, s.mesh
    S, M, V = mesh.shape["stage"], t.microbatches, t.pipeline_repeats
    _, pl = table_plan(t.pipeline_schedule, S, M, V)
    constrain = s.layout.constrainer(manual={"stage", "data"})
    split_vocab = s.layout.split("vocab") > 1
    mbs = jax.lax.with_sharding_constraint(split_microbatches(batch, M), P(None, "data"))  # each field (M, B/M, T)
    top = {k: v for k, v in params.items() if k != "layers"}
    xs = {k: jnp.asarray(getattr(pl, k)) for k in
          ("branch", "m", "v", "slot", "cot_slot", "loss_slot", "recv_act", "recv_cot")}
    fwd_pairs = [(j, j + 1) for j in range(S - 1)] + ([(S - 1, 0)] if V > 1 else [])
    bwd_pairs = [(b, a) for a, b in fwd_pairs]

    # a backward recomputes its stage body from the stored input: per-layer full/dots remat would
    # recompute it again for nothing with one layer per stage; sublayer halves the vjp's working set
    remat = "sublayer" if c.remat == "sublayer" else "none"

    def body(blocks, v, h, docs):
        """(h, aux) of the stage's block v of layers (blocks: (weights, global layer indices))."""
        p, idx = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, v, 0, keepdims=False), blocks)
        return layer_stack(c, p, h, constrain=constrain, remat=remat, documents=docs, index=idx,
                           placement=s.placement)

    def local(layers, top, mbs, scale):
        if V == 1:
            blocks = jax.tree.map(lambda w: w[None], layers)
            back = lambda d: jax.tree.map(lambda w: w[0], d)  # noqa: E731
        else:
            blocks, vjp_blocks = jax.vjp(lambda ws: jax.tree.map(lambda w: circular_blocks(w, S, V), ws), layers)
            back = lambda d: vjp_blocks(d)[0]  # noqa: E731
        # each layer's index in the whole stack: row r of this stage holds block r*S + stage (trainer/parallel/
        # circular.py; V = 1: the stage's L/S consecutive layers)
        n = c.n_layers // (S * V)
        index = (jnp.arange(V)[:, None] * S + jax.lax.axis_index("stage")) * n + jnp.arange(n)[None, :]
        aux0 = zero_parts(c)["aux"]
        # each aux sum's cotangent is its scale (known before the backward, as the token loss's); counts get none
        aux_cot = {k: (scale["aux"][k], jnp.zeros((), jnp.float32)) for k in aux0}
        emb = lambda tp, m: _embed(c, tp, mbs["tokens"][m], s.dtype, constrain, split_vocab)  # noqa: E731
        h0 = jax.eval_shape(emb, top, 0)
        # microbatch m's (segment_ids, positions) where the model keeps to documents, else None
        docs = lambda m: (mbs["segment_ids"][m], mbs["positions"][m]) if c.documents else None  # noqa: E731
        add = lambda acc, d: jax.tree.map(jnp.add, acc, d)  # noqa: E731

        def mb_loss(y, tp, m):
            targets, weight = mbs["targets"][m], mbs["loss_weight"][m]
            if chunk_tokens(c.loss_chunk, y.shape[0] * y.shape[1], c.vocab_size):  # tiled: logits never whole
                return head_loss(c, tp, y, targets, weight, constrain) * scale["loss"]
            return _cross_entropy(head(c, tp, y, constrain), targets, weight) * scale["loss"]

        # The forward runs in a conditional (output only). The steps that add to the gradient sums
        # run as while loops of 0 or 1 trips: XLA updates a while's carry in place, where a
        # conditional copies every sum it passes through (twice per tick: into the branch's output
        # and back into the scan's carry), and adding a branch's zeros costs as much.
        def fwd(h, m, v):
            return body((blocks, index), v, h, docs(m))

        def fwd_embed(h, m, v):
            return body((blocks, index), v, emb(top, m), docs(m))

        def idle(h, m, v):
            return h, aux0

        # the steps that add to the sums read their inputs as `ins`: see run_if
        def loss_step(ins, gbuf, dtop, loss, *out):
            tp, y, m, slot = ins
            ls, (dy, dt) = jax.value_and_grad(mb_loss, argnums=(0, 1))(y, tp, m)
            gbuf = _put(gbuf, slot, dy.astype(y.dtype))
            if out:  # keep_logits: microbatch m's logits, filed in its row
                out = (_put(out[0], m, head(c, tp, y, constrain).astype(jnp.float32)),)
            return gbuf, add(dtop, dt), loss + ls, *out

        def bwd_step(ins, dblk, dh):
            blk, h, g, v, *m = ins  # m: the microbatch, passed where its documents are read
            _, vjp = jax.vjp(lambda w, x: body((w, index), v, x, docs(*m) if m else None), blk, h)
            db, dh = vjp((g, aux_cot))
            return add(dblk, db), dh

        def bwd_embed_step(ins, dblk, dtop):
            blk, tp, g, m, v = ins
            _, vjp = jax.vjp(lambda w, e: body((w, index), v, emb({**tp, "embed": e}, m), docs(m)), blk, tp["embed"])
            db, de = vjp((g, aux_cot))
            return add(dblk, db), {**dtop, "embed": dtop["embed"] + de}

        def run_if(pred, f, ins, *state):
            """f(ins, *state) if pred else state, as a while loop of 0 or 1 trips. The inputs pass a
            barrier with the trip counter: otherwise XLA hoists what depends only on them (the
            recomputed forward of a backward) out of the loop, to run every tick."""
            def step(carry):
                i, x = jax.lax.optimization_barrier((carry[0], ins))
                return (i + 1, *f(x, *carry[1:]))
            # the loop's ops are scoped by f's name: the HLO reader (trainer/plan/hlo.py) counts each
            # step's trips from that, whatever XLA shares between the loops' bodies
            with jax.named_scope(f.__name__):
                return jax.lax.while_loop(lambda c: c[0] < pred.astype(jnp.int32), step,
                                          (jnp.int32(0), *state))[1:]

        fwd_branch = np.zeros(6, np.int32)  # forward conditional: 0 none, 1 fwd, 2 fwd_embed
        fwd_branch[[schedules.FWD, schedules.FWD_LOSS]], fwd_branch[schedules.FWD_EMBED] = 1, 2
        me = jax.lax.axis_index("stage")

        def tick(carry, row):
            xbuf, gbuf, dblk, dtop, loss, aux, *out = carry
            r = {k: a[me] for k, a in row.items()}
            br, m, v = r["branch"], r["m"], r["v"]
            h = xbuf[r["slot"]]
            y, aux_y = jax.lax.switch(jnp.asarray(fwd_branch)[br], [idle, fwd, fwd_embed], h, m, v)
            aux = add(aux, aux_y)
            gbuf, dtop, loss, *out = run_if(br == schedules.FWD_LOSS, loss_step, (top, y, m, r["loss_slot"]),
                                            gbuf, dtop, loss, *out)
            # read after the loss step's write (never on a backward's tick), which then needs no copy
            g = gbuf[r["cot_slot"]]
            # the writes nobody reads, such as what a stage sends on a tick it has nothing to send (any
            # array of the shape: no zeros kept), go to slot n_act (n_cot), one past the end: dropped,
            # where a spare row to take them would cost a stage input (cotangent) of memory. The output
            # is sent before the backward, whose input cotangent then takes its buffer.
            xbuf = _put(xbuf, r["recv_act"], jax.lax.ppermute(y, "stage", fwd_pairs))
            dblk, dh = run_if(br == schedules.BWD, bwd_step, (blocks, h, g, v) + ((m,) if c.documents else ()), dblk, y)
            dblk, dtop = run_if(br == schedules.BWD_EMBED, bwd_embed_step, (blocks, top, g, m, v), dblk, dtop)
            gbuf = _put(gbuf, r["recv_cot"], jax.lax.ppermute(dh, "stage", bwd_pairs))
            return (xbuf, gbuf, dblk, dtop, loss, aux, *out), None

        rows = lambda n: jnp.zeros((max(n, 1),) + h0.shape, h0.dtype)  # noqa: E731
        out = [jnp.zeros((M,) + h0.shape[:-1] + (c.vocab_size,), jnp.float32)] if keep_logits else []
        carry = (rows(pl.n_act), rows(pl.n_cot), jax.tree.map(jnp.zeros_like, blocks),
                 jax.tree.map(jnp.zeros_like, top), jnp.zeros((), jnp.float32), aux0, *out)
        (_, _, dblk, dtop, loss, aux, *out), _ = jax.lax.scan(tick, carry, xs)
        parts = jax.lax.psum({"loss": loss, "aux": aux}, "stage")
        return parts, jax.lax.psum(dtop, "stage"), back(dblk), *(jax.lax.psum(o, "stage") for o in out)

    k, zero = mesh.shape["data"], t.zero_stage
    dims = jax.tree.map(lambda sh, lg: s.layout.data_dim(sh.shape, lg), s.param_shapes, s.logical)
    specs = jax.tree.map(lambda sh, lg: s.layout.compute_spec(sh.shape, lg), s.param_shapes, s.logical)
    top_dims, top_specs = ({n: tree[n] for n in top} for tree in (dims, specs))
    reducer = sync.make(t.grad_sync, "data", k)

    def synced(layers, top, mbs, scale):
        """`local` on this data shard's rows; the data-parallel sync once, on the step's gradients."""
        if zero >= 3:
            layers = reducer.all_gather_tree(layers, dims["layers"], specs["layers"])
            top = reducer.all_gather_tree(top, top_dims, top_specs)
        parts, dtop, dlayers, *out = local(layers, top, mbs, scale)
        g = {**dtop, "layers": dlayers}
        if k > 1:
            g = (reducer.reduce_scatter_tree if zero >= 2 else reducer.all_reduce_tree)(g, dims, specs)
        # sums over this shard's rows: the step's are their sum over `data`
        return jax.lax.psum(parts, "data"), g, *out

    def manual_specs(sharded: bool):
        """Specs over the manual axes: layers split over `stage`, ZeRO dims over `data` if `sharded`."""
        def spec(sh, d, stage):
            e = ["stage"] if stage else []
            return P(*(e + [None] * (d - len(e)) + ["data"])) if sharded and d is not None else P(*e)
        return {n: jax.tree.map(functools.partial(spec, stage=n == "layers"), params[n], dims[n]) for n in params}

    p_in, g_out = manual_specs(zero >= 3), manual_specs(zero >= 2)
    fn = jax.shard_map(synced, mesh=mesh, in_specs=(p_in["layers"], {n: p_in[n] for n in top}, P(None, "data"), P()),
                       out_specs=(P(), g_out) + ((P(None, "data"),) if keep_logits else ()),
                       axis_names={"stage", "data"}, check_vma=False)
    parts, g, *out = fn(params["layers"], top, mbs, scale)
    if not keep_logits:
        return parts, g
    logits = out[0].swapaxes(0, 1)  # (M, B/M, T, V) -> (B, T, V): row j*M + m was microbatch m's row j
    return parts, g, logits.reshape((-1,) + logits.shape[2:])


def step_logits(s, params, batch):
    """(logits, parts) of one step of the pipeline executor (train.pipeline_schedule's table, its forward and
    backward ticks): the head's logits, (B, T, V) float32, of the hidden states each microbatch's last stage feeds
    its loss (taken again beside the loss, which may tile them), and the step's loss and aux parts (the batch's own
    scales). What the pipeline trains on, checked logit by logit (tests/hf_check.py against transformers')."""
    parts, _, logits = loss_and_grads(s, params, batch, scales(s.model, batch), keep_logits=True)
    return logits, parts
