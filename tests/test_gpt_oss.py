"""The gpt-oss family (models/families/gpt_oss.py) against transformers' GptOssForCausalLM: the fixtures of
scripts/make_gpt_oss_fixture.py (tests/fixtures/hf/gpt_oss_f32: 4 layers alternating a 16-token window and full
attention, sinks whose removal moves the logits by more than 1e-2, every bias non-zero, 8 experts, k 2, each clamp
of the SwiGLU acting on some token, YaRN with truncate false; gpt_oss_mxfp4, the same model with its experts in
MXFP4, read by transformers with Mxfp4Config(dequantize=True)). Logits within 1e-4 on the reference tokens and on a
420-token prompt, greedy tokens, on 1 device and (2,1,4) ZeRO-3 with the experts split; export bitwise; the MXFP4
import against the format decoded here in NumPy, bit for bit; an lr-0 step's loss and pooled balancing term
against transformers'."""
import numpy as np
import pytest

import jax

from conftest import SGD, TINY
from hf_check import FIX, read_folder, round_trip
from test_deepseek import EP, ONE

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _loaded(name, mesh, *more, T=420):
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    cfg = resolve(load_config(TINY + SGD + mesh + ["train.batch_size=4", f"model.init_from={FIX / name}",
                                                   f"model.seq_len={T}", *more]))
    s = make_setup(cfg, jax.devices()[:int(np.prod([cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model]))])
    return s, init_params(s, cfg.model.init_from)


def _check_prompts(name, mesh):
    from test_deepseek import _both_prompts
    s, params = _loaded(name, mesh)
    ref = np.load(FIX / name / "reference.npz")
    short, long = _both_prompts(s, params, ref)
    assert short < 1e-4 and long < 1e-4, (short, long)
    return s, params


def test_one_device_logits_and_greedy_tokens_equal_transformers():
    ref = np.load(FIX / "gpt_oss_f32" / "reference.npz")
    # the fixture's own guarantees: routing margins, every clamp branch active, the sinks matter
    assert float(ref["margin"]) > 1e-3 and (ref["clamps"] > 0).all() and float(ref["sink_effect"]) > 1e-2
    s, _ = _check_prompts("gpt_oss_f32", ONE)
    c = s.model
    assert c.local_layers == (True, False, True, False) and c.window == 16 and not c.yarn_truncate
    assert (c.swiglu_limit, c.router_aux_loss) == (1.5, 0.0)  # the fixture's output_router_logits is false


def test_zero3_expert_parallel_logits_and_export_bitwise(tmp_path):
    _check_prompts("gpt_oss_f32", EP)
    got, src = round_trip("gpt_oss_f32", tmp_path)
    assert got["layer_types"] == src["layer_types"] and got["rope_parameters"]["truncate"] is False
    assert "quantization_config" not in got


def _decode_mxfp4(blocks, scales):
    """[E, out, in] float32 of MXFP4 bytes, decoded here: each byte two e2m1 codes, the low nibble first; a code's
    bit 3 its sign, the rest an index into E2M1; times 2 ** (scale - 127)."""
    out = np.zeros(blocks.shape[:-2] + (blocks.shape[-2] * 32,), np.float64)
    for pos in np.ndindex(*blocks.shape[:-1]):
        for j, byte in enumerate(blocks[pos]):
            for half, code in enumerate((byte & 15, byte >> 4)):
                v = E2M1[code & 7] * (-1.0 if code & 8 else 1.0) * 2.0 ** (int(scales[pos]) - 127)
                out[pos[:-1] + (pos[-1] * 32 + 2 * j + half,)] = v
    return out.astype(np.float32)


def test_mxfp4_import_equals_the_format_and_its_logits_transformers():
    s, params = _check_prompts("gpt_oss_mxfp4", ONE)
    raw = read_folder(FIX / "gpt_oss_mxfp4")
    F = s.model.expert_d_ff or s.model.d_ff
    for i in (0, 3):
        pre = f"model.layers.{i}.mlp.experts."
        gate_up = _decode_mxfp4(raw[pre + "gate_up_proj_blocks"][1], raw[pre + "gate_up_proj_scales"][1])  # [E, 2F, D]
        down = _decode_mxfp4(raw[pre + "down_proj_blocks"][1], raw[pre + "down_proj_scales"][1])  # [E, D, F]
        got = np.asarray(params["layers"]["expert_gate_up"][i])  # (E, D, 2, F): gate at HF's even rows
        np.testing.assert_array_equal(got[:, :, 0], np.swapaxes(gate_up[:, 0::2], 1, 2))
        np.testing.assert_array_equal(got[:, :, 1], np.swapaxes(gate_up[:, 1::2], 1, 2))
        np.testing.assert_array_equal(np.asarray(params["layers"]["expert_down"][i]), np.swapaxes(down, 1, 2))
        assert got.shape[-1] == F


