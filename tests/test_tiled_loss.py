"""The vocabulary-tiled cross-entropy (model.loss_chunk, models/objectives/cross_entropy.py) equals the whole-logits
loss."""
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import SGD, max_rel, run_steps, single_device
from models.config import from_preset
from models.batch import from_windows
from models.objectives.cross_entropy import chunk_tokens
from models.objectives.objective import loss_fn
from models.spec import FAMILIES, Ends, ModelSpec, register
from models.families.llama import llama_inventory
from models.transformer import Transformer, forward, layer, params_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))


def _reference_loss(c, p, batch):
    """optax's cross-entropy on the whole logits, weighted by hand: independent of both code paths."""
    ce = optax.softmax_cross_entropy_with_integer_labels(forward(c, p, batch["tokens"]), batch["targets"])
    return (ce * batch["loss_weight"]).sum() / batch["loss_weight"].sum()


CAP = 0.05  # an initial model's logits are that small


@pytest.fixture
def capped():
    """Llama with its logits soft-capped as Gemma's final soft-cap is (the family's Ends, which the shared head and
    the tiled loss read), registered for the test only."""
    yield register(ModelSpec("llama_capped", llama_inventory, layer, ends=lambda c: Ends(cap=CAP))).name
    FAMILIES.pop("llama_capped")


# default: the untied head, and the tied one with the final soft-cap (in the tiled forward and backward)
@pytest.mark.parametrize("tie,cap", [pytest.param(True, None, marks=pytest.mark.slow), (False, None), (True, CAP)],
                         ids=["tied", "untied", "tied-softcap"])
