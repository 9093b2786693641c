"""The batch sampler (models/sampler.py): prompts of different lengths drawn together equal each drawn alone
(greedy: models/decode.py `generate`), the drawn tokens' log-probabilities are the learner's (GRPO's `token_logps`
of the same rows, the sampler/learner mismatch), top-p and top-k cut what they should, the same key draws the same
tokens, and a row stops at its end token."""
from pathlib import Path

import jax
import numpy as np
import pytest

FIX = Path(__file__).parent / "fixtures" / "grpo" / "policy"
PROMPTS = [[5, 17, 300, 42], [7], [900, 1, 2, 3, 4, 5, 6], [64, 64]]


@pytest.fixture(scope="module")
def loaded():
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    cfg = resolve(load_config([f"model.init_from={FIX}", "model.seq_len=64", "mesh.data=1", "train.batch_size=4"]))
    s = make_setup(cfg, jax.devices()[:1])
    return s, init_params(s, cfg.model.init_from)


@pytest.mark.slow  # GRPO's default share: its loss parity and one learning step (issue's wording)
def test_prompts_of_different_lengths_drawn_together_are_each_alone(loaded):
    from models.decode import generate
    from models.sampler import sample_completions
    s, params = loaded
    got = sample_completions(s.model, params, PROMPTS, 10, jax.random.key(0), top_k=1)
    for i, p in enumerate(PROMPTS):
        alone = np.concatenate(list(generate(s.model, params, np.array([p]), 10, temperature=0.0)))
        np.testing.assert_array_equal(got["tokens"][i], alone, err_msg=f"prompt {i}")
    tiny_p = sample_completions(s.model, params, PROMPTS, 10, jax.random.key(1), top_p=1e-6, temperature=0.7)
    np.testing.assert_array_equal(tiny_p["tokens"], got["tokens"])  # top-p that keeps one token: the greedy one


@pytest.mark.slow  # GRPO's default share: its loss parity and one learning step (issue's wording)
def test_the_drawn_log_probabilities_are_the_learner_s(loaded):
    """Sampled at temperature 0.7 with top-p 0.9: each drawn token's log-probability at the temperature equals the
    learner's of the same row (GRPO's token_logps over prompt + completion from position 0), within 1e-5."""
    from models.objectives.grpo import token_logps
    from models.objectives.objective import hidden
    from models.sampler import sample_completions
    from trainer.data.completions import gather_targets, rows
    import dataclasses
    from models.objectives.grpo import Grpo
    s, params = loaded
    c = dataclasses.replace(s.model, grpo=Grpo(temperature=0.7))
    got = sample_completions(c, params, PROMPTS, 12, jax.random.key(3), temperature=0.7, top_p=0.9)
    again = sample_completions(c, params, PROMPTS, 12, jax.random.key(3), temperature=0.7, top_p=0.9)
    np.testing.assert_array_equal(got["tokens"], again["tokens"])  # the same key, the same draws
    mask = (np.arange(12)[None, :] < got["lengths"][:, None]).astype(np.float32)
    zeros = np.zeros_like(mask)
    batch = rows(PROMPTS, got["tokens"], {k: zeros for k in ("loss_weight", "metric_weight", "old_logp", "ref_logp",
                                                           "advantage", "completion")}, c.seq_len)
    fn = jax.jit(lambda p, t, y: token_logps(c, p, hidden(c, p, {"tokens": t})[0], y, lambda x, _: x)[0])
    learner = gather_targets(np.asarray(fn(params, batch["tokens"], batch["targets"])), PROMPTS, 12)
    gap = float(np.abs((learner - got["logps"]) * mask).max())
    print(f"sampler vs learner log-probabilities, float32: largest difference {gap:.2e}")
    assert gap < 1e-5


@pytest.mark.slow  # GRPO's default share: its loss parity and one learning step (issue's wording)
def test_a_row_stops_at_its_end_token(loaded):
    from models.sampler import sample_completions
    s, params = loaded
    free = sample_completions(s.model, params, PROMPTS, 8, jax.random.key(0), top_k=1)
    end = int(free["tokens"][0, 2])  # the greedy third token of the first prompt, as an end token
    got = sample_completions(s.model, params, PROMPTS, 8, jax.random.key(0), top_k=1, end_ids={end}, pad=1027)
    assert got["ended"][0] and got["lengths"][0] <= 3
    n = got["lengths"][0]
    np.testing.assert_array_equal(got["tokens"][0, :n], free["tokens"][0, :n])
    assert (got["tokens"][0, n:] == 1027).all() and (got["logps"][0, n:] == 0).all()
    for i in range(len(PROMPTS)):  # a row that never drew it runs to max_new
        if not got["ended"][i]:
            assert got["lengths"][i] == 8


