"""Model families: one registry, `model.family` names an entry.

A family is a module that registers a `ModelSpec`: its parameter inventory (every parameter's per-layer shape,
logical axes, initializer, weight decay and precision, written once), its layer function and, for families that
exist on the Hugging Face hub, its adapter (`HFAdapter`: config.json <-> config keys, tensor names <->
parameters, both directions; trainer/ckpt/hf.py reads and writes folders through it). State init, the
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


class Leaf(NamedTuple):
    """One parameter and its HF tensors: parameter = stack over layers of view.transpose(perm) of each tensor."""
    path: tuple  # keys into the params dict
    names: list  # HF names: one per layer for stacked leaves, else one
    hf_shape: tuple  # each HF tensor's shape (out, in)
    view: tuple  # the HF tensor reshaped so that a transpose gives meshtrain's per-layer layout
    perm: tuple
    stacked: bool


def leaf_shape(leaf: Leaf) -> tuple:
    """The meshtrain parameter's shape (with the leading layers axis for a stacked leaf)."""
    one = tuple(leaf.view[p] for p in leaf.perm)
    return (len(leaf.names),) + one if leaf.stacked else one


class HFAdapter(NamedTuple):
    """A family's Hugging Face form. Each function raises ValueError (with the config.json field) on what the
    family cannot compute or express."""
    architecture: str  # config.json's architectures[0], e.g. "LlamaForCausalLM"
    check: Callable  # (config.json dict) -> None: refuse features the family does not implement
    model_keys: Callable  # (config.json dict) -> {model key: (value, config.json key)}
    leaves: Callable  # (ModelConfig) -> [Leaf]: every parameter and its tensors
    config: Callable  # (ModelConfig, dtype name) -> config.json dict
    expressible: Callable = lambda mc: None  # (ModelConfig) -> None: refuse a model HF cannot hold


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    # (ModelConfig) -> {name: Param}; the stack's per-layer parameters under "layers"; the embedding "embed"
    # (vocab, embed), the final norm and the untied head as the model's `final_norm` / `head_weight` read them
    inventory: Callable
    # (c, p, x_BTD, rope, constrain, kernels, half, segments) -> x_BTD: one layer on its weights p (no layers
    # axis), through `half` (sublayer remat) for each residual half; see models/transformer.py's `layer`
    layer: Callable
    hf: HFAdapter | None = None  # None: the family has no Hugging Face form


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


def hf_family(architecture: str) -> ModelSpec:
    """The family whose HF adapter reads `architecture` (config.json's architectures[0])."""
    for spec in FAMILIES.values():
        if spec.hf is not None and spec.hf.architecture == architecture:
            return spec
    known = sorted(s.hf.architecture for s in FAMILIES.values() if s.hf is not None)
    raise ValueError(f"describes {architecture}; meshtrain imports {', '.join(known)}")
