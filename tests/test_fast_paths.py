"""The XLA:CPU fast paths (models/kernels/fast_cpu.py) equal the plain reference (models/transformer.py,
jax.nn attention), forward and gradients, in float32 within TOL = 1e-6.

Measure: `max_rel`, the normwise relative difference ||a - b|| / ||b|| per tensor, where values
and their rounding grow with the sizes summed over (projections, attention, the model) and for
SiLU (plus a per-element bound, see its test); max-abs for RoPE, a rotation of O(1) values.
"""
import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY, corpus, max_rel
from models import Transformer, forward, from_preset, params_of
from models.kernels import fast_cpu
from models import layers as Ly
from models import transformer as T
from models.batch import from_windows
from models.objectives.objective import loss_fn
from models.decode import extend, init_cache

TOL = 1e-6


def _normal(seed, *shapes):
    ks = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(ks, shapes)]


def _value_and_vjp(f, args, seed=9):
    """f(*args) and the gradients of <f(*args), W> for a random cotangent W."""
    out, pull = jax.vjp(f, *args)
    leaves, tree = jax.tree.flatten(out)
    w = tree.unflatten(_normal(seed, *[x.shape for x in leaves]))
    return out, pull(w)


def _max_abs(a, b):
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ----------------------------------------------------------------------------- per function

@pytest.mark.parametrize("out_shapes", [[(8, 16)] * 3, [(96,)] * 2, [(32,)]], ids=["qkv", "gate-up", "single"])
def test_projections_equal_plain_einsums(out_shapes):
    """The shared custom-VJP backward gives autodiff's dx and dW (fused groups and a lone weight)."""
    x, *ws = _normal(1, (2, 16, 32), *[(32,) + s for s in out_shapes])
    ref = jax.jit(lambda x, ws: _value_and_vjp(Ly.project, (x, ws)))(x, tuple(ws))
    fast = jax.jit(lambda x, ws: _value_and_vjp(fast_cpu.project, (x, ws)))(x, tuple(ws))
    assert [o.shape for o in fast[0]] == [(2, 16) + s for s in out_shapes]
    assert max_rel(fast[0], ref[0]) < TOL and max_rel(fast[1], ref[1]) < TOL


def test_tanh_silu_equals_jax_silu():
    """Normwise within TOL; per element within 2.5e-6 of max(1, |silu|): a few float32 ulps, reached
    only in the saturated tails (|x| > 8), where float32 tanh(x/2) rounds to +-1 and the fast form
    drops terms below 2e-6 (silu(-16) = -1.8e-6 becomes 0; silu'(16.5) = 1 + 1.9e-6 becomes 1)."""
    x = jnp.concatenate([jnp.linspace(-30.0, 30.0, 6001), 4 * _normal(2, (4096,))[0]])
    # compiled at LLVM -O3 as training is: the suite runs -O0 (tests/conftest.py), whose tanh is an ulp
    # off in the saturated tails, which x up to 30 turns into 4e-6 there
    ref, fast = (jax.jit(jax.vmap(jax.value_and_grad(f))).lower(x).compile(
        compiler_options={"xla_backend_optimization_level": 3})(x) for f in (jax.nn.silu, fast_cpu.silu))
    assert max_rel(fast, ref) < TOL
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref)):
        assert float(jnp.max(jnp.abs(a - b) / jnp.maximum(1.0, jnp.abs(b)))) < 2.5e-6


@pytest.mark.parametrize("offset", [0, 5, "traced"])
def test_rope_rewrite_equals_rotate_half(offset):
    """Fast RoPE == rotate-half, at the offsets decoding uses (a traced position included)."""
    x, = _normal(3, (2, 12, 3, 16))
    tables = Ly.rope_tables(40, 16, 10000.0)
    pos = jnp.int32(17) if offset == "traced" else offset

    def run(rope):
        return jax.jit(lambda x, pos: _value_and_vjp(lambda x: rope(x, *tables, pos), (x,)))(x, pos)

    assert _max_abs(run(fast_cpu.apply_rope), run(Ly.apply_rope)) < TOL


