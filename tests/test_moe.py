"""The MoE MLP (models/families/moe.py): the layer against a per-expert Python loop written here, forward and gradients, for
each router, dropless and with capacity, on every formulation of the experts' matmuls; the load-balancing loss
against a NumPy port of transformers' load_balancing_loss_func and a hand computation over rows and layers; the
z-loss by hand; both losses move the router; the one-line errors; layouts against one device."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SGD, TINY, corpus, fresh_state

from models import from_preset
from models.kernels import experts
from models.families import moe
from models.layers import rms_norm
from models.transformer import layer_call

B, T, D, X, K, F = 2, 16, 16, 4, 2, 8
ROUTERS = {"mixtral": dict(router="topk_softmax"),
           "qwen3_norm": dict(router="softmax_topk", norm_topk_prob=True),
           "qwen3_raw": dict(router="softmax_topk", norm_topk_prob=False),
           "qwen2_shared": dict(router="softmax_topk", norm_topk_prob=False, shared_expert_d_ff=12)}


def _config(**kw):
    return from_preset("tiny", **{**dict(family="mixtral", d_model=D, n_heads=2, n_kv_heads=2, n_experts=X,
                                         n_experts_per_token=K, expert_d_ff=F), **kw})


def _weights(c, router_scale=1.0, seed=0):
    inv = moe.moe_inventory(lambda c: {"layers": {"mlp_norm": None}})(c)["layers"]
    keys = jax.random.split(jax.random.key(seed), len(inv))
    p = {k: jax.random.normal(kk, v.shape) * (0.3 if k != "router" else router_scale)
         for kk, (k, v) in zip(keys, inv.items()) if v is not None}
    p["mlp_norm"] = 1.0 + 0.1 * jax.random.normal(keys[0], (D,))
    return p


def choices(c, p, x, segments, slots):
    """Each token's k experts (the largest logits) and which of its choices take a slot, found by walking each row's
    choices in (rank, position) order: numpy (B, T, K) int and bool."""
    lg = np.asarray(jnp.einsum("btd,dx->btx", rms_norm(x, p["mlp_norm"], c.norm_eps), p["router"]))
    idx = np.argsort(-lg, axis=-1, kind="stable")[..., :K]
    valid = np.ones((B, T), bool) if segments is None else np.asarray(segments) != 0
    keep = np.zeros((B, T, K), bool)
    for b in range(B):
        used = [0] * X
        for r in range(K):
            for t in range(T):
                e = idx[b, t, r]
                if valid[b, t] and (slots is None or used[e] < slots):
                    keep[b, t, r] = True
                    used[e] += 1
    return idx, keep


def reference(c, p, x, idx, keep):
    """x + the experts, one expert at a time, each on the tokens whose choice of it took a slot, weighted and
    summed; the shared expert added."""
    h = rms_norm(x, p["mlp_norm"], c.norm_eps)
    logits = jnp.einsum("btd,dx->btx", h, p["router"])
    chosen = jnp.take_along_axis(logits, jnp.asarray(idx), axis=-1)
    if c.router == "topk_softmax":
        w = jax.nn.softmax(chosen, axis=-1)
    else:
        w = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), jnp.asarray(idx), axis=-1)
        w = w / jnp.sum(w, axis=-1, keepdims=True) if c.norm_topk_prob else w
    out = x
    for e in range(X):
        for r in range(K):
            sel = np.nonzero((idx[..., r] == e) & keep[..., r])
            if not sel[0].size:
                continue
            hs = h[sel]
            y = (jax.nn.silu(hs @ p["expert_gate"][e]) * (hs @ p["expert_up"][e])) @ p["expert_down"][e]
            out = out.at[sel].add(w[..., r][sel][:, None] * y)
    if c.shared_expert_d_ff:
        s = (jax.nn.silu(h @ p["shared_gate"]) * (h @ p["shared_up"])) @ p["shared_down"]
        out = out + jax.nn.sigmoid(h @ p["shared_expert_gate"]) * s
    return out


def _inputs(padded):
    x = jax.random.normal(jax.random.key(7), (B, T, D))
    seg = None
    if padded:  # row 1: two documents, then 4 padding tokens
        seg = jnp.asarray(np.r_[[1] * T, [1] * 6 + [2] * 6 + [0] * 4].reshape(B, T).astype(np.float32))
    return x, seg


def _layer_half(c, impl, monkeypatch):
    """The MoE half with the plain SiLU and the experts' matmuls of formulation `impl`."""
    monkeypatch.setitem(experts.BY_PLATFORM, "cpu", impl)

    def run(p, x, seg):
        call = layer_call(c, None, segments=seg)
        return moe.moe_half(c, p, x, call._replace(kernels=call.kernels._replace(silu=jax.nn.silu, platform="cpu")))
    return run


