"""Model families: one registry, `model.family` names an entry.

A family is a module that registers a `ModelSpec`: its parameter inventory (every parameter's per-layer shape,
logical axes, initializer, weight decay and precision, written once) and its layer function. State init, the
optimizer's decay mask, the ZeRO-3 gather's precision, decoding's layer layout and the planner's per-layer weights
read the inventory; the layer stack (scanned or unrolled, remat'd, inside every pipeline schedule) runs the layer
function. models/transformer.py registers `llama`; a family defined anywhere else (a test, a user's module)
registers the same way, and runs on every layout without a change elsewhere.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple


class Param(NamedTuple):
    """One parameter of an inventory: per layer for the stack's (which adds the leading `layers` axis)."""
    shape: tuple
    axes: tuple  # logical axis names
    init: str  # "normal" | "residual" (GPT-2's scaled residual outputs) | "ones"
    decay: bool  # weight decay applies (the optimizer reads it, trainer/optim.py)
    as_stored: bool = False  # read as stored (float32): a ZeRO-3 gather must not cast it first (models/precision.py)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    # (ModelConfig) -> {name: Param}; the stack's per-layer parameters under "layers"; the embedding "embed"
    # (vocab, embed), the final norm and the untied head as the model's `final_norm` / `head_weight` read them
    inventory: Callable
    # (c, p, x_BTD, rope, constrain, kernels, half, segments) -> x_BTD: one layer on its weights p (no layers
    # axis), through `half` (sublayer remat) for each residual half; see models/transformer.py's `layer`
    layer: Callable


FAMILIES: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Add a family (or replace one of the same name); returns it."""
    FAMILIES[spec.name] = spec
    return spec


def family(name: str) -> ModelSpec:
    if name not in FAMILIES:
        raise ValueError(f"model.family='{name}' is not registered; choose one of {', '.join(sorted(FAMILIES))} "
                         "or import the module that registers it")
    return FAMILIES[name]