def test_a_prompt_longer_than_the_context_is_refused(loaded):
    from models.sampler import sample_completions
    s, params = loaded
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        sample_completions(s.model, params, [[1] * 60], 8, jax.random.key(0))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["train.sequence_parallel=true"]], ids=["plain", "sequence-parallel"])
def test_another_layout_draws_the_same_where_the_margins_allow(loaded, extra):
    """The same prompts, key and parameters sampled on one device and with the parameters on (2,1,4) ZeRO-3 (and with
    sequence parallelism, which decoding does not take: its constraints name `seq`): each row draws the same tokens
    up to its first draw whose margin (the winner's perturbed logit over the runner-up's) is below 1e-4, where
    layouts may round differently; the first divergence is reported."""
    from models.sampler import sample_completions
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    s, params = loaded
    cfg = resolve(load_config([f"model.init_from={FIX}", "model.seq_len=64", "mesh.data=2", "mesh.stage=1",
                               "mesh.model=4", "train.zero_stage=3", "train.batch_size=8", *extra]))
    s8 = make_setup(cfg, jax.devices()[:8])
    prompts = PROMPTS * 4
    from meshes import DATA
    from trainer.rl.rollout import placement
    one = sample_completions(s.model, params, prompts, 12, jax.random.key(5), temperature=1.0)
    p8 = init_params(s8, cfg.model.init_from)
    where = placement(s8.model, p8, len(prompts))  # as a run samples: each data rank its rows and their cache
    assert where[0].spec[0] in (DATA, (DATA,)) and where[1].spec[1] in (DATA, (DATA,)), where
    with jax.set_mesh(s8.mesh):
        eight = sample_completions(s8.model, p8, prompts, 12, jax.random.key(5), temperature=1.0, placement=where)
    same = 0
    for i in range(len(prompts)):
        differ = np.flatnonzero(one["tokens"][i] != eight["tokens"][i])
        low = np.flatnonzero(one["margins"][i] < 1e-4)
        if differ.size:
            print(f"row {i}: first divergence at token {differ[0]}, first margin below 1e-4 at "
                  f"{low[0] if low.size else None}")
            assert low.size and low[0] <= differ[0], (i, differ[0], one["margins"][i])
        else:
            same += 1
    assert same >= len(prompts) // 2
    print(f"{same} of {len(prompts)} rows drew the same tokens on both layouts; smallest margin "
          f"{float(one['margins'].min()):.2e}")
    import dataclasses
    from models.objectives.grpo import Grpo
    from trainer.data.completions import gather_targets, rows
    from trainer.rl.rollout import logps
    c8 = dataclasses.replace(s8.model, grpo=Grpo(temperature=1.0))
    mask = (np.arange(12)[None, :] < eight["lengths"][:, None]).astype(np.float32)
    batch = rows(prompts, eight["tokens"], {k: np.zeros_like(mask) for k in ("loss_weight", "metric_weight",
                                                                             "old_logp", "ref_logp", "advantage",
                                                                             "completion")}, c8.seq_len)
    with jax.set_mesh(s8.mesh):
        learner = gather_targets(logps(c8, init_params(s8, cfg.model.init_from), batch), prompts, 12)
    gap = float(np.abs((learner - eight["logps"]) * mask).max())
    print(f"(2,1,4) ZeRO-3: sampler vs learner log-probabilities, float32: largest difference {gap:.2e}")
    assert gap < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family", [["model.family=gemma2"], ["model.family=mistral", "model.window=4"]])
def test_left_padded_rows_on_soft_capped_and_windowed_models_are_the_learner_s(family):
    """Gemma 2 (a scale and soft-caps: the written-out attention) and Mistral with a window shorter than the rows: the
    left-padded rows' drawn log-probabilities are finite and the learner's (1e-5); the padding never attends to
    nothing, the window applies."""
    import dataclasses
    from models.objectives.grpo import Grpo
    from models.sampler import sample_completions
    from trainer import load_config
    from trainer.data.completions import gather_targets, rows
    from trainer.rl.rollout import logps
    from trainer.state import init_state, make_setup
    cfg = load_config(["model.preset=tiny", "model.seq_len=32", "mesh.data=1", "train.batch_size=4", *family])
    s = make_setup(cfg, jax.devices()[:1])
    c, params = dataclasses.replace(s.model, grpo=Grpo(temperature=1.0)), init_state(s)["params"]
    prompts = [[5, 17, 30, 42, 7, 8, 9, 10], [7], [90, 1, 2], [64, 64]]
    got = sample_completions(c, params, prompts, 10, jax.random.key(2))
    mask = (np.arange(10)[None, :] < got["lengths"][:, None]).astype(np.float32)
    assert np.isfinite(got["logps"]).all()
    batch = rows(prompts, got["tokens"], {k: np.zeros_like(mask) for k in ("loss_weight", "metric_weight", "old_logp",
                                                                           "ref_logp", "advantage", "completion")},
                 c.seq_len)
    learner = gather_targets(logps(c, params, batch), prompts, 10)
    assert float(np.abs((learner - got["logps"]) * mask).max()) < 1e-5
