"""Every accepted pair of the products objective x sync, family x mesh.model and context x objective: the programs its
run compiles (the train step, the eval step and, under DPO, the reference's forward) lowered on 8 devices (jax's
.lower(), not compiled: a shape or sharding the layout cannot hold fails here, in about a second per run); every
refused pair refused by validation with one line. The pairs are the tables below; a run lowers one pair of each
product at once (`CASES`), and a test checks that the runs cover every pair."""
import re

import jax
import pytest

from trainer.errors import UserError

# tiny runs: one layer, 16 tokens, 8 rows; SGD and the plain kernels (those GPU and TPU runs compile; the layout is
# what a lowering checks), which trace in about a fifth less time than AdamW and the CPU fast paths; dpo.reference is
# read by a run, never by lowering
BASE = ["model.preset=tiny", "model.n_layers=1", "model.seq_len=16", "train.batch_size=8", "mesh.data=-1",
        "train.optimizer=sgd", "model.kernels=reference", "dpo.reference=/nowhere"]
# the widths each family is given: an MoE splits each expert's (and the shared expert's) width over `model`, never
# d_ff; widths that 8 does not divide make the refused pairs
WIDTHS = {"mixtral": ["model.d_ff=100", "model.expert_d_ff=40"],  # d_ff unused: 8 accepted
          "qwen3_moe": ["model.expert_d_ff=20"],
          "qwen2_moe": ["model.expert_d_ff=32", "model.shared_expert_d_ff=12"],
          "qwen2": ["model.d_ff=36"]}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "qwen2_moe")
MODEL = (1, 2, 4, 8)


def _refused(text: str) -> str:
    return "^" + re.escape(text)


# None: accepted (its programs lower); else the start of the one line that refuses it
OBJECTIVE_SYNC = {("lm", "every_step"): None, ("lm", "local_sgd"): None, ("lm", "diloco"): None,
                  ("dpo", "every_step"): None,
                  ("dpo", "local_sgd"): _refused("train.objective=dpo with train.sync=local_sgd is not supported"),
                  ("dpo", "diloco"): _refused("train.objective=dpo with train.sync=diloco is not supported")}
FAMILY_MODEL = {(f, m): None for f in FAMILIES for m in MODEL} | {
    ("qwen3_moe", 8): _refused("model.expert_d_ff=20 is not divisible by mesh.model=8"),
    ("qwen2_moe", 8): _refused("model.shared_expert_d_ff=12 is not divisible by mesh.model=8"),
    ("qwen2", 8): _refused("model.d_ff=36 is not divisible by mesh.model=8")}
CONTEXT_OBJECTIVE = {(c, "lm"): None for c in (1, 2, 4, 8)} | {(1, "dpo"): None} | {
    (c, "dpo"): _refused(f"train.objective=dpo sums each pair's log-probabilities along its row, and mesh.context={c}")
    for c in (2, 4, 8)}
# the accepted pairs of objective x sync and context x objective, each carried by one family x mesh.model run
RIDES = {("llama", 2): dict(sync="local_sgd"), ("qwen2", 1): dict(sync="diloco"),
         ("gemma3", 2): dict(objective="dpo"), ("mixtral", 2): dict(objective="dpo"),
         ("mistral", 4): dict(context=2), ("qwen3", 2): dict(context=4), ("llama", 1): dict(context=8)}


def _case(family="llama", model=1, objective="lm", sync="every_step", context=1) -> dict:
    return dict(family=family, model=model, objective=objective, sync=sync, context=context)


# every run: each family x mesh.model pair (with what rides on it), and each refused pair of the other products
CASES = [_case(f, m, **RIDES.get((f, m), {})) for f, m in FAMILY_MODEL] + \
    [_case(objective=o, sync=s) for (o, s), refusal in OBJECTIVE_SYNC.items() if refusal] + \
    [_case(objective=o, context=c) for (c, o), refusal in CONTEXT_OBJECTIVE.items() if refusal]


def _pairs(case: dict) -> list:
    return [(OBJECTIVE_SYNC, (case["objective"], case["sync"])), (FAMILY_MODEL, (case["family"], case["model"])),
            (CONTEXT_OBJECTIVE, (case["context"], case["objective"]))]


def _args(case: dict) -> list:
    return BASE + WIDTHS.get(case["family"], []) + [
        f"model.family={case['family']}", f"mesh.model={case['model']}", f"mesh.context={case['context']}",
        f"train.objective={case['objective']}", f"train.sync={case['sync']}"]


def test_the_runs_cover_every_pair():
    """Each pair of each product is in a run; a run holds at most one refused pair (so that it names that one)."""
    for table in (OBJECTIVE_SYNC, FAMILY_MODEL, CONTEXT_OBJECTIVE):
        covered = {pair for case in CASES for t, pair in _pairs(case) if t is table}
        assert covered == set(table), set(table) - covered
    for case in CASES:
        assert sum(t[pair] is not None for t, pair in _pairs(case)) <= 1, case


def _lower_all(s) -> list[str]:
    """Lower the programs a run of setup `s` compiles; their names."""
    from trainer.plan.verify import abstract_inputs
    from trainer.step import jit_eval_step, jit_train_step
    state, batch = abstract_inputs(s)
    with jax.set_mesh(s.mesh):
        jit_train_step(s).lower(state, batch)
        jit_eval_step(s).lower(state["params"], batch)
        if s.model.dpo is None:
            return ["train", "eval"]
        from trainer.run.reference import logp_fn
        logp_fn(s).lower(state["params"], {k: v for k, v in batch.items() if k != "ref_logp"})
    return ["train", "eval", "reference"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_lowers_or_is_refused_in_one_line(case):
    from trainer.config import load_config
    from trainer.state import make_setup
    refusal = next((t[pair] for t, pair in _pairs(case) if t[pair] is not None), None)
    cfg = load_config(_args(case))
    if refusal is None:
        s = make_setup(cfg, jax.devices())
        assert _lower_all(s) == ["train", "eval"] + ["reference"] * (case["objective"] == "dpo")
        return
    with pytest.raises(UserError, match=refusal) as e:
        make_setup(cfg, jax.devices())
    assert "\n" not in str(e.value)
