"""The widths a model splits over the `model` mesh axis, as its family's parameters declare them (validation checks each
against mesh.model)."""
from __future__ import annotations

from meshes import MODEL, RULES
from meshes.rules import SHARED_WHEN_SMALLER
from models import ModelConfig, family
from models.spec import width_keys


def split_widths(mc: ModelConfig) -> list[tuple[str, int]]:
    """('model.KEY=WIDTH', width) of every width the family's parameters split over `model` (their inventory's
    dimensions whose logical axis the rules map to it), each once, heads first; kv heads apart (they may be
    replicated). A dense MLP splits d_ff; an MoE each expert's expert_d_ff (and shared_expert_d_ff), not d_ff."""
    found = {}
    for where, p in _params(family(mc.family).inventory(mc)):
        for axis, width in zip(p.axes, p.shape):
            if RULES.get(axis) == MODEL and axis not in SHARED_WHEN_SMALLER:
                found.setdefault((axis, width), where)
    keys = width_keys(mc)  # each axis's fields, most specific first: a width is named by the first that holds it
    order = list(keys)
    return [(next((f"model.{k}={width}" for k, v in keys.get(axis, ()) if v == width),
                  f"the {axis} width {width} of parameter {found[axis, width]}"), width)
            for axis, width in sorted(found, key=lambda aw: order.index(aw[0]) if aw[0] in order else len(order))]


def padded_vocab(vocab: int, model: int) -> int:
    """A vocabulary of `vocab` tokens padded up to a multiple of mesh.model's `model` ranks (Megatron-LM's
    --make-vocab-size-divisible-by): the rows past `vocab` are no token's, so the data never trains them as targets
    and generation never samples them."""
    return -(-vocab // model) * model


def not_divisible(name: str, width: int, model: int, padded: bool) -> str:
    """The line for a width (`name`: 'model.KEY=WIDTH') that mesh.model's `model` ranks do not divide; a vocabulary
    that may grow (`padded`: not one a model.init_from holds) is named padded up to the next multiple."""
    key = name.split("=")[0]
    pad = (f", e.g. {key}={padded_vocab(width, model)} (padded up to a multiple of {model}: rows no token uses)"
           if padded and key == "model.vocab_size" else "")
    return f"{name} is not divisible by mesh.model={model}; pick a mesh.model that divides {width} or change {key}{pad}"


def _params(tree: dict, path: str = ""):
    """(dotted name, Param) of every parameter of an inventory."""
    for k, v in tree.items():
        yield from _params(v, f"{path}{k}.") if isinstance(v, dict) else [(path + k, v)]
