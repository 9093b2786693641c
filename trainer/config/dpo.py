"""What the config says of the preference and reward objectives' own keys beside the others: train.objective=dpo's
(models/objectives/dpo.py) and grpo's (models/objectives/grpo.py)."""
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


def objectives_of(cfg) -> dict:
    """ModelConfig's dpo and grpo fields of the config (None where train.objective is another)."""
    from models.objectives.dpo import Dpo
    from models.objectives.grpo import Grpo
    d, g, t = cfg.dpo, cfg.grpo, cfg.train
    pref = Dpo(d.loss, float(d.beta), float(d.label_smoothing), float(d.sft_weight), d.reference_mode == "online") \
        if t.objective == "dpo" else None
    rl = Grpo(g.loss_type, float(g.beta), float(g.epsilon), float(g.epsilon if g.epsilon_high is None else
                                                                   g.epsilon_high),
              float(g.temperature), int(g.max_completion_length)) if t.objective == "grpo" else None
    return {"dpo": pref, "grpo": rl}


def objective_checks(cfg, mc, context: int) -> list:
    """(ok, message) of train.objective=dpo and grpo against the other keys."""
    from models.spec import family
    t, g = cfg.train, cfg.grpo
    return [
        (not mc.mtp_depth or t.objective != "dpo",
         f"model.mtp_depth={mc.mtp_depth} with train.objective=dpo is not supported: the modules add token losses; "
         "set model.mtp_depth=0 or train.objective=lm"),
        (t.objective != "dpo" or bool(cfg.dpo.reference or cfg.model.init_from),
         "train.objective=dpo needs a reference model: set dpo.reference (an export, a run or a Hugging Face folder) "
         "or model.init_from (the reference is then the model training starts from)"),
        (t.objective != "dpo" or t.sync == "every_step",
         f"train.objective=dpo with train.sync={t.sync} is not supported: local SGD keeps a replica of the weights per "
         "data rank, which neither the DPO reference's forward nor the pair evaluation reads; use "
         "train.sync=every_step"),
        (t.objective != "dpo" or context == 1,
         f"train.objective=dpo sums each pair's log-probabilities along its row, and mesh.context={context} "
         "splits the rows over context ranks (not supported with DPO yet); set mesh.context=1"),
        (t.objective != "grpo" or t.batch_size % g.num_generations == 0,
         f"train.batch_size={t.batch_size} (completions per step) is not a multiple of grpo.num_generations="
         f"{g.num_generations}; use a multiple of it"),
        (t.objective != "grpo" or not g.beta or bool(g.reference or cfg.model.init_from),
         f"grpo.beta={g.beta} needs a reference model: set grpo.reference (an export, a run or a Hugging Face folder) "
         "or model.init_from (the reference is then the model training starts from), or grpo.beta=0"),
        (t.objective != "grpo" or not g.reward_weights or len(g.reward_weights) == len(g.rewards),
         f"grpo.reward_weights has {len(g.reward_weights)} weights for {len(g.rewards)} grpo.rewards; give one per "
         "reward function, or none (1 each)"),
        (t.objective != "grpo" or family(mc.family).decode_cache is None,
         f"train.objective=grpo with model.family={mc.family} is not supported: sampling prompts of different lengths "
         "together is not built for its own decoding cache (latent attention)"),
        (t.objective != "grpo" or not mc.seq_len or g.max_completion_length < mc.seq_len,
         f"grpo.max_completion_length={g.max_completion_length} leaves no room for a prompt in the model's context of "
         f"{mc.seq_len} tokens (model.seq_len); lower it or raise model.seq_len"),
        (t.objective != "grpo" or (not mc.mtp_depth and t.sync == "every_step"),
         f"train.objective=grpo with model.mtp_depth={mc.mtp_depth}, train.sync={t.sync} is not supported; set "
         "model.mtp_depth=0 and train.sync=every_step"),
    ]
