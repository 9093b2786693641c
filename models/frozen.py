"""Frozen weights (Param.trainable False: a LoRA run's base, DeepSeek's router bias) in the train step: no gradient
computed where the step differentiates (`frozen_stopped`), zero where a path computed one anyway (`frozen_zeroed`),
so that the gradient's norm and clipping see the trained weights alone; the optimizer holds no state for them
(trainer/optim.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.transformer import inventory


def _on_frozen(c: ModelConfig, tree: dict, fn) -> dict:
    """tree (shaped like the params) with fn applied to each frozen weight's leaf (Param.trainable False)."""
    inv = inventory(c)
    if all(getattr(p, "trainable", True) for v in inv.values() for p in (v.values() if isinstance(v, dict) else [v])):
        return tree

    def one(x, p):
        return x if p.trainable else fn(x)
    return {k: ({n: one(w, inv[k][n]) for n, w in v.items()} if isinstance(v, dict) else one(v, inv[k]))
            for k, v in tree.items()}


def frozen_stopped(c: ModelConfig, params: dict) -> dict:
    """params with each frozen one (a LoRA run's base, DeepSeek's router bias) behind a stop-gradient: the step
    computes no gradient of it, its norm and clipping see the trained weights alone."""
    return _on_frozen(c, params, jax.lax.stop_gradient)


def frozen_zeroed(c: ModelConfig, grads: dict) -> dict:
    """A gradient tree with each frozen weight's zero (a path that differentiated it anyway: a pipeline's)."""
    return _on_frozen(c, grads, jnp.zeros_like)


def trained_only(c: ModelConfig, tree: dict) -> dict:
    """tree (shaped like the params) without the frozen weights' leaves: what of a gradient the step keeps."""
    inv = inventory(c)

    def keep(p):
        return getattr(p, "trainable", True)
    return {k: ({n: w for n, w in v.items() if keep(inv[k][n])} if isinstance(v, dict) else v)
            for k, v in tree.items() if isinstance(v, dict) or keep(inv[k])}


def joined(a: dict, b: dict) -> dict:
    """Two parameter trees of disjoint leaves as one, a stack's dicts merged."""
    return {**a, **b, **{k: {**a[k], **b[k]} for k in a.keys() & b.keys()}}
