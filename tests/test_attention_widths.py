"""Attention of values narrower (or wider) than the queries and keys, at a scale of its own (models/layers.py
`attend`, what multi-head latent attention needs of every kernel), against a NumPy reference written out in float64:
the fast CPU kernel, XLA's, the masked path, with documents, a window, and keys at positions of their own (a context
chunk against gathered keys)."""
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from models.kernels.attention import attention
from models.layers import attend

B, T, H, K = 2, 32, 4, 2


def _reference(q, k, v, scale, segments=None, window=None, qpos=None, kpos=None):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    qpos = np.arange(q.shape[1]) if qpos is None else qpos
    kpos = np.arange(k.shape[1]) if kpos is None else kpos
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            kh = h // (q.shape[2] // k.shape[2])
            for t in range(q.shape[1]):
                ok = kpos <= qpos[t]
                if window:
                    ok &= kpos > qpos[t] - window
                if segments is not None:
                    ok &= segments[1][b] == segments[0][b, t]
                s = np.where(ok, k[b, :, kh] @ q[b, t, h] * scale, -np.inf)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v[b, :, kh]
    return out


@pytest.mark.parametrize("widths", [(24, 16), (16, 24)], ids=["narrower-values", "wider-values"])
@pytest.mark.parametrize("case", ["manual", "xla", "documents", "window", "positions"])
def test_attend_equals_the_reference(widths, case):
    E, Ev = widths
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, H, E)).astype(np.float32)
    k = rng.normal(size=(B, T, K, E)).astype(np.float32)
    v = rng.normal(size=(B, T, K, Ev)).astype(np.float32)
    scale = 0.38  # DeepSeek-V3's YaRN-corrected scale is 0.38 at width 24, not 24 ** -0.5
    seg = np.repeat(np.array([[0, 1], [0, 0]]), T // 2, axis=1).astype(np.float32)
    kw, ref_kw = {}, {}
    if case == "documents":
        kw, ref_kw = {"segments": jnp.asarray(seg)}, {"segments": (seg, seg)}
    if case == "window":
        kw, ref_kw = {"window": 5}, {"window": 5}
    impl = "xla" if case == "xla" else "manual"
    if case == "positions":  # queries 16..31 against all 32 keys
        q = q[:, T // 2:]
        pos = (jnp.arange(T // 2, T, dtype=jnp.float32), jnp.arange(T, dtype=jnp.float32))
        kw, ref_kw = {"positions": pos}, {"qpos": np.arange(T // 2, T), "kpos": np.arange(T)}
    fn = functools.partial(attention, impl=impl, block=8, platform="cpu", **kw)
    got = attend(fn, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale)
    assert got.shape == q.shape[:3] + (Ev,)
    np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, scale, **ref_kw), rtol=2e-5, atol=2e-5)


def test_the_masked_path_takes_a_soft_cap_with_narrow_values():
    rng = np.random.default_rng(1)
    q, k = (rng.normal(size=(B, T, n, 24)).astype(np.float32) for n in (H, K))
    v = rng.normal(size=(B, T, K, 16)).astype(np.float32)
    fn = functools.partial(attention, impl="manual", platform="cpu", softcap=1e6, scale=None)  # a cap far away
    got = attend(fn, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0.3)
    np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, 0.3), rtol=2e-5, atol=2e-5)
