"""What the config says of train.objective=dpo's own keys beside the others (the objective itself: models/objectives/dpo.py),
and of model.lora's (models/lora.py)."""
from __future__ import annotations

import dataclasses


def ignored_dpo(cfg) -> str | None:
    """The warning for dpo.* keys set away from their defaults while train.objective reads none of them; None where
    there is none."""
    d, default = cfg.dpo, type(cfg.dpo)()
    given = [f"dpo.{f.name}={getattr(d, f.name)}" for f in dataclasses.fields(d)
             if getattr(d, f.name) != getattr(default, f.name)]
    if cfg.train.objective == "dpo" or not given:
        return None
    return (f"{', '.join(given)} ignored: train.objective={cfg.train.objective} reads no dpo.* key; set "
            "train.objective=dpo to tune on preference pairs, or drop them")


def lora_of(section):
    """models/lora.py's Lora of the model.lora section, None where its rank is 0 (no adapters)."""
    from models.lora import Lora
    if not section.rank:
        return None
    return Lora(int(section.rank), float(section.alpha), float(section.dropout), bool(section.use_rslora),
                tuple(section.targets), tuple(section.modules), section.base_dtype)


def lora_checks(mc, t, section) -> list:
    """(ok, message) of model.lora against the model and the train keys."""
    lora = mc.lora
    if lora is None:
        return [(not section.init_from, f"model.lora.init_from={section.init_from} with model.lora.rank=0 (no "
                 "adapters); set model.lora.rank to the adapter's r")]
    from models.lora import expert_targets, saved_modules, targets
    from models.spec import family
    spec = family(mc.family)
    if spec.hf is None:
        return [(False, f"model.lora on model.family={mc.family} is not supported: its projections are named by "
                 "a Hugging Face adapter, which this family has not")]
    try:
        chosen = targets(mc, spec.hf.leaves(mc))
        saved_modules(mc, spec.hf.leaves(mc))
        expert_targets(mc)
    except ValueError as e:
        return [(False, str(e))]
    small = min([min(leaf.hf_shape) for _, leaf in chosen.values()] or [mc.d_model])
    return [(lora.rank <= small, f"model.lora.rank={lora.rank} exceeds the smallest adapted projection's width "
             f"{small}; use a rank of at most {small}"),
            (lora.dropout == 0, f"model.lora.dropout={lora.dropout} is not supported yet; set 0"),
            (not mc.mtp_depth, f"model.lora with model.mtp_depth={mc.mtp_depth} is not supported; set "
             "model.mtp_depth=0"),
            (t.sync == "every_step", f"model.lora with train.sync={t.sync} is not supported; use "
             "train.sync=every_step")]
