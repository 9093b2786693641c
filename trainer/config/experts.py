"""Which mesh axis an MoE's experts split over (expert parallelism): `expert` where mesh.expert > 1, else `data` by
train.expert_parallel, or none (docs/parallelism.md)."""
from __future__ import annotations

from meshes import DATA, EXPERT
from models import family
from models.spec import sparse
from trainer.errors import UserError


def axis_of(t, mc, data: int, expert: int, warn=None) -> str | None:
    """The mesh axis the experts of model `mc` split over under the train section `t` on `data` data and `expert`
    expert ranks, or None (replicated): `expert` where mesh.expert > 1 (the batch split over data x expert); else
    `data` by train.expert_parallel (null: wherever it can, with warn(line) where an MoE cannot, unless warn is
    None). A one-line UserError where it is asked for and cannot be."""
    ranks, axis = (expert, EXPERT) if expert > 1 else (data, DATA)
    why = family(mc.family).experts_over(mc, ranks, axis)
    if why is None and t.sync != "every_step":
        why = (f"train.sync={t.sync} keeps a whole replica on every data rank, and an expert-parallel rank holds only "
               f"its experts")
    if expert > 1:
        if why is not None:
            raise UserError(f"mesh.expert={expert}: {why}; set mesh.expert to a divisor of model.n_experts, or 1")
        if t.expert_parallel is False:
            raise UserError(f"train.expert_parallel=false with mesh.expert={expert}, which splits the experts; set "
                            "mesh.expert=1 to keep them replicated")
        return EXPERT
    if t.expert_parallel is None:
        if why is not None and warn is not None and data > 1 and sparse(mc):
            warn(f"expert parallelism off: {why}; the experts are replicated over mesh.data")
        return DATA if why is None and data > 1 else None
    if t.expert_parallel and why is not None:
        raise UserError(f"train.expert_parallel=true: {why}; set train.expert_parallel=false (experts replicated)")
    return DATA if t.expert_parallel and data > 1 else None