@pytest.mark.slow
def test_an_lr0_step_loss_and_balancing_term_equal_transformers():
    """With model.router_aux_loss at the fixture's coefficient (HF's output_router_logits on): the step's token loss
    is transformers' cross-entropy and its aux/load_balance the pooled term transformers adds (over every layer's
    router logits of the 4 x 23 inputs), so the objective is transformers' loss."""
    from models.batch import from_windows
    from trainer.step import jit_train_step
    from conftest import fresh_state
    ref = np.load(FIX / "gpt_oss_f32" / "reference.npz")
    s, params = _loaded("gpt_oss_f32", ONE, "train.lr=0", f"model.router_aux_loss={float(ref['aux_coef'])}", T=23)
    state = {**fresh_state(s), "params": params}
    with jax.set_mesh(s.mesh):
        _, m = jit_train_step(s)(state, jax.device_put(from_windows(ref["loss_tokens"]), s.batch_sharding()))
    assert abs(float(m["loss"]) - float(ref["loss"])) < 1e-5
    assert abs(float(m["aux/load_balance"]) - float(ref["aux_loss"])) < 1e-5
    total = float(m["loss"]) + float(ref["aux_coef"]) * float(m["aux/load_balance"])
    assert abs(total - float(ref["loss_aux"])) < 1e-5


def test_the_balancing_loss_with_accumulation_is_refused_in_one_line():
    from trainer.config import load_config, validate
    from trainer.errors import UserError
    with pytest.raises(UserError, match=r"^model.router_aux_loss=0.01 \(gpt-oss's balancing loss pools") as e:
        validate(load_config(TINY + ["model.family=gpt_oss", "model.router_aux_loss=0.01", "train.microbatches=2"]),
                 8)
    assert "\n" not in str(e.value)


def test_counts_take_the_windows_and_the_active_experts():
    """FLOPs per token and active parameters written out for a gpt-oss shape: every layer's q/k/v/o and router, k of
    the X experts' gate, up and down (their biases, the sinks and norms elementwise: not counted), the head; the
    attention's keys per query T/2 on a full layer, w - w^2/2T on a sliding one (w < T)."""
    from models import flops_per_token
    from models.config import from_preset
    from models.counts import active_param_count, param_count
    c = from_preset("tiny", family="gpt_oss", n_layers=4, local_layers=(True, False, True, False), window=8,
                    n_experts=8, n_experts_per_token=2, expert_d_ff=48, tie_embeddings=False, seq_len=32)
    D, H, K, E, X, k, F, V, L, T, w = 64, 8, 4, 8, 8, 2, 48, 256, 4, 32, 8
    attn = D * H * E + 2 * D * K * E + H * E * D
    N = L * (attn + D * X + k * 3 * D * F) + D * V
    keys = (2 * (w - w * w / (2 * T)) + 2 * T / 2) / 4
    assert flops_per_token(c) == pytest.approx(6 * N + 6 * L * keys * H * 2 * E, rel=1e-12)
    biases = L * (H * E + 2 * K * E + D + H + X + X * 2 * F + X * D)
    norms = L * 2 * D + D
    every = L * (attn + D * X + X * 3 * D * F) + 2 * D * V + biases + norms
    assert param_count(c) == every
    assert active_param_count(c) == every - L * (X - k) * (3 * D * F + 2 * F + D)


@pytest.mark.slow
def test_cache_decoding_gives_transformers_greedy_tokens():
    """models/decode.py on the fixture (its sliding and full layers on one full-length cache, each layer's window
    masked, the sinks in every query's softmax): the prompt prefilled, then one token at a time; each step's logits
    the training forward's at that position (1e-4), the tokens transformers' greedy ones."""
    import jax.numpy as jnp
    from models.decode import extend, init_cache
    from models.transformer import forward
    s, params = _loaded("gpt_oss_f32", ONE, T=32)
    c, ref = s.model, np.load(FIX / "gpt_oss_f32" / "reference.npz")
    prompt, greedy = ref["prompt"], ref["greedy"]
    seq = np.concatenate([prompt, greedy], 1)
    full = np.asarray(jax.jit(lambda p, t: forward(c, p, t))(params, seq))[0]
    step = jax.jit(lambda p, t, pos, cache: extend(c, p, t, pos, cache))
    logits, cache = step(params, prompt, jnp.int32(0), init_cache(c, 1, seq.shape[1]))
    got, tokens = [np.asarray(logits[0])], []
    for i in range(greedy.shape[1]):
        tokens.append(int(np.argmax(got[-1])))
        P = prompt.shape[1] + i
        logits, cache = step(params, seq[:, P:P + 1], jnp.int32(P), cache)
        got.append(np.asarray(logits[0]))
    np.testing.assert_array_equal(tokens, greedy[0])
    assert np.abs(np.stack(got[:-1]) - full[prompt.shape[1] - 1:-1]).max() < 1e-4