def test_reference_rope_pairs_first_and_second_half():
    """Independently: pair (x[j], x[j + E/2]) is the complex number x[j] + i x[j + E/2] turned by
    position * theta^(-2j/E) (the Llama / Hugging Face convention; checkpoints depend on it)."""
    E, S, off = 16, 40, 7
    x = np.asarray(_normal(4, (1, 12, 2, E))[0], np.float64)
    ang = (off + np.arange(12))[:, None] * 10000.0 ** (-np.arange(0, E, 2) / E)  # (T, E/2)
    z = (x[..., :E // 2] + 1j * x[..., E // 2:]) * np.exp(1j * ang)[None, :, None, :]
    want = np.concatenate([z.real, z.imag], axis=-1)
    got = Ly.apply_rope(jnp.asarray(x, jnp.float32), *Ly.rope_tables(S, E, 10000.0), off)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


@pytest.mark.parametrize("block", [0, 16, 20, 48], ids=["one-block", "blocks-16", "non-dividing", "block-eq-T"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (6, 3)], ids=["mha", "gqa-4", "gqa-2"])
def test_manual_attention_equals_jax_attention(heads, block):
    """Causal GQA with causal query blocks (block i at query offset i*block) against jax.nn's."""
    (H, K), B, Tn, E = heads, 2, 48, 16
    q, k, v = _normal(5, (B, Tn, H, E), (B, Tn, K, E), (B, Tn, K, E))
    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    ref = jax.jit(lambda *a: _value_and_vjp(plain, a))(q, k, v)
    fast = jax.jit(lambda *a: _value_and_vjp(lambda *a: fast_cpu.causal_attention(*a, block), a))(q, k, v)
    assert max_rel(fast[0], ref[0]) < TOL and max_rel(fast[1], ref[1]) < TOL


@pytest.mark.parametrize("heads", [(8, 2), (6, 6)], ids=["gqa-4", "mha"])
@pytest.mark.parametrize("documents, window", [(False, None), (True, None), (False, 20), (True, 12)],
                         ids=["causal", "documents", "window", "documents-window"])
def test_long_rows_run_as_loops_equal_to_jax_attention(monkeypatch, heads, documents, window):
    """From LOOPS_FROM tokens on, the whole-row kernel is models/kernels/flash_cpu.py's loops (here from 32 tokens, tiles
    of 16): forward and gradients equal jax.nn's attention with the mask written out, causal, documents crossing
    tiles, a window shorter than a tile's reach."""
    monkeypatch.setattr(fast_cpu, "LOOPS_FROM", 32)
    monkeypatch.setattr(fast_cpu, "TILE", 16)
    (H, K), B, Tn, E = heads, 2, 48, 16
    q, k, v = _normal(6, (B, Tn, H, E), (B, Tn, K, E), (B, Tn, K, E))
    seg = jnp.asarray([[0] * 7 + [1] * 25 + [2] * 16, [0] * 39 + [1] * 9], jnp.int32)  # documents across tiles
    i = np.arange(Tn)
    keep = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
    mask = jnp.asarray(keep)[None, None] & ((seg[:, None, :, None] == seg[:, None, None, :]) if documents else True)
    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask)  # noqa: E731
    fast = lambda q, k, v: fast_cpu.causal_attention(q, k, v, 128, seg if documents else None, window)  # noqa: E731
    assert "while" in str(jax.make_jaxpr(fast)(q, k, v))  # the loops, not the unrolled blocks
    ref = jax.jit(lambda *a: _value_and_vjp(plain, a))(q, k, v)
    got = jax.jit(lambda *a: _value_and_vjp(fast, a))(q, k, v)
    assert max_rel(got[0], ref[0]) < TOL and max_rel(got[1], ref[1]) < TOL


# ----------------------------------------------------------------------------- selection and the whole model

def _tiny(**kw):
    return from_preset("tiny", **kw)


def test_kernels_chosen_by_platform_and_config(monkeypatch):
    """auto: fast paths and the manual attention on CPU, plain math elsewhere (cuDNN attention for
    GPU bfloat16); `reference` forces the plain path, XLA's attention included, on CPU."""
    import models.kernels.attention as A
    calls = []
    monkeypatch.setattr(A, "causal_attention", lambda *a: calls.append("manual") or a[0])
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, implementation=None, **k:
                        calls.append(implementation) or a[0])
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    cases = [("auto", "auto", "cpu", "fast", "manual"), ("reference", "auto", "cpu", "reference", "xla"),
             ("auto", "auto", "gpu", "reference", "cudnn"), ("auto", "auto", "tpu", "reference", "manual"),
             ("fast", "auto", "gpu", "fast", "cudnn"), ("reference", "manual", "cpu", "reference", "manual")]
    for kernels, attention, platform, name, impl in cases:
        kn = T.kernels_for(_tiny(kernels=kernels, attention=attention), platform)
        calls.clear()
        kn.attention(q, q, q)
        assert (kn.name, calls) == (name, [impl]), (kernels, attention, platform)
        assert (kn.project.__wrapped__ is fast_cpu.project) == (name == "fast")
    assert T.kernels_for(_tiny()).name == "fast"  # these tests run on CPU: the default is the fast path


