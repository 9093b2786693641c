"""Multi-token prediction's shifts (DeepSeek-V3's MTP, the coming modules' targets): what depth d of the modules
reads and predicts at each position of a batch, from the batch's own fields (models/batch.py), so that a target
never comes from beyond the window, never crosses a packed document's boundary, and never counts a padding or a
masked (loss-weight 0) token.

At depth d (1, 2, ...) the module at position t reads the token d positions ahead (token t + d, the main model's
target of position t + d - 1) and predicts the one after it, token t + d + 1: the main model's target of position
t + d. That target counts with the main loss's weight there (loss_weight[t + d]: its own pair inside one document,
not masked) where position t + d is inside the window and in position t's document (documents are contiguous runs
of one segment id, so every token between is in it too); else 0. Positions stay the tokens' own (RoPE)."""
from __future__ import annotations

import jax.numpy as jnp

from models.spec import family


def _ahead(x_BT, d: int):
    """x shifted d positions left inside each row: x[:, t + d], zero past the window's end."""
    return jnp.pad(x_BT[:, d:], ((0, 0), (0, min(d, x_BT.shape[1]))))


def shifted(batch: dict, d: int) -> dict:
    """Depth d's fields of a batch of whole rows: `tokens` (B, T) the token each position's module reads (token
    t + d; 0 where there is none), `targets` the token it predicts (t + d + 1) and `loss_weight` how much that
    counts (0 past the window, across a document's boundary, on padding or where the main loss does not count
    position t + d's target)."""
    seg = batch["segment_ids"]
    same = (_ahead(seg, d) == seg) & (seg != 0)
    inside = jnp.arange(seg.shape[1])[None, :] + d < seg.shape[1]
    weight = _ahead(batch["loss_weight"].astype(jnp.float32), d) * (same & inside)
    return {"tokens": _ahead(batch["targets"], d - 1), "targets": _ahead(batch["targets"], d), "loss_weight": weight}


def depth(c, p: dict, h_BTD, ahead_BTD, call, layer):
    """One module of depth d on the previous depth's output h (depth 1: the main model's hidden state after its
    final norm) and the embeddings of the tokens d ahead: [enorm(embedding), hnorm(h)] (the embedding first)
    projected by eh_proj (2 D, D), one decoder layer of the family (`layer`, on the module's own weights p), then
    the module's own norm: (its output, the layer's aux). The main model's head turns it into logits."""
    from models.layers import rms_norm
    x = jnp.concatenate([rms_norm(ahead_BTD, p["enorm"], c.norm_eps), rms_norm(h_BTD, p["hnorm"], c.norm_eps)], -1)
    x = jnp.einsum("bte,ed->btd", x, p["eh_proj"].astype(x.dtype))
    y, aux = layer(c, p, x, call)
    return rms_norm(y, p["post_norm"], c.norm_eps), aux


def names(c) -> tuple:
    """The aux outputs of the modules: mtp_1 .. mtp_D, each depth's cross-entropy sum (logged as aux/mtp_<d>)."""
    return tuple(f"mtp_{d}" for d in range(1, c.mtp_depth + 1))


def counts(c, batch: dict) -> dict:
    """Each depth's counted targets over a batch (the divisor of its mean)."""
    return {f"mtp_{d}": jnp.sum(shifted(batch, d)["loss_weight"]) for d in range(1, c.mtp_depth + 1)}


def weights(c) -> dict:
    """Each depth's weight in the objective: model.mtp_weight x the mean over depths."""
    return {k: c.mtp_weight / c.mtp_depth for k in names(c)}


def local_rows(batch: dict, placement):
    """(the rows' fields `shifted` reads, whole and in their original order; the original index of each token this
    code holds, or None): under context parallelism (placement.context) each row's chunk reads tokens of the next
    ranks' chunks, so the small fields are gathered over `seq` once and put back in order."""
    plan = placement.context
    if plan is None:
        return batch, None
    T, n = batch["targets"].shape[1], len(plan.order)
    idx_T = plan.positions(placement.collectives, T).astype(jnp.int32)
    gather = (lambda x, axis: x) if T == n else (lambda x, axis: placement.collectives.all_gather(x, "seq", axis))
    idx_n = gather(idx_T, 0)
    rows = {k: jnp.zeros(batch[k].shape[:1] + (n,), batch[k].dtype).at[:, idx_n].set(gather(batch[k], 1))
            for k in ("targets", "loss_weight", "segment_ids")}
    return rows, idx_T


def local_shifted(rows: dict, d: int, idx_T) -> dict:
    """`shifted` of `local_rows`' rows, at this code's tokens (all of them without context parallelism)."""
    f = shifted(rows, d)
    return f if idx_T is None else {k: v[:, idx_T] for k, v in f.items()}


def sums(c, params: dict, x_BTD, batch: dict, constrain, placement) -> dict:
    """Each depth's cross-entropy sum (weighted by its shifted loss weights) from the main model's last hidden state
    x (before the final norm): depth 1 on the final norm's output, depth d on depth d - 1's; the embedding and the
    head the main model's (its projection alone: each module's own norm comes first); documents as the batch has
    them, positions the tokens' own; the layer's kernels, collectives and attention strategy (context parallelism's)
    the placement's, as the main stack's."""
    from models.layers import kernels_for
    from models.objectives.cross_entropy import head_cross_entropy
    from models.transformer import _attention_and_rope, embed, final_norm, layer_call
    h = final_norm(c, params, x_BTD)
    docs = c.documents
    kernels = kernels_for(c, placement.platform)
    attention, rope = _attention_and_rope(c, kernels, placement, x_BTD, batch["positions"] if docs else None)
    call = layer_call(c, rope, constrain, kernels, segments=batch["segment_ids"].astype(jnp.float32) if docs else None,
                      index=c.n_layers, kv_repeat=placement.kv_repeat, collectives=placement.collectives,
                      attention=attention)
    out, tables = {}, family(c.family).aux_shapes(c)
    rows, idx_T = local_rows(batch, placement)  # gathered once for every depth
    for d in range(1, c.mtp_depth + 1):
        f = local_shifted(rows, d, idx_T)
        p = {k: w[d - 1] for k, w in params["mtp"].items()}
        h, aux = depth(c, p, h, embed(c, params, f["tokens"], x_BTD.dtype, constrain),
                       call._replace(index=c.n_layers + d - 1), family(c.family).layer)
        out[f"mtp_{d}"] = head_cross_entropy(c, params, h, f["targets"], f["loss_weight"], constrain, normed=True)
        for k in tables:  # the module's rows of the layers' tables (DeepSeek's loads, which move its own bias)
            out[k] = out[k] + aux[k] if k in out else aux[k]
    return out
