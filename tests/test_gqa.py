"""Fewer kv heads than `mesh.model` (kv heads replicated over the ranks that share one), and the
attention implementation `auto` picks per platform."""
import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SGD, TINY, max_rel, run_steps, single_device
from trainer.config import load_config, model_config
from trainer.plan.core import estimate, strategy_of
from trainer.hardware import get_device
from trainer.plan.hlo import collective_ops
from trainer.plan.memory import leaf_bytes
from trainer.plan.verify import measure

KV2 = ["model.n_kv_heads=2"]  # tiny: 8 query heads, head_dim 8
LAYOUTS = {
    "1,1,8-sgd": SGD + KV2 + ["mesh.data=1", "mesh.model=8"],
    "2,1,4-sgd": SGD + KV2 + ["mesh.data=2", "mesh.model=4"],
    "2,1,4-adamw-zero3": KV2 + ["mesh.data=2", "mesh.model=4", "train.zero_stage=3"],
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if "adamw" in n else []) for n in LAYOUTS])
def test_fewer_kv_heads_than_model_matches_single_device(name):
    over = LAYOUTS[name]
    ref_losses, ref_params, ref_norms = single_device(over)
    r = run_steps(over)
    assert tuple(r.setup.mesh.shape[a] for a in ("data", "stage", "model")) == tuple(int(x) for x in name.split("-")[0].split(","))
    assert abs(r.losses - ref_losses).max() / abs(ref_losses).max() < 1e-5, (r.losses, ref_losses)
    assert abs(r.grad_norms - ref_norms).max() / abs(ref_norms).max() < 1e-5, (r.grad_norms, ref_norms)
    assert max_rel(r.params, ref_params) < 1e-5
    assert ref_losses[-1] < ref_losses[0]  # it learns: the comparison is not between two no-ops
    wk = r.state["params"]["layers"]["wk"]
    assert "model" not in jax.tree.leaves(tuple(wk.sharding.spec)), wk.sharding  # replicated over model


def _plan(over):
    cfg = load_config(TINY + over)
    st = strategy_of(cfg, math.prod((cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model)))
    return cfg, st, estimate(model_config(cfg), cfg.train, st, get_device("h100-80g"), 1, "float32")


@pytest.mark.parametrize("name", ["1,1,8-sgd", "2,1,4-adamw-zero3"])
def test_planner_state_bytes_match_the_created_state(name):
    """Per-device bytes of every parameter leaf (the kv weights whole on every model rank, split
    over data by ZeRO-3) and of the whole state, as the planner predicts and init_state creates."""
    from trainer.state import init_state, make_setup
    cfg, st, plan = _plan(LAYOUTS[name])
    s = make_setup(cfg, jax.devices()[:st.devices])
    state = init_state(s)
    real = jax.tree.map(lambda a: a.addressable_shards[0].data.nbytes, state["params"])
    mc = model_config(cfg)
    whole_kv = mc.n_layers * mc.d_model * mc.n_kv_heads * mc.head_dim * 4
    expect_kv = whole_kv // (st.data if st.zero == 3 else 1)
    assert real["layers"]["wk"] == real["layers"]["wv"] == expect_kv
    assert leaf_bytes(mc, cfg.train, st, "param") == real
    shards = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves((state["params"], state["opt_state"])))
    assert plan.params_bytes + plan.opt_state_bytes == shards


@pytest.mark.parametrize("over", [["mesh.data=1", "mesh.model=8"],
                                  ["mesh.data=2", "mesh.model=4", "train.zero_stage=2", "train.microbatches=2"]],
                         ids=["1,1,8", "2,1,4-zero2-m2"])
