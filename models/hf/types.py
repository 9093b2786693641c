"""The types of a family's Hugging Face form (ModelSpec.hf, models/spec.py): its adapter (HFAdapter), each parameter's
tensors (Leaf) and the larger models whose text tower it reads (HFWrapper). trainer/ckpt/hf.py reads and writes
folders through them."""
from __future__ import annotations

from typing import Callable, NamedTuple


class Leaf(NamedTuple):
    """One parameter and its HF tensors: parameter = stack over layers of view.transpose(perm) of each tensor."""
    path: tuple  # keys into the params dict
    names: list  # HF names: one per layer for stacked leaves, else one
    hf_shape: tuple  # each HF tensor's shape (out, in)
    view: tuple  # the HF tensor reshaped so that a transpose gives meshtrain's per-layer layout
    perm: tuple
    stacked: bool
    # a stacked leaf's leading axes, its tensors (names) in row-major order over them: () for the layers alone,
    # (layers, experts) for one tensor per expert of each layer
    lead: tuple = ()
    # a copy a folder may carry of another leaf's parameter (DeepSeek's MTP layer's embed_tokens and shared_head.head):
    # not required on import nor read; export writes it equal to the parameter
    copy: bool = False


def leading(leaf: Leaf) -> tuple:
    """The leading axes a leaf's tensors stack into: () unstacked, (layers,) or its own `lead`."""
    return (leaf.lead or (len(leaf.names),)) if leaf.stacked else ()


def leaf_shape(leaf: Leaf) -> tuple:
    """The meshtrain parameter's shape (with the leading stacked axes for a stacked leaf)."""
    return leading(leaf) + tuple(leaf.view[p] for p in leaf.perm)


class HFWrapper(NamedTuple):
    """A folder of a larger (multimodal) model whose text tower is a family's model: its text config under
    config.json's `config_key`, its text tensors under one of `renames`' folder prefixes (each read under the
    family's prefix), the other towers' tensors (`dropped` prefixes) left out. Such a folder exports as the
    family's own architecture."""
    architecture: str  # e.g. "Gemma3ForConditionalGeneration"
    config_key: str  # e.g. "text_config"
    renames: tuple  # ((folder prefix, family prefix), ...), the first that matches a tensor's name renames it
    dropped: tuple  # prefixes of the other towers' tensors


class HFAdapter(NamedTuple):
    """A family's Hugging Face form. Each function raises ValueError (with the config.json field) on what the
    family cannot compute or express."""
    architecture: str  # config.json's architectures[0], e.g. "LlamaForCausalLM"
    check: Callable  # (config.json dict) -> None: refuse features the family does not implement
    model_keys: Callable  # (config.json dict) -> {model key: (value, config.json key)}
    leaves: Callable  # (ModelConfig) -> [Leaf]: every parameter and its tensors
    config: Callable  # (ModelConfig, dtype name) -> config.json dict
    expressible: Callable = lambda mc: None  # (ModelConfig) -> None: refuse a model HF cannot hold
    wrappers: tuple = ()  # HFWrapper: larger models whose text tower this family reads
    # (ModelConfig) -> (name prefixes of tensors a folder may hold that the model leaves out, why: one log line)
    skipped: Callable = lambda mc: ((), "")