def _grads(f, p, x):
    probe = jax.random.normal(jax.random.key(3), (B, T, D))
    return jax.grad(lambda p, x: jnp.sum(f(p, x) * probe), argnums=(0, 1))(p, x)


def _close(a, b, tol=1e-5):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        err = float(jnp.max(jnp.abs(u - v)) / (jnp.max(jnp.abs(v)) + 1e-30))
        assert err < tol, err


# each router dropless or with a capacity by default (Mixtral's with a capacity on every formulation), both under -m slow
DEFAULT_LAYER = {("qwen3_norm", 0.0), ("qwen3_raw", 0.75), ("qwen2_shared", 0.0)}


@pytest.mark.parametrize("router,capacity", [pytest.param(r, f, marks=[] if (r, f) in DEFAULT_LAYER else
                                                          [pytest.mark.slow], id=f"{f}-{r}")
                                             for r in ROUTERS for f in (0.0, 0.75)])
def test_layer_equals_a_per_expert_loop(router, capacity, monkeypatch):
    c = _config(capacity_factor=capacity, **ROUTERS[router])
    # router scaled x10: every top-k margin far above float error (asserted), so both sides choose alike
    p, (x, seg) = _weights(c, router_scale=10.0), _inputs(padded=capacity > 0)
    logits = np.sort(np.asarray(jnp.einsum("btd,dx->btx", rms_norm(x, p["mlp_norm"], c.norm_eps), p["router"])))
    assert (logits[..., X - K] - logits[..., X - K - 1]).min() > 1e-3
    slots = moe.capacity(c, T)
    idx, keep = choices(c, p, x, seg, slots)
    # compiled whole, each side: the loop's hundreds of small ops run eagerly took 9 s
    ref = jax.jit(lambda p, x: reference(c, p, x, idx, keep))
    want = ref(p, x)
    valid = np.ones((B, T), bool) if seg is None else np.asarray(seg) != 0
    dropped = int((~keep & valid[..., None]).sum())
    assert (slots, dropped > 0) == ((6, True) if capacity else (None, False))
    want_g = jax.jit(functools.partial(_grads, ref))(p, x)
    # every formulation of the experts' matmuls with Mixtral's router and a capacity (drops, padding); the rest on
    # the CPU's
    # (megablox, in Pallas's interpreter, against this loop in tests/test_moe_tpu.py)
    every = [f for f in experts.FORMULATIONS if f != "megablox"]
    for impl in every if router == "mixtral" and capacity else [experts.BY_PLATFORM["cpu"]]:
        half = jax.jit(_layer_half(c, impl, monkeypatch))
        got, aux = half(p, x, seg)
        _close(got, want)
        _close(jax.jit(functools.partial(_grads, lambda p, x: half(p, x, seg)[0]))(p, x), want_g)
        assert float(aux["moe/dropped"]) == dropped  # a sum; its count is aux_counts' (the hand computation's test)


def test_decoding_drops_nothing():
    c = _config(capacity_factor=0.5)
    p, (x, _) = _weights(c, 10.0), _inputs(False)
    call = layer_call(c, None)
    y, aux = jax.jit(lambda p, x: moe.moe_half(c, p, x, call._replace(decoding=True)))(p, x)
    idx, keep = choices(c, p, x, None, None)
    _close(y, jax.jit(lambda p, x: reference(c, p, x, idx, keep))(p, x))
    training = jax.jit(lambda p, x: moe.moe_half(c, p, x, call)[1]["moe/dropped"])
    assert float(aux["moe/dropped"]) == 0 and float(training(p, x)) > 0


