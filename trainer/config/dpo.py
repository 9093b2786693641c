"""What the config says of train.objective=dpo's own keys beside the others (the objective itself: models/objectives/dpo.py)."""
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

