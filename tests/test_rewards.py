"""GRPO's reward functions (trainer/rl/rewards.py): the built-ins on worked cases, the user's own by import path
called as TRL calls them (prompts, completions, completion_ids and the record's fields), None kept as NaN, and each
way a function can fail stopping in one line naming it."""
import sys

import numpy as np
import pytest

from trainer.errors import UserError
from trainer.rl import rewards

FIELDS = {"answer": ["42", "42", "x", "3.5"], "other": [1, 2, 3, 4]}
COMPLETIONS = ["The answer is 42", " 42 ", "no number", "so 7/2 = 3.50"]


def test_the_built_ins_on_worked_cases():
    fns = [rewards.load(e) for e in ("exact_match:answer", r"regex:^\s*\d+\s*$", "numeric:answer")]
    got = rewards.score(fns, ["p"] * 4, COMPLETIONS, [[1]] * 4, FIELDS)
    want = np.array([[0, 1, 0, 0], [0, 1, 0, 0], [1, 1, np.nan, 1]], np.float32).T  # "x" is no number: None
    np.testing.assert_array_equal(got, want)
    m = rewards.metrics([n for n, _ in fns], got)
    assert m["rewards/numeric/mean"] == 1.0 and np.isclose(m["rewards/exact_match/std"], 0.5)


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, completion_ids, **fields):\n"
        "    return [len(c) + len(i) + f for c, i, f in zip(completions, completion_ids, fields['other'])]\n"
        "def boom(completions, **kw):\n    raise ValueError('no judge')\n"
        "def short(completions, **kw):\n    return [1.0]\n"
        "def text(completions, **kw):\n    return ['a'] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_rewards", None)


def test_the_user_s_function_gets_what_trl_gives(module):
    name, fn = rewards.load("my_rewards:length")
    assert name == "length"
    got = rewards.score([(name, fn)], ["p"] * 4, COMPLETIONS, [[1, 2]] * 4, FIELDS)
    np.testing.assert_array_equal(got[:, 0], [len(c) + 2 + f for c, f in zip(COMPLETIONS, FIELDS["other"])])


@pytest.mark.parametrize("entry,message", [
    ("nowhere_module:f", r"^grpo.rewards entry 'nowhere_module:f': module 'nowhere_module' could not be imported"),
    ("my_rewards:missing", r"^grpo.rewards entry 'my_rewards:missing': module 'my_rewards' has no function 'missing'$"),
    ("exact_match", r"^grpo.rewards entry 'exact_match' needs its argument: exact_match:FIELD$"),
    ("my_rewards:boom", r"^reward function 'boom' raised ValueError: no judge; fix it or drop it from grpo.rewards$"),
    ("my_rewards:short", r"^reward function 'short' returned 1 values for 4 completions; return one float"),
    ("my_rewards:text", r"^reward function 'text' returned 'a' for completion 0; return a float or None$"),
])
def test_a_failing_reward_function_is_one_line(module, entry, message):
    with pytest.raises(UserError, match=message) as e:
        rewards.score([rewards.load(entry)], ["p"] * 4, COMPLETIONS, [[1]] * 4, FIELDS)
    assert "\n" not in str(e.value)


def test_weights_for_another_count_of_functions_are_one_line():
    from trainer.config import load_config, validate
    with pytest.raises(UserError, match=r"^grpo.reward_weights has 1 weights for 2 grpo.rewards") as e:
        validate(load_config(["model.preset=tiny", "train.objective=grpo", "train.batch_size=16",
                              "grpo.rewards=[exact_match:a,numeric:a]", "grpo.reward_weights=[1.0]"]), 8)
    assert "\n" not in str(e.value)