def test_reference_path_is_plain_and_default_is_fast():
    """The forced reference traces no custom VJP (plain autodiff); the CPU default runs the fast paths."""
    batch = from_windows(np.zeros((2, 33)))

    def jaxpr(c):
        p = jax.eval_shape(lambda: params_of(Transformer(c, rngs=nnx.Rngs(0))))
        return str(jax.make_jaxpr(jax.grad(lambda p: loss_fn(c, p, batch)))(p))

    assert "custom_vjp" not in jaxpr(_tiny(kernels="reference"))
    assert "custom_vjp" in jaxpr(_tiny())


@pytest.mark.parametrize("kv_heads,remat", [(8, "none"), pytest.param(8, "dots", marks=pytest.mark.slow),
                                            pytest.param(4, "none", marks=pytest.mark.slow), (4, "dots")],
                         ids=["mha-none", "mha-dots", "gqa-none", "gqa-dots"])  # -m slow: the other two pairings
def test_model_loss_and_grads_fast_equal_reference(kv_heads, remat):
    batch = from_windows(corpus().train[: 4 * 33].reshape(4, 33))
    p, out = params_of(Transformer(_tiny(n_kv_heads=kv_heads), rngs=nnx.Rngs(0))), {}
    for kernels in ("reference", "fast"):
        c = _tiny(n_kv_heads=kv_heads, remat=remat, kernels=kernels)
        out[kernels] = jax.jit(jax.value_and_grad(lambda p: loss_fn(c, p, batch)))(p)
    (l_ref, g_ref), (l_fast, g_fast) = out["reference"], out["fast"]
    assert abs(float(l_fast) - float(l_ref)) / float(l_ref) < TOL
    assert max_rel(g_fast, g_ref) < TOL


