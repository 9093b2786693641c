"""The DeepSeek-V3 family (models/families/deepseek.py) against transformers' DeepseekV3ForCausalLM: the fixtures of
scripts/make_deepseek_fixture.py (tests/fixtures/hf/deepseek_v3_f32: 2 dense + 2 MoE layers, 8 experts in 4 groups,
top-2 groups, k 2, a shared expert, q_lora_rank, interleaved RoPE under YaRN with mscale != mscale_all_dim, one
layer's bias mostly negative so that 0.0 group masking would choose otherwise; kimi_k2_f32, one group and Kimi's
model_type; deepseek_v3_qproj_f32, one q_proj; glm4_moe_lite_f32, GLM-4.7-Flash's Glm4MoeLiteForCausalLM, its
dense layer named by mlp_layer_types). Logits within 1e-4 on the reference tokens and on a 420-token prompt
(one program), greedy tokens; decoding from the latent cache; (2,1,4) ZeRO-3 with the experts split; export bitwise;
an lr-0 step's loss against transformers' cross-entropy."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import SGD, TINY
from hf_check import FIX, round_trip

EP = ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3", "train.expert_parallel=true"]
ONE = ["mesh.data=1", "mesh.stage=1", "mesh.model=1"]


def _loaded(name, mesh, *more, T=420):
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    cfg = resolve(load_config(TINY + SGD + mesh + ["train.batch_size=4", f"model.init_from={FIX / name}",
                                                   f"model.seq_len={T}", *more]))
    s = make_setup(cfg, jax.devices()[:int(np.prod([cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model]))])
    return s, init_params(s, cfg.model.init_from)


@functools.lru_cache(maxsize=None)
def _forward(c):
    """The forward of model config c, jitted once (fixtures of one config, a float and a quantized folder, share it)."""
    from models.transformer import forward
    return jax.jit(functools.partial(forward, c))


def _both_prompts(s, params, ref):
    """(the reference tokens' logits, the long prompt's last 8) from one forward of a (4, 427) batch, the short rows
    zero-padded at the end (attention is causal), against transformers' (max difference each); and the greedy
    tokens of both prompts read from the same forward, each row the prompt and transformers' greedy tokens but the
    last (what greedy decoding feeds back): asserted equal to transformers'."""
    long, greedy, long_greedy = ref["long_prompt"], ref["greedy"], ref["long_greedy"]
    P, L = ref["prompt"].shape[1], long.shape[1]
    rows = np.zeros((4, L + long_greedy.shape[1] - 1), np.int32)
    rows[:2, :ref["tokens"].shape[1]] = ref["tokens"]
    rows[2, :P + greedy.shape[1] - 1] = np.concatenate([ref["prompt"][0], greedy[0, :-1]])
    rows[3] = np.concatenate([long[0], long_greedy[0, :-1]])
    with jax.set_mesh(s.mesh):
        got = np.asarray(_forward(s.model)(params, rows))
    np.testing.assert_array_equal(got[2, P - 1:P - 1 + greedy.shape[1]].argmax(-1), greedy[0])
    np.testing.assert_array_equal(got[3, L - 1:].argmax(-1), long_greedy[0])
    short = np.abs(got[:2, :ref["tokens"].shape[1]] - ref["logits"]).max()
    return short, np.abs(got[3, L - 8:L] - ref["long_logits"]).max()


@pytest.mark.parametrize("name", ["deepseek_v3_f32", pytest.param("kimi_k2_f32", marks=pytest.mark.slow),
                                  pytest.param("deepseek_v3_qproj_f32", marks=pytest.mark.slow),
                                  pytest.param("glm4_moe_lite_f32", marks=pytest.mark.slow)])
def test_one_device_logits_equal_transformers(name):
    s, params = _loaded(name, ONE)
    ref = np.load(FIX / name / "reference.npz")
    assert float(ref["margin_group"]) > 1e-3 and float(ref["margin_expert"]) > 1e-3
    short, long = _both_prompts(s, params, ref)
    assert short < 1e-4 and long < 1e-4, (short, long)


def test_latent_cache_decoding_gives_the_forward_logits_and_transformers_greedy_tokens():
    """models/decode.py with the family's own cache: the prompt prefilled, then the greedy tokens one at a time;
    each position's logits those of the training forward over the whole sequence (1e-4), the tokens transformers'
    greedy ones; the cache's arrays hold kv_rank + rope_dim numbers per token and layer, nothing else."""
    from models.decode import extend, init_cache
    from models.transformer import forward
    s, params = _loaded("deepseek_v3_f32", ONE)
    c, ref = s.model, np.load(FIX / "deepseek_v3_f32" / "reference.npz")
    prompt, greedy = ref["prompt"], ref["greedy"]
    cache = init_cache(c, 1, prompt.shape[1] + greedy.shape[1])
    assert {k: v.shape[-1] for k, v in cache.items()} == {"latent": c.kv_rank, "rope_key": c.rope_dim}
    assert all(v.shape[:3] == (c.n_layers, 1, 16) for v in cache.values())
    step = jax.jit(lambda p, t, pos, cache: extend(c, p, t, pos, cache))
    seq = np.concatenate([prompt, greedy], 1)
    full = np.asarray(jax.jit(lambda p, t: forward(c, p, t))(params, seq))[0]
    logits, cache = step(params, prompt, jnp.int32(0), cache)
    got, tokens = [np.asarray(logits[0])], []
    for i in range(greedy.shape[1]):
        tokens.append(int(np.argmax(got[-1])))
        logits, cache = step(params, seq[:, prompt.shape[1] + i:prompt.shape[1] + i + 1],
                             jnp.int32(prompt.shape[1] + i), cache)
        got.append(np.asarray(logits[0]))
    np.testing.assert_array_equal(tokens, greedy[0])
    want = full[prompt.shape[1] - 1:]
    assert np.abs(np.stack(got) - want).max() < 1e-4


def test_zero3_expert_parallel_import_gives_transformers_logits_and_exports_bitwise(tmp_path):
    """(2,1,4) ZeRO-3, the experts split over data: both prompts' logits (1e-4); exported from a run of that layout,
    every tensor of the fixture bitwise under its name (the dense layers' and the bias included)."""
    s, params = _loaded("deepseek_v3_f32", EP)
    assert s.reduction is not None and s.model.first_dense == 2
    short, long = _both_prompts(s, params, np.load(FIX / "deepseek_v3_f32" / "reference.npz"))
    assert short < 1e-4 and long < 1e-4, (short, long)
    got, src = round_trip("deepseek_v3_f32", tmp_path)
    assert got["first_k_dense_replace"] == 2 and got["n_group"] == 4 and got["rope_parameters"]["mscale"] == 0.707


@pytest.mark.slow
def test_an_lr0_step_loss_equals_transformers_cross_entropy():
    from models.batch import from_windows
    from trainer.step import jit_train_step
    from conftest import fresh_state
    s, params = _loaded("deepseek_v3_f32", ONE, "train.lr=0", T=23)
    ref = np.load(FIX / "deepseek_v3_f32" / "reference.npz")
    state = {**fresh_state(s), "params": params}
    with jax.set_mesh(s.mesh):
        _, m = jit_train_step(s)(state, jax.device_put(from_windows(ref["loss_tokens"]), s.batch_sharding()))
    assert abs(float(m["loss"]) - float(ref["loss"])) < 1e-5
