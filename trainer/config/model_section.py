"""The `model:` section of the config schema (trainer/config/sections.py), written from the model's own declarations: each
key of models/config.py's ModelConfig and of each registered family's config (ModelSpec.config: Gemma's), with the
default, allowed values and meaning of its field; every key may be null (the preset's, the family's or an HF folder's
value) but those the model declares with a default of their own. The trainer adds the keys it alone reads."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import List, Optional

from models import FAMILIES, PRESETS
from models.config import DIM, FLOAT32, ModelConfig, config_class, is_key
from trainer.errors import UserError
from trainer.config.schema import Form, check_choice, in_range, setting


def _rope_scaling(v, name: str):
    """transformers' llama3 rules: factor >= 1, 0 < low_freq_factor < high_freq_factor (the band between them is
    interpolated, divided by their difference), an original context length that is a whole number of tokens."""
    v = list(v)
    if len(v) != 4 or not all(in_range(abs(x), f"<= {FLOAT32}") for x in v):  # nan and inf fail the range
        why = f"has {len(v)} numbers" if len(v) != 4 else "holds a number that is not finite in float32"
    elif v[0] < 1:
        why = f"factor {v[0]} is below 1 (it would shorten the context)"
    elif not 0 < v[1] < v[2]:
        why = f"low_freq_factor {v[1]} and high_freq_factor {v[2]} are not 0 < low < high"
    elif v[3] != int(v[3]) or not in_range(v[3], DIM):
        why = f"original_max_position_embeddings {v[3]} is not a whole number of tokens in {DIM}"
    else:
        return
    raise UserError(f"{name}={v} {why}; give [factor >= 1, low_freq_factor > 0, high_freq_factor > low_freq_factor, "
                    "original_max_position_embeddings (an integer >= 1)], e.g. Llama 3.1's [8, 1, 4, 8192]")


# The keys whose allowed values a parser checks (raising the one-line UserError): the built-in families for the docs
# (a family registered later, a plug-in, is accepted too); rope_scaling's four numbers
FORMS = {
    "family": Form(f"{', '.join(FAMILIES)} (models/spec.py's registry)", lambda v, k: check_choice(k, v, FAMILIES)),
    "rope_scaling": Form("[factor >= 1, low_freq_factor > 0, high_freq_factor > low_freq_factor, "
                         "original_max_position_embeddings (an integer >= 1)]", _rope_scaling),
}
# the trainer's own keys, before and after the model's
FIRST = [("preset", str, setting("small", PRESETS, "the shapes (models/config.py); explicit model.* keys override "
                                 "them"))]


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """model.lora: low-rank adapters on a frozen base (models/lora.py; docs/lora.md)."""
    rank: int = setting(0, f">= 0 and <= {DIM.split('<= ')[1]}", "the adapters' rank; 0: no adapters (every weight "
                        "trained)")
    alpha: float = setting(16.0, f"> 0 and <= {FLOAT32}", "the adapters' output x alpha / rank (peft's lora_alpha)")
    dropout: float = setting(0.0, ">= 0 and < 1", "dropout of the adapters' input (peft's lora_dropout)")
    use_rslora: bool = setting(False, None, "scale alpha / sqrt(rank) (rank-stabilised LoRA)")
    targets: List[str] = setting(["q_proj", "v_proj"], None, "the projections adapted, by the family's Hugging Face "
                                 "module names (q_proj, down_proj, ...), or all-linear")
    modules: List[str] = setting([], None, "whole weights trained beside the adapters (peft's modules_to_save), by "
                                 "HF module name: embed_tokens, lm_head")
    init_from: Optional[str] = setting(None, None, "a peft adapter folder the adapters start from")
    base_dtype: str = setting("float32", ("float32", "bfloat16"), "the frozen base's storage (bfloat16: half its "
                              "bytes; the adapters and their state float32)")
    fused_gate_up: bool = setting(False, None, "the experts' gate_up adapter at twice the rank and alpha (peft's "
                                  "rank_pattern/alpha_pattern of .*\\.gate_up_proj: w1 and w3 adapters fused)")


LAST = [("init_from", Optional[str], setting(None, None, "parameters from `meshtrain export`, a run, or a Hugging "
                                             "Face model folder")),
        ("lora", LoraSection, dataclasses.field(default_factory=LoraSection))]


def _config_type(hint):
    """The config's type of a model field's type: its None dropped, a tuple as a list (YAML has no tuples)."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    t = next(a for a in typing.get_args(hint) if a is not type(None)) if union else hint
    return List[typing.get_args(t)[0]] if typing.get_origin(t) is tuple else t


def model_fields() -> list[tuple[dataclasses.Field, object]]:
    """(field, type) of every model.* key: ModelConfig's, then each registered family's own (once each)."""
    out, seen = [], set()
    for cls in [ModelConfig] + [config_class(name) for name in FAMILIES]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if is_key(f) and f.name not in seen:
                seen.add(f.name)
                out.append((f, hints[f.name]))
    return out


def _section_field(f: dataclasses.Field, hint) -> tuple:
    t, allowed, doc = _config_type(hint), FORMS.get(f.name, f.metadata["allowed"]), f.metadata["doc"]
    if f.metadata["null"]:
        return f.name, Optional[t], setting(None, allowed, doc)
    return f.name, t, setting(f.default, allowed, doc)


ModelSection = dataclasses.make_dataclass(
    "ModelSection", FIRST + [_section_field(f, hint) for f, hint in model_fields()] + LAST, frozen=True,
    namespace={"__doc__": "The model: section; null keys take the preset's (or family's) value."})
ModelSection.__module__ = __name__
