"""Where a run without a checkpoint to resume starts: the parameters of `model.init_from` (an export, a
run's checkpoint or a Hugging Face folder, trainer/ckpt/params.py), else a random initialisation."""
from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp

from trainer import guard
from trainer.ckpt.params import init_params
from trainer.parallel import localsgd
from trainer.state import Setup, init_state

log = logging.getLogger(__name__)


def state_from_params(s: Setup, params) -> dict:
    """A step-0 train state around given (sharded) parameters: fresh optimizer state, same shardings; with
    local SGD every replica (and DiLoCo's outer parameters) starts from them."""
    def make(p):
        state = {"step": jnp.zeros((), jnp.int32), "params": p, "opt_state": s.tx.init(p),
                 "guard": guard.init(s.cfg.train)}
        if not localsgd.enabled(s.cfg):
            return state
        # a leaf the rules split over the data axis stays one array (each rank its slice), as in a fresh state
        own = localsgd.owned(s.tx, s.reduction, s.shapes["opt_state"])
        return localsgd.replicate(s.cfg, s.reduction.size, state, own)
    with jax.set_mesh(s.mesh):
        return jax.jit(make, out_shardings=s.shardings)(params)


def initial_state(s: Setup, say: Callable[[str], None] | None = None) -> dict:
    """The step-0 train state: from `model.init_from` when it is set, else random; created sharded."""
    if s.cfg.model.init_from:
        params = init_params(s, s.cfg.model.init_from)
        (say or log.info)(f"parameters from {s.cfg.model.init_from}")
        return state_from_params(s, params)
    return init_state(s)