def test_decode_with_offsets_fast_equals_reference():
    """KV-cache decoding (RoPE at traced offsets, the projections and SiLU) on both paths, and both
    against the reference forward over the whole sequence."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)), jnp.int32)
    params, logits = params_of(Transformer(_tiny(), rngs=nnx.Rngs(1))), {}
    for kernels in ("reference", "fast"):
        c = _tiny(kernels=kernels)
        ext = jax.jit(lambda p, t, pos, cache, c=c: extend(c, p, t, pos, cache))
        out, cache = ext(params, tokens[:, :16], 0, init_cache(c, 2, c.seq_len))
        outs = [out]
        for t in range(16, 24):
            out, cache = ext(params, tokens[:, t:t + 1], t, cache)
            outs.append(out)
        logits[kernels] = jnp.stack(outs, axis=1)
    assert max_rel(logits["fast"], logits["reference"]) < TOL
    full = forward(_tiny(kernels="reference"), params, tokens)[:, 15:]
    assert max_rel(logits["reference"], full) < 1e-5  # cache vs no cache: different summation order


def test_dots_remat_saves_the_reference_projections():
    """`dots` saves the plain path's projection outputs too (and `full` saves none)."""
    from jax._src.ad_checkpoint import saved_residuals
    c = _tiny(kernels="reference")
    lp = jax.tree.map(lambda w: w[0], params_of(Transformer(c, rngs=nnx.Rngs(0)))["layers"])
    x, rope = jnp.ones((2, 32, c.d_model)), Ly.rope_tables(32, c.head_dim, c.rope_theta)

    def named(policy):
        f = jax.checkpoint(lambda lp, x: T.layer(c, lp, x, T.layer_call(c, rope))[0].sum(), policy=Ly.REMAT[policy])
        return [r for r in saved_residuals(f, lp, x) if "projection" in r[1]]

    assert len(named("dots")) >= 5 and all(r[0].shape[:2] == (2, 32) for r in named("dots"))
    assert named("full") == []


# ----------------------------------------------------------------------------- an independent reference

def _safetensors_f32(path):
    """A float32 .safetensors file as {name: array} (8-byte header length, JSON header, raw data)."""
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    return {k: np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]], np.float32).reshape(v["shape"])
            for k, v in head.items() if k != "__metadata__"}


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_both_paths_reproduce_transformers_llama_logits(kernels):
    """Hugging Face's LlamaForCausalLM logits (tests/fixtures/hf): same RoPE pairing, same model."""
    d = Path(__file__).parent / "fixtures" / "hf" / "gqa_untied_f32"
    hf, want = _safetensors_f32(d / "model.safetensors"), np.load(d / "reference.npz")
    cfg = json.loads((d / "config.json").read_text())
    D, H, K, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    c = from_preset("tiny", d_model=D, n_heads=H, n_kv_heads=K, n_layers=L, d_ff=cfg["intermediate_size"],
                    vocab_size=cfg["vocab_size"], seq_len=cfg["max_position_embeddings"], tie_embeddings=False,
                    rope_theta=cfg["rope_parameters"]["rope_theta"], norm_eps=cfg["rms_norm_eps"], kernels=kernels)
    E = c.head_dim

    def stack(name, f):
        return jnp.stack([f(hf[f"model.layers.{i}.{name}"]) for i in range(L)])

    layers = {"attn_norm": stack("input_layernorm.weight", lambda w: w),
              "mlp_norm": stack("post_attention_layernorm.weight", lambda w: w),
              "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(D, H, E)),
              "wk": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, E)),
              "wv": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, E)),
              "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(H, E, D)),
              "w_gate": stack("mlp.gate_proj.weight", lambda w: w.T),
              "w_up": stack("mlp.up_proj.weight", lambda w: w.T),
              "w_down": stack("mlp.down_proj.weight", lambda w: w.T)}
    params = {"embed": jnp.asarray(hf["model.embed_tokens.weight"]), "layers": layers,
              "final_norm": jnp.asarray(hf["model.norm.weight"]), "lm_head": jnp.asarray(hf["lm_head.weight"].T)}
    got = np.asarray(jax.jit(lambda p, t: forward(c, p, t))(params, jnp.asarray(want["tokens"])))
    assert np.abs(got - want["logits"]).max() < 1e-5 * np.abs(want["logits"]).max()


def test_kernels_key_is_validated():
    from trainer.config import load_config, model_config
    from trainer.errors import UserError
    assert model_config(load_config(TINY + ["model.kernels=reference"])).kernels == "reference"
    with pytest.raises(UserError, match="model.kernels='fastest' is unknown; choose one of auto, reference, fast"):
        model_config(load_config(TINY + ["model.kernels=fastest"]))
