"""gpt-oss's experts (biases on gate, up and down, the clamped SwiGLU) in every formulation of
models/kernels/experts.py, called through grouped_mlp, against a per-token, per-choice loop written here from
transformers' GptOssExperts: outputs and the gradients of every input (tokens, routing weights, weights and biases),
1e-5; the CPU tile scan's own backward included. Inputs scaled so that each clamp acts on some rows (asserted)."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from models.families.gpt_oss import clamped_swiglu
from models.kernels import experts

N, D, F, X, K, LIMIT, ALPHA = 40, 16, 24, 4, 2, 1.5, 1.702


def _inputs():
    ks = jax.random.split(jax.random.key(3), 8)
    h = jax.random.normal(ks[0], (N, D))
    idx = jnp.argsort(jax.random.normal(ks[1], (N, X)), axis=-1)[:, :K].astype(jnp.int32)
    keep = jax.random.uniform(ks[2], (N, K)) > 0.15  # some choices dropped
    w = jnp.where(keep, jax.nn.softmax(jax.random.normal(ks[3], (N, K)), axis=-1), 0.0)
    weights = (0.6 * jax.random.normal(ks[4], (X, D, F)), 0.6 * jax.random.normal(ks[5], (X, D, F)),
               0.3 * jax.random.normal(ks[6], (X, F, D)), *(0.5 * jax.random.normal(k, s) for k, s in
                                                            zip(jax.random.split(ks[7], 3), ((X, F), (X, F), (X, D)))))
    return h, idx, keep, w, weights


def reference(h, idx, keep, w, weights):
    """transformers' GptOssExperts for each token's each choice (its expert's weights gathered): gate_up = x @ W + b,
    gate = min(gate, limit), up = clip(up, -limit, limit), out = ((up + 1) * gate * sigmoid(alpha * gate)) @ down +
    b_down, weighted by the routing weight of a kept choice (0 for a dropped one) and summed over the choices."""
    gate, up, down, bg, bu, bd = weights
    g = jnp.minimum(jnp.einsum("nd,nkdf->nkf", h, gate[idx]) + bg[idx], LIMIT)
    u = jnp.clip(jnp.einsum("nd,nkdf->nkf", h, up[idx]) + bu[idx], -LIMIT, LIMIT)
    out = jnp.einsum("nkf,nkfd->nkd", (u + 1) * (g * jax.nn.sigmoid(ALPHA * g)), down[idx]) + bd[idx]
    return jnp.einsum("nk,nkd->nd", jnp.where(keep, w, 0.0), out)


def _loss(fn):
    probe = jax.random.normal(jax.random.key(9), (N, D))
    return lambda h, w, ws: jnp.sum(fn(h, w, ws) * probe)


# the CPU's (with its own backward) in the default run
FORMS = [f if f == "tile_scan" else pytest.param(f, marks=pytest.mark.slow) for f in experts.FORMULATIONS]


@pytest.mark.parametrize("impl", FORMS)
def test_formulation_equals_the_loop(impl):
    h, idx, keep, w, weights = _inputs()
    g, u = (np.asarray(h @ weights[i] + weights[3 + i][:, None]) for i in (0, 1))  # every expert on every token
    assert (g > LIMIT).any() and (u > LIMIT).any() and (u < -LIMIT).any()
    glu = functools.partial(clamped_swiglu, LIMIT, ALPHA)
    mine = jax.jit(lambda h, w, ws: experts.grouped_mlp(h, idx, keep, w, ws, jax.nn.silu, impl=impl, glu=glu))
    ref = jax.jit(lambda h, w, ws: reference(h, idx, keep, w, ws))
    np.testing.assert_allclose(mine(h, w, weights), ref(h, w, weights), atol=1e-5, rtol=1e-5)
    got = jax.jit(jax.grad(_loss(mine), argnums=(0, 1, 2)))(h, w, weights)
    want = jax.jit(jax.grad(_loss(ref), argnums=(0, 1, 2)))(h, w, weights)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
