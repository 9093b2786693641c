"""Dropless expert parallelism by all-to-all (models/kernels/experts.py `_experts_routed`): 4 data ranks each
holding one of 4 experts, each rank's tokens sent to their experts' ranks in buffers of a factor x the balanced share
and back; output and gradients (tokens, routing weights, the three expert weights) against a per-expert loop on one
device (tests/test_moe_tpu.py `loop`), with buffers that hold every rank's choices (the all-to-all path) and with
buffers too small (every rank takes the gathered path together); `routes` against numpy."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from models.kernels import experts
from test_moe_tpu import _close, _problem, _value_and_grads, loop


def test_routes_sorts_counts_and_places_each_choice():
    """Each choice's place in its destination's run and the runs' sizes and starts, by numpy; overflow when a run
    outgrows the buffer; a choice not sent (rank R) counts nowhere."""
    rng = np.random.default_rng(0)
    R, M = 4, 50
    dest = rng.integers(0, R + 1, M)
    order, sizes, offsets, slot, over = (np.asarray(x) for x in experts.routes(jnp.asarray(dest), R, 16))
    assert list(order) == list(np.argsort(dest, kind="stable"))
    want = np.bincount(dest, minlength=R + 1)[:R]
    assert list(sizes) == list(want) and list(offsets) == list(np.cumsum(want) - want)
    for i, c in enumerate(order):
        if dest[c] < R:
            assert slot[i] == sum(dest[order[:i]] == dest[c])
    assert bool(over) == (want.max() > 16)
    assert experts.buffer_rows(192, 4, 2.0) == 96 and experts.buffer_rows(100, 4, 1.25) == 32


@pytest.mark.parametrize("factor,form", [(2.0, "padded"), (0.5, "padded"), (2.0, "ragged"),
                                         pytest.param(0.5, "ragged", marks=pytest.mark.slow)],
                         ids=["all_to_all", "overflow", "ragged", "ragged-overflow"])
def test_routed_experts_over_4_ranks_equal_the_loop(factor, form):
    """4 ranks, 24 tokens each, 2 choices of 4 experts: with buffers of twice the balanced share every choice fits
    (the program's all-to-alls carry them); with half of it some rank's run overflows and every rank sends the rest
    in more rounds of the same buffers; both equal the loop within 1e-5. `ragged`: the TPU's form (the runs by ragged all-to-all, their offsets and sizes
    routes'), its exchange on CPU by Collectives.ragged_all_to_all's padded all_to_all (XLA:CPU has no
    ragged-all-to-all)."""
    from meshes import RULES, Collectives, build_mesh
    mesh = build_mesh(jax.devices()[:4], data=4)
    coll = Collectives(RULES.replace(experts="data"), mesh)
    h, idx, w, ws = _problem(2)
    keep = np.ones(idx.shape, bool)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    args = (put(h, "data"), put(w, "data"), tuple(put(x, "data") for x in ws))
    f = lambda h, w, ws: experts.grouped_mlp(h, put(idx, "data"), put(keep, "data"), w, ws, jax.nn.silu,  # noqa
                                             "tpu" if form == "ragged" else "cpu", impl="tile_scan",
                                             collectives=coll, routed=factor)
    with jax.set_mesh(mesh):
        got = _value_and_grads(f, *args)
        hlo = jax.jit(f).lower(*args).compile().as_text()
    want = _value_and_grads(lambda h, w, ws: loop(h, idx, keep, w, ws), h, w, ws)
    _close(got, want)
    assert "all-to-all" in hlo
    # the overflow flag, from the choices per (rank, destination) against the buffer
    dest = np.asarray(idx).reshape(4, -1)  # each rank's choices' destinations: one expert per rank
    per = np.stack([np.bincount(r, minlength=4) for r in dest])
    assert (per.max() > experts.buffer_rows(dest.shape[1], 4, factor)) == (factor < 1)