def test_collectives_match_the_planner_and_gather_no_activations(over):
    """The HLO's collectives within 2% of the planner's; over `model` it gathers only dK/dV (one layer's
    (B, T, K, E)), never the queries or the residual stream."""
    cfg, st, plan = _plan(KV2 + over)
    m = measure(cfg, grads=False)
    assert abs(plan.comm_bytes / m.comm_bytes - 1) < 0.02, (plan.comm_bytes, m.comm_bytes)
    mc = model_config(cfg)
    rows = cfg.train.batch_size // (st.data * st.microbatches)
    kv_bytes = rows * mc.seq_len * mc.n_kv_heads * mc.head_dim * 4
    gathered = [line for kind, axes, _, line in collective_ops(m.text, m.mesh_shape)
                if kind == "all-gather" and axes == ("model",) and "-done" not in line]
    assert gathered  # dK/dV are gathered over the kv heads
    for line in gathered:
        shape = re.search(r"=\s*f32\[([\d,]*)\]", line).group(1)
        if int(np.prod([int(d) for d in shape.split(",")])) * 4 > kv_bytes:
            # only weights (ZeRO's gathers carry no batch dimension) may be larger
            assert rows not in [int(d) for d in shape.split(",")], line


def test_kv_heads_must_divide_model_or_the_reverse():
    from trainer.config import validate
    from trainer.errors import UserError
    from trainer.plan.search import strategies
    assert validate(load_config(TINY + KV2 + ["mesh.data=1", "mesh.model=8"]), 8).sizes == (1, 1, 1, 1, 8)
    bad = TINY + ["mesh.data=2", "mesh.model=4", "model.d_model=96", "model.n_heads=12", "model.n_kv_heads=6"]
    with pytest.raises(UserError, match="model.n_kv_heads=6 and mesh.model=4 must divide one another"):
        validate(load_config(bad), 8)
    models = {s.model for s in strategies(model_config(load_config(TINY + KV2)), 16, 8)}
    assert models == {1, 2, 4, 8}


# ----------------------------------------------------------------------------- attention backends

def _qkv(dtype):
    ks = jax.random.split(jax.random.key(0), 3)
    shapes = ((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8))
    return tuple(jax.random.normal(key, shape).astype(dtype) for key, shape in zip(ks, shapes))


@pytest.mark.parametrize("platform,dtype,expect", [
    ("tpu", jnp.bfloat16, "manual"), ("tpu", jnp.float32, "manual"), ("cpu", jnp.float32, "manual"),
    ("cpu", jnp.bfloat16, "manual"), ("gpu", jnp.bfloat16, "cudnn"), ("gpu", jnp.float32, "xla")])
def test_auto_attention_per_platform(platform, dtype, expect, monkeypatch):
    """`auto` runs the manual (blockwise) kernel on CPU and TPU, cuDNN's on GPU for bfloat16, else XLA's."""
    import models.kernels.attention as A
    calls = []
    monkeypatch.setattr(A, "causal_attention", lambda *a: calls.append("manual") or a[0])
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, implementation=None, **k:
                        calls.append(implementation) or a[0])
    A.attention(*_qkv(dtype), "auto", platform=platform)
    assert calls == [expect]
    assert A.select("xla", dtype, "cpu") == "xla" and A.select("manual", dtype, "tpu") == "manual"


def test_cudnn_fallback_logs_why_once(caplog):
    """On a machine without cuDNN, GPU `auto` falls back to XLA's attention and warns once with the reason."""
    import models.kernels.attention as A
    A.reset_warnings()
    q, k, v = _qkv(jnp.bfloat16)
    with caplog.at_level(logging.WARNING, logger="models.kernels.attention"):
        out = [A.attention(q, k, v, "auto", platform="gpu") for _ in range(2)]
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert all(np.array_equal(np.asarray(o, np.float32), np.asarray(ref, np.float32)) for o in out)
    warned = [r for r in caplog.records if r.name == "models.kernels.attention"]
    assert len(warned) == 1 and "using XLA's" in warned[0].getMessage(), warned
    assert re.search(r"\((\w+Error): .+\)", warned[0].getMessage()), warned[0].getMessage()  # the reason
