"""GRPO learns (trainer/rl/rollout.py generations learnt by the train step): the tiny model, first trained on the
built-in corpus (bytes), is rewarded for the spaces in its completions of short Python prompts; the mean reward of
its last 10 generations exceeds its first 10's by more than 3 standard errors (-m slow)."""
import numpy as np
import pytest

import jax

from conftest import run_steps

PROMPTS = [b"def ", b"import ", b"class ", b"return ", b"for i in ", b"if x ", b"print(", b"    "]


def spaces(completions, **kw):
    return [c.count(" ") / max(len(c), 1) for c in completions]


@pytest.mark.slow
def test_the_tiny_model_learns_to_write_more_spaces():
    from trainer import load_config
    from trainer.rl import rollout
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    base = ["model.preset=tiny", "mesh.data=1", "train.warmup_steps=5", "model.seq_len=64"]
    pre = run_steps(base + ["train.batch_size=16", "train.lr=3e-3"], n_devices=1, steps=150)
    cfg = load_config(base + ["train.objective=grpo", "train.batch_size=32", "grpo.num_generations=4",
                              "grpo.max_completion_length=16", "train.lr=2e-3", "train.warmup_steps=0",
                              "train.grad_clip=1.0", "train.weight_decay=0", "grpo.temperature=1.0"])
    s = make_setup(cfg, jax.devices()[:1])
    state = {**pre.state, "step": jax.numpy.zeros((), jax.numpy.int32)}
    st = rollout.Settings(G=4, max_new=16, decode=lambda ids: bytes(ids).decode("utf-8", "replace"))
    step, key, means = jit_train_step(s), jax.random.key(0), []
    rng = np.random.default_rng(0)
    for gen in range(60):
        records = [{"prompt_ids": list(PROMPTS[i])} for i in rng.choice(len(PROMPTS), 8)]
        batch, m = rollout.generation(s.model, state["params"], records, [("spaces", spaces)], [1.0], st,
                                      jax.random.fold_in(key, gen))
        means.append(m["reward"])
        with jax.set_mesh(s.mesh):
            state, _ = step(state, jax.device_put(batch, s.batch_sharding()))
    first, last = np.array(means[:10]), np.array(means[-10:])
    se = np.sqrt(first.var(ddof=1) / 10 + last.var(ddof=1) / 10)
    print(f"mean reward: first 10 generations {first.mean():.4f}, last 10 {last.mean():.4f}, standard error {se:.4f}")
    assert last.mean() - first.mean() > 3 * se
