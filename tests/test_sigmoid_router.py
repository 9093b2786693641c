"""DeepSeek-V3's router and its balancing rule (models/families/sigmoid_router.py) against NumPy references written
from transformers' DeepseekV3TopkRouter and the DeepSeek-V3 report's rule, token by token (no compile beyond eager
ops): group-limited choice with the bias, weights from the unbiased scores, renormalised and scaled; the bias moved
by rate x sign(mean load - load)."""
import jax.numpy as jnp
import numpy as np

from models.families.sigmoid_router import balanced_bias, route

X, G, TOPK_GROUP, K, SCALE = 8, 4, 2, 2, 2.5


def _reference(logits, bias, fill=-np.inf):
    """(chosen experts as a set per token, their weights by expert) token by token; `fill` masks the experts of the
    groups left out (-inf as transformers 5.25; 0.0 a port's slip that the test must tell apart)."""
    out = []
    for row in logits.astype(np.float64):
        s = 1.0 / (1.0 + np.exp(-row))
        biased = s + bias
        groups = [sorted(biased[g * (X // G):(g + 1) * (X // G)])[-2:] for g in range(G)]
        kept = sorted(range(G), key=lambda g: -sum(groups[g]))[:TOPK_GROUP]
        masked = np.array([biased[e] if e // (X // G) in kept else fill for e in range(X)])
        chosen = sorted(range(X), key=lambda e: -masked[e])[:K]
        w = np.array([s[e] for e in chosen])
        w = w / (w.sum() + 1e-20) * SCALE
        out.append(dict(zip(chosen, w)))
    return out


def _margins(logits, bias):
    """Each token's smallest gap between the last kept group's score and the next, and between the k-th biased
    expert's score and the next within the kept groups: above 1e-3, the choice is not decided by a rounding."""
    out = []
    for row in logits.astype(np.float64):
        biased = 1.0 / (1.0 + np.exp(-row)) + bias
        g = np.sort([np.sort(biased[i * (X // G):(i + 1) * (X // G)])[-2:].sum() for i in range(G)])[::-1]
        kept = np.argsort([-np.sort(biased[i * (X // G):(i + 1) * (X // G)])[-2:].sum() for i in range(G)])[:TOPK_GROUP]
        inside = np.sort([biased[e] for e in range(X) if e // (X // G) in kept])[::-1]
        out.append(min(g[TOPK_GROUP - 1] - g[TOPK_GROUP], inside[K - 1] - inside[K]))
    return np.array(out)


def test_route_equals_the_reference_token_by_token():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (256, X)).astype(np.float32)
    bias = rng.uniform(-1.2, 0.1, X).astype(np.float32)  # mostly negative: a masked 0.0 would outrank kept experts
    logits = logits[_margins(logits, bias) > 1e-3][:64]  # tokens whose choice no rounding decides
    assert len(logits) == 64
    scores, idx, w = route(jnp.asarray(logits), jnp.asarray(bias), G, TOPK_GROUP, K, True, SCALE)
    np.testing.assert_allclose(np.asarray(scores), 1 / (1 + np.exp(-logits.astype(np.float64))), rtol=1e-6)
    want = _reference(logits, bias)
    for t, (i_row, w_row) in enumerate(zip(np.asarray(idx), np.asarray(w))):
        assert set(i_row.tolist()) == set(want[t]), t
        np.testing.assert_allclose(w_row, [want[t][e] for e in i_row], rtol=1e-6)
    slipped = _reference(logits, bias, fill=0.0)  # the data tells -inf from 0.0 masking
    assert any(set(a) != set(b) for a, b in zip(want, slipped))


def test_the_bias_moves_the_choice():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 1, (16, X)).astype(np.float32))
    bias = jnp.asarray(rng.uniform(-0.5, 0.5, X).astype(np.float32))
    i0, i1 = (np.asarray(route(logits, b, G, TOPK_GROUP, K, True, SCALE)[1]) for b in (bias, bias.at[3].add(5.0)))
    assert (i1 == 3).any(axis=1).all() and not np.array_equal(i0, i1)  # expert 3's bias of +5 wins every token


def test_the_balancing_rule_equals_its_reference():
    rng = np.random.default_rng(2)
    bias = rng.normal(0, 0.1, (3, X)).astype(np.float32)
    loads = rng.integers(0, 40, (3, X)).astype(np.int32)
    loads[1] = 10  # every expert at the mean: no change
    got = np.asarray(balanced_bias(jnp.asarray(bias), jnp.asarray(loads), 1e-2))
    want = bias.copy()
    for layer in range(3):
        mean = loads[layer].mean()
        for e in range(X):
            want[layer, e] += np.float32(1e-2) * (1.0 if loads[layer, e] < mean else -1.0 if loads[layer, e] > mean
                                                  else 0.0)
    assert got.tobytes() == want.tobytes()
    assert np.array_equal(got[1], bias[1])


def test_the_sequence_balance_loss_equals_the_papers_equations_per_document():
    """DeepSeek-V3 report, eq. 17-20, for each document of a packed batch (padding left out), written out
    token by token: f_i = X / (k T) sum_t 1(i chosen at t), P_i = 1/T sum_t s_it / sum_j s_jt, the term sum_i f_i P_i."""
    from models.families.sigmoid_router import sequence_balance
    rng = np.random.default_rng(3)
    B, T = 3, 12
    scores = 1 / (1 + np.exp(-rng.normal(size=(B, T, X)))).astype(np.float32)
    idx = np.stack([np.stack([rng.choice(X, K, replace=False) for _ in range(T)]) for _ in range(B)]).astype(np.int32)
    segments = np.array([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12, [0] * 7 + [1] * 5]).astype(np.float32)
    valid = np.ones((B, T), bool)
    valid[2, 9:] = False  # the last row's second document padded at its end
    valid[1, 10:] = False
    total, docs = 0.0, 0
    for b in range(B):
        for d in np.unique(segments[b]):
            ts = [t for t in range(T) if segments[b, t] == d and valid[b, t]]
            if not ts:
                continue
            docs += 1
            f = [X / (K * len(ts)) * sum(i in idx[b, t] for t in ts) for i in range(X)]
            p = [sum(scores[b, t, i] / scores[b, t].sum() for t in ts) / len(ts) for i in range(X)]
            total += sum(fi * pi for fi, pi in zip(f, p))
    got, n = sequence_balance(jnp.asarray(scores), jnp.asarray(idx), jnp.asarray(segments), jnp.asarray(valid))
    assert int(n) == docs == 6
    np.testing.assert_allclose(float(got), total, rtol=1e-5)