def hf_load_balancing_loss(gate_logits, num_experts, top_k):
    """transformers' load_balancing_loss_func (Mixtral, Qwen2-MoE, Qwen3-MoE) without an attention mask, in NumPy:
    the layers' logits concatenated over tokens."""
    logits = np.concatenate(gate_logits, axis=0)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    routing_weights = e / e.sum(-1, keepdims=True)
    selected = np.argsort(-routing_weights, axis=-1, kind="stable")[:, :top_k]
    expert_mask = np.eye(num_experts)[selected]  # (tokens, k, E)
    tokens_per_expert = expert_mask.mean(axis=0)
    router_prob_per_expert = routing_weights.mean(axis=0)
    return (tokens_per_expert * router_prob_per_expert[None]).sum() * num_experts


def test_load_balancing_loss_equals_transformers_at_one_layer_and_sequence():
    c = _config()
    logits = jax.random.normal(jax.random.key(1), (1, T, X)) * 2
    probs, idx, _ = moe.route(c, logits)
    balance, _ = moe.router_losses(c, logits, probs, idx.reshape(1, T, K), jnp.ones((1, T), bool))
    want = hf_load_balancing_loss([np.asarray(logits[0], np.float64)], X, K)
    assert abs(float(balance) - want) < 1e-6, (float(balance), want)


