"""What the config says of model.lora's keys (the adapters themselves: models/lora.py): the model's Lora of them and
their checks against the model and the train keys."""
from __future__ import annotations


def lora_of(section):
    """models/lora.py's Lora of the model.lora section, None where its rank is 0 (no adapters)."""
    from models.lora import Lora
    if not section.rank:
        return None
    return Lora(int(section.rank), float(section.alpha), float(section.dropout), bool(section.use_rslora),
                tuple(section.targets), tuple(section.modules), section.base_dtype, bool(section.fused_gate_up))


def lora_checks(mc, t, model) -> list:
    """(ok, message) of model.lora against the model (the model section) and the train keys."""
    lora, section = mc.lora, model.lora
    if lora is None:
        return [(not section.init_from, f"model.lora.init_from={section.init_from} with model.lora.rank=0 (no "
                 "adapters); set model.lora.rank to the adapter's r")]
    import os
    from trainer.config.paths import is_url
    base = model.init_from
    if base and not is_url(base) and not os.path.exists(base):  # before the shapes it decides
        return [(False, f"model.init_from={base} does not exist (moved or deleted?): model.lora adapts the base read "
                 "from it; give the folder of the base model")]
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
            (not lora.fused_gate_up or "mlp.experts.gate_up_proj" in lora.targets, "model.lora.fused_gate_up=true "
             "without mlp.experts.gate_up_proj in model.lora.targets; add it, or set model.lora.fused_gate_up=false"),
            (not mc.mtp_depth, f"model.lora with model.mtp_depth={mc.mtp_depth} is not supported; set "
             "model.mtp_depth=0"),
            (t.sync == "every_step", f"model.lora with train.sync={t.sync} is not supported; use "
             "train.sync=every_step")]
