"""The loss is one mean over the step's counted tokens on every layout (models/batch.py).

A fixed loss_weight pattern counts very different numbers of tokens per row, with rows 0, 2, 4, 6
not counted at all: every layout below then has microbatches or devices with few counted tokens
and some with none, so that a mean of per-microbatch (or per-device) means is not the global mean
(checked per layout, by hand, from the reference's own per-token losses). Each layout must equal
one device with one microbatch in loss, grad_norm and parameters (SGD without clipping, 1e-5).
The logits are scaled up first (the final norm's gain) so that per-token losses spread widely (at init they are all
near ln V, and any average of them would agree).
"""
import functools

import jax
import numpy as np
import optax
import pytest

from conftest import SGD, TINY, corpus, fresh_state, max_rel
from models import forward

SLOW = pytest.mark.slow
STEPS = 2
BASE = SGD + ["train.lr=0.1", "train.b1=0", "train.weight_decay=0"]
L4 = ["model.n_layers=4"]  # the pipelines' layers: 2 stages x 2 repeats
# name: (mesh (data, stage, model), overrides, marks); one representative per family in the default run
LAYOUTS = {
    "zero1-auto": ((8, 1, 1), ["train.zero_stage=1"], ()),  # the compiler's all-reduce
    "zero3-tp-ring-accumulate": ((2, 1, 4), ["train.zero_stage=3", "train.grad_sync=ring",
                                             "train.microbatches=2"], ()),
    "accumulate-compiler": ((1, 1, 1), ["train.microbatches=4"], ()),
    "interleaved-1f1b": ((2, 2, 2), L4 + ["train.pipeline_schedule=interleaved_1f1b", "train.pipeline_repeats=2",
                                          "train.microbatches=4"], ()),
    "zero0": ((8, 1, 1), ["train.zero_stage=0"], SLOW),
    "zero2": ((8, 1, 1), ["train.zero_stage=2"], SLOW),
    "zero3": ((8, 1, 1), ["train.zero_stage=3"], SLOW),
    "tensor": ((2, 1, 4), ["train.zero_stage=0"], SLOW),
    "psum": ((8, 1, 1), ["train.grad_sync=psum"], SLOW),
    "ring": ((8, 1, 1), ["train.grad_sync=ring", "train.zero_stage=2"], SLOW),
    "accumulate-explicit": ((8, 1, 1), ["train.grad_sync=psum", "train.microbatches=2"], SLOW),
    "accumulate-auto-zero1": ((2, 1, 4), ["train.zero_stage=1", "train.microbatches=4"], SLOW),
    "gpipe": ((1, 2, 4), L4 + ["train.pipeline_schedule=gpipe", "train.microbatches=4"], SLOW),
    "1f1b": ((2, 2, 2), L4 + ["train.pipeline_schedule=1f1b", "train.microbatches=4", "train.zero_stage=3"], SLOW),
    "1f1b-4-stages": ((2, 4, 1), L4 + ["train.pipeline_schedule=1f1b", "train.microbatches=4"], SLOW),
}
MODEL_KEYS = ("model.",)  # what the 1-device reference keeps of a layout's overrides


def uneven_weights(B: int, T: int) -> np.ndarray:
    """The fixed test pattern: row r counts a random fraction of its targets; rows 0, 2, 4, 6 none,
    rows 3, 7, 11, 15 (one microbatch of four) few."""
    rng = np.random.default_rng(20261202)
    density = rng.uniform(0.05, 1.0, B)
    density[[0, 2, 4, 6]], density[[3, 7, 11, 15]] = 0, 0.04
    return (rng.random((B, T)) < density[:, None]).astype(np.float32)


def _groups(B: int, data: int, micro: int) -> np.ndarray:
    """Which (microbatch, data shard) each row lands in: microbatch j takes rows j, j+M, ...
    (trainer/parallel/microbatch.py), each microbatch's rows split over `data` in order."""
    r = np.arange(B)
    j, i = r % micro, r // micro
    return j * data + i // (B // micro // data)


def _batch(s, step: int, weights=None):
    from trainer.data.batches import Batches
    rows = Batches(corpus(), s.cfg.train.seed, s.cfg.train.batch_size, s.model.seq_len,
                   s.model.vocab_size).global_train(step)
    if weights is not None:
        rows["loss_weight"] = weights
    return rows


def _scaled(params):
    """Params with the final norm's gain x 10 (the logits x 10): per-token losses from near 0 to
    well above ln V (8.8 +- 5.2 nats on the first batch)."""
    return {**params, "final_norm": params["final_norm"] * 10}