def _stack_by_hand(c, params, x, seg, positions):
    """The layers one at a time (the router's logits read at each MoE half's input): the load-balancing loss's mean
    over layers and rows and the z-loss's over layers and non-padding tokens, in NumPy from those logits."""
    from models.transformer import attention_half
    from models.layers import rope_for
    lb, z = 0.0, 0.0
    valid = np.ones((B, T), bool) if seg is None else np.asarray(seg) != 0
    for i in range(c.n_layers):
        p = jax.tree.map(lambda w: w[i], params["layers"])
        call = layer_call(c, rope_for(c, T, positions), segments=seg, index=i)
        x = attention_half(c, p, x, call)
        h = rms_norm(x, p["mlp_norm"], c.norm_eps)
        lg = np.asarray(jnp.einsum("btd,dx->btx", h, p["router"]), np.float64)
        pr = np.exp(lg - lg.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        top = np.argsort(-lg, -1, kind="stable")[..., :K]
        for b in range(B):
            v = valid[b]
            f = np.eye(X)[top[b][v]].sum(axis=(0, 1)) / v.sum()  # the row's choices of each expert / its tokens
            lb += X * (f * pr[b][v].mean(0)).sum()
        lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
        z += (lse[valid] ** 2).sum()
        x, _ = moe.moe_half(c, p, x, call)
    return lb / (B * c.n_layers), z / (valid.sum() * c.n_layers)


def test_losses_over_rows_and_layers_equal_a_hand_computation_and_the_objective_adds_them_weighted():
    from models.objectives.objective import aux_counts, objective, part_metrics, scales
    from models.transformer import Transformer, params_of
    import flax.nnx as nnx
    c = dataclasses.replace(_config(router_aux_loss=0.5, router_z_loss=0.25), n_layers=3, documents=True)
    params = params_of(Transformer(c, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, c.vocab_size)
    seg = jnp.asarray(np.r_[[1] * T, [1] * 6 + [2] * 6 + [0] * 4].reshape(B, T))
    batch = {"tokens": tokens, "targets": tokens, "loss_weight": (seg != 0).astype(jnp.float32),
             "segment_ids": seg, "positions": jnp.asarray(np.r_[np.arange(T), np.arange(6), np.arange(6),
                                                                np.zeros(4)].reshape(B, T).astype(np.int32))}
    scale = scales(c, batch)
    value, parts = objective(c, params, batch, scale)
    counts = aux_counts(c, batch)
    m = part_metrics(parts, counts)
    from models.transformer import embed
    lb, z = _stack_by_hand(c, params, embed(c, params, tokens, jnp.float32), seg.astype(jnp.float32),
                           batch["positions"])
    assert abs(float(m["aux/load_balance"]) - lb) < 1e-5 * lb and abs(float(m["aux/z_loss"]) - z) < 1e-5 * z
    # each output's count is every layer's rows and tokens: 3 layers x 2 rows, 3 x 28 non-padding tokens
    assert float(counts["load_balance"]) == 3 * B and float(counts["z_loss"]) == 3 * 28
    assert float(m["moe/dropped"]) == 0 and float(scale["aux"]["moe/dropped"]) == 0
    want = float(parts["loss"]) + 0.5 * lb + 0.25 * z
    assert abs(float(value) - want) < 1e-5 * want


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it (jit, shard_map, custom_vjp, scan, ...)."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_the_capacity_slots_are_computed_once_per_layer():
    """With a capacity, the layer's program has one running count of each row's choices per expert (the slots,
    (B, k T, X) int32 cumsum), which both the keep mask and the expert-parallel dispatch read."""
    c = _config(capacity_factor=1.0)
    p, (x, seg) = _weights(c), _inputs(padded=True)
    call = layer_call(c, None, segments=seg)
    jaxpr = jax.make_jaxpr(lambda p, x: moe.moe_half(c, p, x, call))(p, x).jaxpr
    counts = [e for e in _eqns(jaxpr) if e.primitive.name == "cumsum" and e.invars[0].aval.shape == (B, K * T, X)]
    assert len(counts) == 1, len(counts)


def test_the_router_matmul_runs_from_float32_inputs_in_bfloat16():
    """bfloat16 compute: the z-loss (logsumexp of the router's logits, squared, summed) equals float64's from the
    bfloat16 hidden state and the float32 router weight (1e-6), not from the weight rounded to bfloat16 (which is
    1e-3 off); under ZeRO-3 the router is gathered as stored (float32), not cast to the compute dtype first."""
    from models.precision import compute_dtypes
    from models.transformer import Transformer, params_of
    import flax.nnx as nnx
    c = _config()
    p, (x, _) = _weights(c), _inputs(padded=False)
    x = x.astype(jnp.bfloat16)
    _, aux = jax.jit(lambda p, x: moe.moe_half(c, p, x, layer_call(c, None)))(p, x)
    h = np.asarray(rms_norm(x, p["mlp_norm"].astype(jnp.bfloat16), c.norm_eps), np.float64)

    def z_of(router):
        lg = h @ np.asarray(router, np.float64)
        m = lg.max(-1)
        return float((np.square(m + np.log(np.exp(lg - m[..., None]).sum(-1)))).sum())
    want, rounded = z_of(p["router"]), z_of(p["router"].astype(jnp.bfloat16))
    assert abs(float(aux["z_loss"]) - want) < 1e-6 * want, (float(aux["z_loss"]), want)
    assert abs(rounded - want) > 1e-4 * want  # the test can tell the two apart
    full = dataclasses.replace(c, n_layers=2)
    cast = compute_dtypes(full, params_of(Transformer(full, rngs=nnx.Rngs(0))), jnp.bfloat16)
    assert cast["layers"]["router"] is None and cast["layers"]["expert_gate"] == jnp.bfloat16


def test_decoding_in_bfloat16_routes_by_the_float32_router():
    """A one-choice router whose expert 1 is expert 0's weights x (1 + 2^-16) (equal in bfloat16, asserted) and
    experts 2 and 3 zero: the float32 router picks expert 1 where expert 0's logit is positive, the router rounded
    to bfloat16 ties them (expert 0). bfloat16 decoding of 16 prompts (the last position's logits) equals the
    training forward's in bfloat16 (within 0.005; measured 0.001), and the same decoding with the router rounded
    first differs from it (more than 0.03 on some row; measured 0.059)."""
    import flax.nnx as nnx
    from models.decode import extend, init_cache
    from models.transformer import Transformer, forward, params_of
    c = _config(n_layers=1, seq_len=16, n_experts_per_token=1)
    params = params_of(Transformer(c, rngs=nnx.Rngs(2)))
    r = params["layers"]["router"]
    r = r.at[..., 1].set(r[..., 0] * (1 + 2.0 ** -16)).at[..., 2:].set(0.0)
    bf = r.astype(jnp.bfloat16)
    assert bool((bf[..., 1] == bf[..., 0]).all()) and not bool((r[..., 1] == r[..., 0]).all())
    params["layers"]["router"] = r
    params["layers"]["expert_down"] = params["layers"]["expert_down"] * 30  # experts that differ in the logits
    tokens = np.asarray(jax.random.randint(jax.random.key(5), (16, 12), 0, c.vocab_size))

    @jax.jit
    def last(p):
        return extend(c, p, tokens, 0, init_cache(c, 16, 12, jnp.bfloat16), jnp.bfloat16)[0].astype(jnp.float32)
    rounded = {**params, "layers": {**params["layers"], "router": bf.astype(jnp.float32)}}
    want = jax.jit(lambda p: forward(c, p, tokens, dtype=jnp.bfloat16)[:, -1].astype(jnp.float32))(params)
    got, old = float(jnp.abs(last(params) - want).max()), float(jnp.abs(last(rounded) - want).max())
    assert got < 0.005 and old > 0.03, (got, old)


def test_z_loss_by_hand():
    c = _config(n_experts_per_token=1)
    logits = jnp.asarray([[[0.0, math.log(3.0), -50.0, -50.0], [1.0, 1.0, 1.0, 1.0]]])  # lse: ln 4, 1 + ln 4
    probs, idx, _ = moe.route(c, logits)
    _, z = moe.router_losses(c, logits, probs, idx, jnp.asarray([[True, True]]))
    assert abs(float(z) - (math.log(4) ** 2 + (1 + math.log(4)) ** 2)) < 1e-5
    _, z = moe.router_losses(c, logits, probs, idx, jnp.asarray([[True, False]]))  # padding counts nothing
    assert abs(float(z) - math.log(4) ** 2) < 1e-5


def test_both_losses_move_the_router():
    c = _config()
    p, (x, _) = _weights(c), _inputs(False)

    def router_grad(which):
        def f(router):
            h = rms_norm(x, p["mlp_norm"], c.norm_eps)
            logits = jnp.einsum("btd,dx->btx", h, router)
            probs, idx, _ = moe.route(c, logits)
            return moe.router_losses(c, logits, probs, idx, jnp.ones((B, T), bool))[which]
        return jax.grad(f)(p["router"])
    for which in (0, 1):
        assert float(jnp.linalg.norm(router_grad(which))) > 1e-3


@pytest.mark.parametrize("keys,message", [
    (["model.n_experts=2", "model.n_experts_per_token=3"],
     r"^model.n_experts_per_token=3 exceeds model.n_experts=2; route each token to at most n_experts experts$"),
    (["model.n_experts=1", "model.capacity_factor=1.25"],
     r"^model.capacity_factor=1.25 needs model.n_experts > 1 \(it is 1: a dense MLP drops nothing\); set "
     r"n_experts or leave capacity_factor at 0$"),
    (["model.family=llama", "model.n_experts=4"], r"^model.n_experts is a key of deepseek_v3, "
                                                       r"glm4_moe_lite, gpt_oss, mixtral, qwen2_moe, qwen3_moe, "
                                                   r"not of model.family='llama'"),
])
def test_bad_input_is_one_line(keys, message):
    from trainer.config import load_config, validate
    from trainer.errors import UserError
    with pytest.raises(UserError, match=message):
        validate(load_config(TINY + ["model.family=mixtral"] + keys), 1)


# the experts replicated on every device (expert parallelism: tests/test_expert_parallel.py)
MOE = SGD + ["model.family=mixtral", "model.n_experts=4", "model.expert_d_ff=64", "model.router_aux_loss=0.1",
             "model.router_z_loss=0.01", "train.expert_parallel=false"]
ONE = ("mesh.data=1", "mesh.stage=1", "mesh.model=1")
PIPELINE = ("mesh.data=1", "mesh.stage=4", "mesh.model=2", "train.microbatches=4", "train.pipeline_schedule=1f1b")
LAYOUTS = {
    "(2,1,4) ZeRO-3 dropless": ((), ("mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3")),
}
# -m slow: the rest. (1,4,2) 1F1B capacity (19 s) is covered by default tests that run its parts: an MoE with a
# capacity through a 1F1B pipeline of 4 stages and 4 microbatches, its aux losses and dropped counts carried
# across stages (tests/test_expert_parallel.py's (2,4,1) 1F1B capacity; a row's slots do not depend on the layout),
# the experts' widths split over `model` ((2,1,4) ZeRO-3 dropless above) and the capacity's choices against a
# per-expert loop (test_layer_equals_a_per_expert_loop)
SLOW = {
    "(1,4,2) 1F1B capacity": (("model.capacity_factor=1.0", "model.n_layers=4"), PIPELINE),
    "(2,1,4) ZeRO-3 capacity": (("model.capacity_factor=1.0",),
                                ("mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3")),
    "(1,4,2) 1F1B dropless": (("model.n_layers=4",), PIPELINE),
    "(1,2,1) interleaved V=2 capacity": (("model.capacity_factor=1.0", "model.n_layers=4"),
                                         ("mesh.data=1", "mesh.stage=2", "mesh.model=1", "train.microbatches=2",
                                          "train.pipeline_schedule=interleaved_1f1b", "train.pipeline_repeats=2")),
    "(8,1,1) ring dropless": ((), ("mesh.data=8", "mesh.stage=1", "mesh.model=1", "train.grad_sync=ring")),
    "(8,1,1) ring capacity": (("model.capacity_factor=1.0",), ("mesh.data=8", "mesh.stage=1", "mesh.model=1",
                                                               "train.grad_sync=ring")),
    "M=4 capacity": (("model.capacity_factor=1.0",), ONE + ("train.microbatches=4",)),
    "M=4 dropless": ((), ONE + ("train.microbatches=4",)),
    "(1,2,1) interleaved V=2 dropless": (("model.n_layers=4",), ("mesh.data=1", "mesh.stage=2", "mesh.model=1",
                                                                 "train.microbatches=2",
                                                                 "train.pipeline_schedule=interleaved_1f1b",
                                                                 "train.pipeline_repeats=2")),
}


@functools.lru_cache(maxsize=None)
def _train(overrides: tuple, steps=2, base: tuple = tuple(MOE), router_scale: float = 1.0):
    """`steps` steps of TINY + base + overrides from the initial state, the router's weights x router_scale: (each
    step's metrics, the parameters, the mesh axis the run split its experts over (None: replicated), the router's
    initial weights)."""
    from meshes import devices_named
    from trainer.config import load_config
    from trainer.data.batches import Batches
    from trainer.plan.verify import abstract_inputs
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    cfg = load_config(TINY + list(base) + list(overrides))
    s = make_setup(cfg, jax.devices()[:devices_named(cfg.mesh)])
    state, metrics = fresh_state(s), []
    if router_scale != 1.0:
        state["params"]["layers"]["router"] = state["params"]["layers"]["router"] * router_scale
    router = np.asarray(state["params"]["layers"]["router"])
    b = Batches(corpus(), s.cfg.train.seed, s.cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
    with jax.set_mesh(s.mesh):
        step = jit_train_step(s).lower(*abstract_inputs(s)).compile()
        for i in range(steps):
            state, m = step(state, jax.device_put(b.global_train(i), s.batch_sharding()))
            metrics.append({k: float(v) for k, v in m.items() if k in ("loss", "grad_norm") or "/" in k})
    return metrics, jax.tree.map(np.asarray, state["params"]), s.layout.rules["experts"], router


def same_as_one_device(model, layout, base: tuple = tuple(MOE), router_scale: float = 1.0, split: bool | str = False):
    """Loss, grad_norm, aux/..., moe/dropped (with a capacity: some dropped, the same fraction) and parameters of
    `layout` against one device's, 1e-5; `split`: the mesh axis the layout splits the experts over (True: `data`,
    False: none) (asserted)."""
    want, want_p, _, _ = _train(tuple(model) + ONE, base=base, router_scale=router_scale)
    got, got_p, over, _ = _train(tuple(model) + tuple(layout), base=base, router_scale=router_scale)
    assert over == ({True: "data", False: None}[split] if isinstance(split, bool) else split)
    assert set(got[0]) == {"loss", "grad_norm", "aux/load_balance", "aux/z_loss", "moe/dropped", "moe/overflow"}
    for g, w in zip(got, want):  # moe/overflow: the layout's dispatch (one device never overflows), not the model's
        assert all(abs(g[k] - w[k]) <= 1e-5 * max(abs(w[k]), 1e-3) for k in w if k != "moe/overflow"), (g, w)
    if any("capacity" in m for m in model):
        assert want[0]["moe/dropped"] > 0.01 and all(g["moe/dropped"] == w["moe/dropped"] for g, w in zip(got, want))
    for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p)):
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))
    return got


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_one_device(name):
    same_as_one_device(*LAYOUTS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_more_layouts_equal_one_device(name):
    same_as_one_device(*SLOW[name])


@pytest.mark.parametrize("capacity", [0.0, 2.0])
def test_generate_equals_the_training_forwards_greedy_tokens(capacity):
    """KV-cache decoding of an MoE (never dropping) against the training forward's argmax, token by token; with a
    capacity, on a prompt where the forward drops nothing (its moe/dropped 0)."""
    import flax.nnx as nnx
    from models.decode import generate
    from models.transformer import Transformer, embed, forward, layer_stack, params_of
    c = _config(capacity_factor=capacity, n_layers=2, seq_len=32)
    params = params_of(Transformer(c, rngs=nnx.Rngs(1)))
    tokens = np.asarray(jax.random.randint(jax.random.key(4), (2, 8), 0, c.vocab_size))
    n, P = 6, tokens.shape[1]
    fwd = jax.jit(lambda t: (layer_stack(c, params["layers"], embed(c, params, t, jnp.float32))[1]["moe/dropped"],
                             forward(c, params, t)))
    want = np.concatenate([tokens, np.zeros((2, n), np.int32)], axis=1)  # causal: what follows is not seen
    for i in range(n):
        dropped, logits = fwd(want)
        want[:, P + i] = np.asarray(jnp.argmax(logits[:, P + i - 1], -1))
    assert float(dropped) == 0  # the whole sequence's forward drops nothing
    got = np.stack(list(generate(c, params, tokens, n)), axis=1)
    assert (got == want[:, P:]).all(), (got, want[:, P:])



@pytest.mark.parametrize("keys,said,held", [([], "experts 8 over data=4 (2 per data rank)", 2),
                                            (["train.expert_parallel=false"], "experts 8 replicated over data=4", 8)])
def test_the_train_banner_says_how_the_experts_are_split(keys, said, held):
    """Issue 65 item 11: the banner did not say that the experts are split over `data`. It says what the state's
    shardings hold: each expert weight's experts per device (8 / 4 = 2 when split, all 8 when not)."""
    from trainer.config import load_config
    from trainer.run.context import describe
    from trainer.state import make_setup
    s = make_setup(load_config(TINY + ["model.family=mixtral", "model.n_experts=8", "mesh.data=4", "mesh.model=2",
                                       *keys]))
    axes = jax.tree.leaves(s.logical, is_leaf=lambda v: isinstance(v, tuple))
    per_device = {sh.shard_shape(x.shape)[ax.index("experts")] for x, ax, sh in
                  zip(jax.tree.leaves(s.param_shapes), axes, jax.tree.leaves(s.shardings["params"])) if "experts" in ax}
    assert per_device == {held} and said in describe(s), (per_device, describe(s))
    assert "experts" not in describe(make_setup(load_config(TINY + ["mesh.data=4", "mesh.model=2"])))  # dense
