"""Mistral's sliding window: the CPU fast path and XLA's attention against a masked softmax written here, forward
and backward, with and without documents; KV-cache decoding through a ring of the window's length; the window
kept through export and refused where a family cannot express it (tests/fixtures/hf/mistral_window16_f32);
Mistral and Qwen3 training as on one device. Parity with transformers: tests/test_family_parity.py."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY
from hf_check import FIX, cli, edit_config, loaded, round_trip

NAME = "mistral_window16_f32"


def masked_softmax_attention(q, k, v, window, segments=None):
    """(B, T, H, E) attention by its definition: query i sees keys j with 0 <= i - j < window (and, with
    segments, of its own document); float64, grouped heads by repetition."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, E = q.shape
    k, v = (np.repeat(a, H // a.shape[2], axis=2) for a in (k, v))
    s = np.einsum("bthe,bshe->bhts", q, k) / np.sqrt(E)
    ahead = np.arange(T)[:, None] - np.arange(T)[None, :]
    keep = (ahead >= 0) & (ahead < window)
    keep = np.broadcast_to(keep, (B, 1, T, T))
    if segments is not None:
        keep = keep & (segments[:, None, :, None] == segments[:, None, None, :])
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshe->bthe", p / p.sum(-1, keepdims=True), v)


# -m slow: the unblocked manual kernel (one block, masked)
@pytest.mark.parametrize("impl,block,docs", [
    ("manual", 16, True), ("xla", 0, True), ("xla", 0, False), ("manual", 16, False),
    pytest.param("manual", 0, True, marks=pytest.mark.slow), pytest.param("manual", 0, False, marks=pytest.mark.slow)],
    ids=["documents-manual-16", "documents-xla-0", "one-doc-xla-0", "one-doc-manual-16", "documents-manual-0",
         "one-doc-manual-0"])
def test_window_attention_equals_its_definition_and_the_gradients_agree(impl, block, docs):
    """T = 64, window 20 (not a multiple of the 16-query blocks, so a block's first keys are partly seen); the
    gradients of every implementation agree with XLA's (1e-6 relative)."""
    from models.kernels.attention import attention
    key = jax.random.split(jax.random.PRNGKey(0), 4)
    B, T, H, K, E, W = 2, 64, 4, 2, 8, 20
    q, k, v = (jax.random.normal(kk, (B, T, n, E)) for kk, n in zip(key, (H, K, K)))
    seg = np.repeat(np.array([[1, 2, 3, 4], [1, 1, 2, 2]]), 16, axis=1).astype(np.float32) if docs else None
    # jitted: op by op, the blocked kernel's many small ops would each compile on their own (seconds)
    run = lambda impl, block: jax.jit(lambda q, k, v: attention(q, k, v, impl, block, "cpu", segments=seg,  # noqa: E731
                                                                window=W))
    got = run(impl, block)(q, k, v)
    want = masked_softmax_attention(q, k, v, W, seg)
    assert np.abs(np.asarray(got, np.float64) - want).max() < 1e-5
    # the window matters here: without it the output differs
    assert np.abs(masked_softmax_attention(q, k, v, T, seg) - want).max() > 1e-2
    cot = jax.random.normal(key[3], q.shape)
    grads = [jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 1, 2)))(q, k, v)
             for f in (run(impl, block), run("xla", 0))]
    for a, b in zip(*grads):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-6


def test_export_keeps_the_window(tmp_path):
    cfg, want = round_trip(NAME, tmp_path)
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["sliding_window"] == want["sliding_window"] == 16


def test_a_window_a_family_cannot_express_or_a_folder_contradicts_is_one_line(tmp_path, capsys):
    from trainer.ckpt.hf_export import write_hf
    from trainer.errors import UserError
    s, params = loaded("gqa_untied_f32", "1dev")
    import dataclasses
    with pytest.raises(UserError, match="window=8: a sliding window, which a LlamaForCausalLM cannot express"):
        write_hf(params, dataclasses.replace(s.model, window=8), tmp_path / "out")
    d = tmp_path / "hf"
    shutil.copytree(FIX / NAME, d)
    edit_config(d, sliding_window=None)
    rc = cli("train", *TINY, f"model.init_from={d}", "model.window=8", f"run.dir={tmp_path / 'run'}")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.window=8 contradicts" in err[0] and "sliding_window" in err[0], err
    rc = cli("train", *TINY, "model.window=0", f"run.dir={tmp_path / 'run2'}")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("meshtrain: error: model.window=0 must be > 0 and <= 2**31-1 or null: "), \
        err


@pytest.mark.slow  # the default run decodes the 420-token prompt through the ring (tests/test_family_parity.py)
def test_decoding_keeps_a_ring_of_the_windows_length():
    """The cache holds 16 positions whatever the length: a 40-token prefill and three one-token steps through the
    ring (wrapping twice) give training's forward logits at each last position."""
    from models.decode import extend, init_cache
    from models.transformer import forward
    s, params = loaded(NAME, "1dev")
    c = s.model
    tokens = np.load(FIX / NAME / "reference.npz")["long_prompt"][:, :43]
    cache = init_cache(c, 1, c.window)
    logits, cache = extend(c, params, tokens[:, :40], 0, cache)
    assert cache["k"].shape[2] == 16
    full = np.asarray(forward(c, params, tokens))
    got = [np.asarray(logits)]
    for t in range(40, 43):
        logits, cache = extend(c, params, tokens[:, t:t + 1], t, cache)
        got.append(np.asarray(logits))
    assert np.abs(np.concatenate(got) - full[0, 39:43]).max() < 1e-4


ZERO3 = ["mesh.data=2", "mesh.model=4", "train.zero_stage=3"]
ONE_F1B = ["mesh.data=2", "mesh.stage=2", "mesh.model=1", "train.pipeline_schedule=1f1b", "train.microbatches=2"]


# -m slow, all four (the suite's budget): tests/test_family.py trains a family defined there on both layouts
@pytest.mark.slow
@pytest.mark.parametrize("family,mesh", [("mistral", ZERO3), ("qwen3", ONE_F1B), ("mistral", ONE_F1B),
                                         ("qwen3", ZERO3)],
                         ids=["mistral-zero3-2x1x4", "qwen3-1f1b-2x2x1", "mistral-1f1b-2x2x1", "qwen3-zero3-2x1x4"])
def test_the_family_trains_as_on_one_device(family, mesh):
    """Mistral with a window of 8 (seq_len 32; the fast path's blocks of 16 skip keys) and Qwen3 (q/k norms
    replicated over `model`, head_dim 16 against d_model / n_heads = 8): SGD, losses, grad norms and parameters
    against one device (1e-5)."""
    from conftest import SGD, max_rel, run_steps, single_device
    over = SGD + [f"model.family={family}", "model.attention_block=16"] + (
        ["model.window=8"] if family == "mistral" else ["model.head_dim=16"]) + mesh
    r = run_steps(over)
    ref_losses, ref_params, ref_norms = single_device(over)
    np.testing.assert_allclose(r.losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(r.grad_norms, ref_norms, rtol=1e-5)
    assert max_rel(r.params, ref_params) < 1e-5 and ref_losses[-1] != ref_losses[0]
