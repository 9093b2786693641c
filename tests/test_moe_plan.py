"""The planner on MoE models against XLA on CPU: the expert weights' state (parameters, gradients, optimizer) and
the collectives per step, at (8,1,1) ZeRO-1 (the compiler's path) and (2,1,4) ZeRO-3 (the explicit one)."""
import pytest

from test_plan import _plan
from trainer.plan.report import by_axis
from trainer.plan.verify import measure

MOE = ["model.family=mixtral", "model.n_experts=4", "model.n_experts_per_token=2", "model.expert_d_ff=128"]
LAYOUTS = {"d8-z1": ["mesh.data=8", "train.zero_stage=1"],
           "d2m4-z3": ["mesh.data=2", "mesh.model=4", "train.zero_stage=3", "model.remat=full"]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_state_and_collectives_against_xla(name):
    """State within 1% of XLA's memory analysis (the experts' weights are most of it), collectives within 7% of the
    HLO's: the expert MLP runs manual over every axis, each data rank sorting its own tokens (a sort over the whole
    batch gathered it: XLA sent 4.9x the planner's bytes at (8,1,1)) and its slice of the hidden units adding the
    down projection's partial sums over `model` once, as the dense MLP does."""
    cfg, plan = _plan(MOE + LAYOUTS[name])
    m = measure(cfg)
    assert abs(plan.state_bytes / (m.params_opt_bytes + m.grads_bytes) - 1) < 0.01, (plan.state_bytes, m)
    assert abs(plan.comm_bytes / m.comm_bytes - 1) < 0.07, (plan.comm_bytes, m.comm_bytes)
    for axis, (mine, xla) in by_axis(plan, m).items():
        assert abs(mine - xla) <= 0.10 * m.comm_bytes, (axis, mine, xla)