def test_tiled_loss_and_grads_match_whole_logits(tie, cap, capped):
    c = from_preset("tiny", tie_embeddings=tie, loss_chunk=0, family=capped if cap else "llama")
    p = params_of(Transformer(c, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    # N = 96 tokens, about a third not counted (loss_weight 0): the weights reach the tiled backward
    batch = from_windows(rng.integers(0, c.vocab_size, (3, c.seq_len + 1)), rng.random((3, c.seq_len)) < 0.7)
    ref_loss, ref_g = jax.jit(jax.value_and_grad(lambda p: _reference_loss(c, p, batch)))(p)
    whole_loss, _ = jax.jit(jax.value_and_grad(lambda p: loss_fn(c, p, batch)))(p)
    assert abs(float(whole_loss) - float(ref_loss)) < 1e-6 * abs(float(ref_loss))  # relative: a few float32 ulps
    if cap:  # the cap bends them: without it the loss is another
        plain = _reference_loss(dataclasses.replace(c, family="llama"), p, batch)
        assert abs(float(plain) - float(ref_loss)) > 1e-4 * abs(float(ref_loss)), (float(plain), float(ref_loss))
    # 32 divides N; 7 leaves a remainder (padded, masked-out tokens)
    for n in (32, 7) if not cap else (7,):  # the soft-cap: the remainder case alone (the suite's budget)
        cn = dataclasses.replace(c, loss_chunk=n)
        assert chunk_tokens(n, 96, c.vocab_size) == n
        loss, g = jax.jit(jax.value_and_grad(lambda p: loss_fn(cn, p, batch)))(p)
        assert abs(float(loss) - float(ref_loss)) < 1e-6 * abs(float(ref_loss)), n
        assert max_rel(jax.tree.map(np.asarray, g), jax.tree.map(np.asarray, ref_g)) < 1e-6, n


def test_default_rule():
    # whole logits up to 256 MB; above, power-of-two chunks of <= 128 MB of logits
    assert chunk_tokens(None, 4 * 256, 256) == 0  # scripts/bench/bench.yaml: never tiled
    assert chunk_tokens(None, 16 * 2048, 256) == 0
    assert chunk_tokens(None, 2048, 32768) == 0  # 256 MB exactly
    assert chunk_tokens(None, 8 * 1024, 131072) == 256
    assert chunk_tokens(None, 8 * 2048, 32000) == 1024
    assert chunk_tokens(0, 8 * 1024, 131072) == 0
    assert chunk_tokens(512, 256, 131072) == 0  # one chunk would hold every token


def test_loss_chunk_must_not_be_negative():
    from trainer.config import load_config, model_config
    from trainer.errors import UserError
    with pytest.raises(UserError, match="loss_chunk"):
        model_config(load_config(["model.loss_chunk=-1"]))


# 512 tokens per step; 48 does not divide the global or the per-data-shard token count
# the default run keeps the vocabulary split 8 ways (the pipeline's tiled loss: test_pipeline_last_stage_tiles...)
@pytest.mark.parametrize("layout", [
    pytest.param(["mesh.data=2", "mesh.stage=1", "mesh.model=4"], marks=pytest.mark.slow, id="dp2_tp4"),
    pytest.param(["mesh.data=1", "mesh.stage=1", "mesh.model=8"], id="tp8"),
    pytest.param(["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3"], marks=pytest.mark.slow,
                 id="zero3_dp2_tp4"),
    pytest.param(["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.microbatches=2"], marks=pytest.mark.slow,
                 id="pipeline_dp2_pp2_tp2"),
])
def test_train_steps_tiled_match_unchunked_one_device(layout):
    common = SGD + (["train.microbatches=2"] if "train.microbatches=2" in layout else [])
    ref_losses, ref_params, ref_norms = single_device(common + ["model.loss_chunk=0"])
    r = run_steps(layout + SGD + ["model.loss_chunk=48"])
    np.testing.assert_allclose(r.losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(r.grad_norms, ref_norms, rtol=1e-5)
    assert max_rel(r.params, ref_params) < 1e-5


def test_tiled_loss_needs_40_percent_less_temp_memory():
    """The memory claim of scripts/bench/loss_memory.py (125m, 128k vocabulary) on a shape that
    compiles fast: d_model 64, vocabulary 32768, 4096 tokens (512 MB of float32 logits)."""
    from loss_memory import temp_bytes
    shape = ["model.preset=tiny", "model.vocab_size=32768", "model.seq_len=32", "train.batch_size=128",
             "train.dtype=float32", "mesh.data=1", "mesh.stage=1", "mesh.model=1"]
    whole = temp_bytes(shape + ["model.loss_chunk=0"])
    tiled = temp_bytes(shape)  # default rule: 1024-token chunks
    assert tiled <= 0.6 * whole, (tiled, whole)


def test_pipeline_last_stage_tiles_its_microbatch_loss():
    """The pipeline's last stage computes each microbatch's loss tiled as model.loss_chunk says:
    vocabulary 32768, 4 stages, microbatches of 1024 tokens (128 MB of float32 logits and as much
    gradient, whole): the compiled step's scratch falls by most of that with 128-token chunks."""
    from loss_memory import temp_bytes
    shape = ["model.preset=tiny", "model.vocab_size=32768", "model.seq_len=32", "train.batch_size=128",
             "model.n_layers=4", "mesh.data=1", "mesh.stage=4", "mesh.model=1", "train.microbatches=4",
             "train.pipeline_schedule=1f1b"]
    whole = temp_bytes(shape + ["model.loss_chunk=0"], jax.devices()[:4])
    tiled = temp_bytes(shape + ["model.loss_chunk=128"], jax.devices()[:4])
    logits = 1024 * 32768 * 4
    assert whole - tiled >= logits, (tiled, whole)


def test_the_one_cross_entropy_keeps_split_logits_split():
    """The whole-logits cross-entropy every path takes (models/objectives/cross_entropy.py) picks each target's logit
    by comparing with an iota: with the vocabulary split over `model`, its compiled value and gradient hold no gather
    (a gather of the split axis, the old plain path's take_along_axis, moves the logits) and no all-gather, and its
    value is optax's."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from meshes import MODEL
    from models.objectives.cross_entropy import cross_entropy
    mesh = jax.make_mesh((8,), (MODEL,), axis_types=(AxisType.Auto,))
    logits = jax.random.normal(jax.random.key(0), (2, 8, 64)) * 4
    targets = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    weight = (jnp.arange(16).reshape(2, 8) % 3).astype(jnp.float32)
    f = jax.jit(jax.value_and_grad(cross_entropy), in_shardings=(NamedSharding(mesh, P(None, None, MODEL)), None, None))
    text = f.lower(logits, targets, weight).compile().as_text()
    assert " gather(" not in text and "all-gather" not in text
    want = (optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weight).sum()
    np.testing.assert_allclose(float(f(logits, targets, weight)[0]), float(want), rtol=1e-6)