class Trained:
    """STEPS steps with the uneven weights, then one step with no counted token."""

    def __init__(self, mesh, overrides):
        from trainer.config import load_config
        from trainer.state import make_setup
        from trainer.step import jit_train_step
        d, st, m = mesh
        cfg = load_config(TINY + BASE + [f"mesh.data={d}", f"mesh.stage={st}", f"mesh.model={m}"] + list(overrides))
        s = self.setup = make_setup(cfg, jax.devices()[:d * st * m])
        state = fresh_state(s)
        state = {**state, "params": jax.jit(_scaled, out_shardings=s.shardings["params"])(state["params"])}
        self.initial = jax.tree.map(np.asarray, state["params"])
        step, w = jit_train_step(s), uneven_weights(cfg.train.batch_size, s.model.seq_len)
        self.metrics = []
        with jax.set_mesh(s.mesh):
            for i in range(STEPS):
                state, out = step(state, jax.device_put(_batch(s, i, w), s.batch_sharding()))
                self.metrics.append(jax.device_get(out))
            self.params = jax.tree.map(np.asarray, state["params"])
            state, self.empty = step(state, jax.device_put(_batch(s, STEPS, 0 * w), s.batch_sharding()))
        self.empty = jax.device_get(self.empty)
        self.after_empty = jax.tree.map(np.asarray, state["params"])

    def series(self, key):
        return np.array([float(m[key]) for m in self.metrics])


@functools.lru_cache(maxsize=None)
def trained(name: str) -> Trained:
    mesh, overrides, _ = LAYOUTS[name]
    return Trained(mesh, tuple(overrides))


@functools.lru_cache(maxsize=None)
def reference(model_overrides: tuple) -> Trained:
    return Trained((1, 1, 1), model_overrides)


def _reference_of(name: str) -> Trained:
    return reference(tuple(o for o in LAYOUTS[name][1] if o.startswith(MODEL_KEYS)))


def _token_losses(ref: Trained) -> np.ndarray:
    """Per-token cross-entropy (B, T) of the first step's batch at the initial parameters, by optax."""
    b = _batch(ref.setup, 0)
    logits = forward(ref.setup.model, ref.initial, b["tokens"])
    return np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]))


@pytest.mark.parametrize("name", [pytest.param(n, marks=LAYOUTS[n][2]) for n in LAYOUTS])
def test_every_layout_takes_one_mean_over_counted_tokens(name):
    (data, stage, _), overrides, _ = LAYOUTS[name]
    ref, got = _reference_of(name), trained(name)
    # the pattern matters on this layout: its groups' mean of means is > 1% off the global mean
    micro = got.setup.cfg.train.microbatches
    w = uneven_weights(got.setup.cfg.train.batch_size, got.setup.model.seq_len)
    ce, g = _token_losses(ref), _groups(len(w), data, micro)
    sums, counts = (np.bincount(g, x.sum(1), data * micro) for x in (ce * w, w))
    means = np.where(counts > 0, sums / np.where(counts > 0, counts, 1), 0)
    global_mean = sums.sum() / counts.sum()
    assert abs(means.mean() - global_mean) > 0.01 * global_mean, (means.mean(), global_mean)
    assert abs(float(ref.metrics[0]["loss"]) - global_mean) < 1e-5 * global_mean  # by hand, with optax
    assert [int(m["counted_tokens"]) for m in got.metrics] == [int(w.sum())] * STEPS
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got.series(key), ref.series(key), rtol=1e-5, err_msg=key)
    assert max_rel(got.params, ref.params) < 1e-5


@pytest.mark.parametrize("name", ["accumulate-compiler", "interleaved-1f1b"])
def test_a_step_with_no_counted_token_is_a_zero_step(name):
    """Loss 0, zero gradients (SGD without momentum or decay: the parameters stay), no guard action."""
    for t in (trained(name), _reference_of(name)):
        e = t.empty
        assert float(e["loss"]) == 0.0 and float(e["grad_norm"]) == 0.0 and float(e["counted_tokens"]) == 0
        assert int(e["skipped"]) == 0 and int(e["bad_streak"]) == 0 and int(e["trip"]) == 0
        assert max_rel(t.after_empty, t.params) == 0.0


def test_a_mean_of_means_fails_the_comparison(monkeypatch):
    """The check can fail: a test-only patch that makes every (microbatch, data rank) contribute its
    own mean, scaled so that the step's one division leaves the mean of those means (the formula
    before the batch fields), differs from one device by far more than the tolerance."""
    import trainer.step
    from models.batch import counted, mean_of
    name = "zero3-tp-ring-accumulate"
    (data, _, _), overrides, _ = LAYOUTS[name]
    ref = _reference_of(name)
    B, T = ref.setup.cfg.train.batch_size, ref.setup.model.seq_len
    per_group = uneven_weights(B, T).sum() / (data * 2)  # train.microbatches=2
    own = trainer.step.objective

    def mean_of_means(c, p, b, scale, **kw):  # this group's loss sum / its own counted tokens x per_group
        value, parts = own(c, p, b, scale, **kw)
        f = mean_of(per_group, counted(b))
        return value * f, {**parts, "loss": parts["loss"] * f}
    monkeypatch.setattr(trainer.step, "objective", mean_of_means)
    got = Trained(*LAYOUTS[name][:2])
    off = abs(got.series("loss")[0] / ref.series("loss")[0] - 1)
    assert off > 0.01, off  # the first step's loss: the mean of means, > 1% off the global mean
    assert max_rel(got.params, ref.params) > 1e-3
