"""The TPU's expert MLP (models/kernels/moe_tpu.py, megablox's grouped matmul in a region manual over every mesh axis).

On CPU the kernel runs in Pallas's interpreter: forward and gradients against a per-expert loop written here, dropless
and with capacity, on one device and fully manual on (2,1,4) (the down projection's psum over `model` its own), and an
MoE train step on (2,1,4) ZeRO-3 against one device. Where libtpu is installed, the MoE step compiles ahead of time
for v5p:2x4x1 at (2,1,4) ZeRO-3 and (2,2,2) 1F1B with the kernel in XLA:TPU's program (tpu_custom_call).
"""
import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SGD, run_steps
from jax.sharding import NamedSharding, PartitionSpec as P

from models.kernels import experts

from models.families import moe

B, T, D, X, K, F = 4, 24, 128, 4, 2, 256  # 96 tokens, 192 choices: two row tiles of 128, 64 rows of padding


def _problem(seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    h = jax.random.normal(ks[0], (B * T, D))
    logits = jax.random.normal(ks[1], (B * T, X)) * 3
    top, idx = jax.lax.top_k(logits, K)
    ws = tuple(jax.random.normal(k, s) * 0.1 for k, s in zip(ks[2:5], [(X, D, F), (X, D, F), (X, F, D)]))
    return h, idx, jax.nn.softmax(top, axis=-1), ws


def _keep(idx, slots):
    """Every choice dropless; with `slots` per expert per row of T tokens, those models/families/moe.py `kept` keeps."""
    return np.asarray(moe.kept(idx.reshape(B, T, K), jnp.ones((B, T), bool), X, slots)[0]).reshape(B * T, K)


def loop(h, idx, keep, w, ws):
    """One expert at a time on the tokens whose choice of it is kept, weighted and summed (numpy's choices)."""
    gate, up, down = ws
    idx, keep = np.asarray(idx), np.asarray(keep)
    out = jnp.zeros_like(h)
    for e in range(X):
        for r in range(K):
            sel = np.nonzero((idx[:, r] == e) & keep[:, r])[0]
            if sel.size:
                y = (jax.nn.silu(h[sel] @ gate[e]) * (h[sel] @ up[e])) @ down[e]
                out = out.at[sel].add(w[sel, r][:, None] * y)
    return out


def _value_and_grads(f, h, w, ws):
    """sum(f(h, w, ws) x a fixed probe) and its gradients, jitted."""
    probe = jax.random.normal(jax.random.key(9), h.shape)
    return jax.jit(jax.value_and_grad(lambda h, w, ws: jnp.sum(f(h, w, ws) * probe), argnums=(0, 1, 2)))(h, w, ws)


def _close(got, want, tol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        assert err < tol, err


@pytest.mark.parametrize("slots", [None, pytest.param(10, marks=pytest.mark.slow)], ids=["dropless", "capacity"])
def test_megablox_equals_a_per_expert_loop(slots):
    """One device, float32: the interpreted kernel's output and gradients (tokens, routing weights, the three
    expert weights) within 1e-5 of the loop's; with a capacity some choices are dropped (and get no gradient; the
    default run checks a capacity fully manual, below)."""
    h, idx, w, ws = _problem()
    keep = _keep(idx, slots)
    assert (~keep).any() == (slots is not None)
    w = jnp.where(keep, w, 0.0)  # as moe_half gives it: a dropped choice weighs 0
    mine = functools.partial(experts.grouped_mlp, idx_NK=idx, keep_NK=keep, silu=jax.nn.silu, impl="megablox")
    got = _value_and_grads(lambda h, w, ws: mine(h, w_NK=w, weights=ws), h, w, ws)
    want = _value_and_grads(lambda h, w, ws: loop(h, idx, keep, w, ws), h, w, ws)
    _close(got, want)


def _sharded(idx, keep, coll, h, w, ws):
    return experts.grouped_mlp(h, idx, keep, w, ws, jax.nn.silu, impl="megablox", collectives=coll)


@pytest.mark.slow
def test_megablox_fully_manual_on_2x1x4_equals_the_loop():
    """(2,1,4), the tokens over `data`, every expert's hidden units over `model`: the region's psum over `model` sums
    the four slices' down projections; output and gradients (the weights' summed over `data` by the region's
    transpose) within 1e-5 of one device's loop, with a capacity."""
    from meshes import RULES, Collectives, build_mesh
    mesh = build_mesh(data=2, model=4)
    coll = Collectives(RULES, mesh)
    h, idx, w, ws = _problem(1)
    keep = _keep(idx, 10)
    w = jnp.where(keep, w, 0.0)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    args = (put(h, "data"), put(w, "data"), (put(ws[0], None, None, "model"), put(ws[1], None, None, "model"),
                                            put(ws[2], None, "model")))
    idx_s, keep_s = put(idx, "data"), put(keep, "data")
    f = functools.partial(_sharded, idx_s, keep_s, coll)
    with jax.set_mesh(mesh):
        got = _value_and_grads(f, *args)
    want = _value_and_grads(lambda h, w, ws: loop(h, idx, keep, w, ws), h, w, ws)
    _close(got, want)


@pytest.mark.slow
def test_an_moe_step_with_megablox_on_2x1x4_zero3_equals_one_device(monkeypatch):
    """The hook: models/families/moe.py runs megablox where BY_PLATFORM says (here CPU, interpreted); two SGD steps of a
    2-layer MoE with a capacity on (2,1,4) ZeRO-3 (the region inside the compiler's step): loss, grad norm and
    parameters within 1e-5 of one device's."""
    monkeypatch.setitem(experts.BY_PLATFORM, "cpu", "megablox")
    base = SGD + ["model.family=mixtral", "model.n_experts=4", "model.expert_d_ff=64", "model.capacity_factor=1.0"]
    got = run_steps(base + ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3"], steps=2)
    want = run_steps(base + ["mesh.data=1", "mesh.stage=1", "mesh.model=1"], steps=2)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))


# ---- the TPU program (libtpu, no chip: compiled ahead of time, nothing runs)

TPU = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                         reason="libtpu is not installed (it installs on Linux x86_64: pip install -e '.[tpu]')")
TOPOLOGY = "v5p:2x4x1"
# widths multiples of 128 (TPU tiles): d 256, each expert 512 wide; E=4, k=2; 4 rows of 128 tokens; a vocabulary of
# 512 (compiles faster: 6.3 s against d 512 and 1024's 9.2; d2m4-zero3 14.5 -> 11.8 s of CPU against a vocabulary of
# 2048)
MOE_TPU = ["model.preset=small", "model.family=mixtral", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=4",
           "model.d_ff=512", "model.n_experts=4", "model.n_experts_per_token=2", "model.vocab_size=512",
           "model.seq_len=128", "model.n_layers=2", "train.batch_size=4", "train.dtype=bfloat16"]
TPU_LAYOUTS = {  # (overrides, mesh.model, experts per rank): expert parallelism on by default (4 experts, 2 data ranks)
    # the default run's: the gathered dispatch (model.dispatch_factor=0), whose program XLA:TPU compiles in a third of
    # the time; the ragged all-to-alls under -m slow (e4m2-zero3, d2m4-zero3-ragged)
    "d2m4-zero3": (["mesh.data=2", "mesh.model=4", "train.zero_stage=3", "model.dispatch_factor=0"], 4, 2),
    "d2m4-zero3-ragged": (["mesh.data=2", "mesh.model=4", "train.zero_stage=3"], 4, 2),
    "d2m4-zero3-replicated": (["mesh.data=2", "mesh.model=4", "train.zero_stage=3", "train.expert_parallel=false"],
                              4, 4),
    "d2s2m2-1f1b": (["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.pipeline_schedule=1f1b",
                     "train.microbatches=2"], 2, 2),
    # the Mixtral-8x7B layout of docs/plan.md at a small shape: 8 experts, one per data rank, on 16 chips
    "d8m2-8-experts-4x4x1": (["mesh.data=8", "mesh.model=2", "train.zero_stage=3", "model.n_experts=8",
                              "train.batch_size=8", "model.remat=full"], 2, 1),
    # an expert degree of its own: the 4 experts over expert=4, the batch over data x expert
    "e4m2-zero3": (["mesh.data=1", "mesh.expert=4", "mesh.model=2", "train.zero_stage=3"], 2, 1),
}
KERNEL = re.compile(r"= (\w+)\[([\d,]*)\][^\n]*custom-call\([^\n]*custom_call_target=\"tpu_custom_call\"")


@TPU
@pytest.mark.slow  # the default run keeps megablox against a per-expert loop (test_megablox_equals_a_per_expert_loop)
@pytest.mark.parametrize("name", TPU_LAYOUTS)
def test_the_tpu_moe_step_runs_megablox(name):
    """XLA:TPU's program of the MoE step holds megablox's kernels: the grouped matmuls of gate/up ((rows, 512 /
    model) bfloat16), down ((rows, 256)) and tgmm's weight gradients ((El, 256, 512 / model), (El, 512 / model,
    256)): each rank's experts (El of the 4: 2 where expert parallelism splits them over the 2 data ranks) and its
    slice of their hidden units, never the whole (the region is manual over every axis); the dispatch's ragged
    all-to-alls, 4 per MoE layer forward and 3 backward."""
    from trainer.config import load_config
    from trainer.plan.aot import compile_for
    overrides, tp, El = TPU_LAYOUTS[name]
    c = compile_for(load_config(MOE_TPU + overrides), "v5p:4x4x1" if name.endswith("4x4x1") else TOPOLOGY)
    assert c.measured.platform == "tpu" and c.device_kind == "TPU v5"
    kernels = {(dtype, tuple(int(d) for d in dims.split(","))) for dtype, dims in KERNEL.findall(c.measured.text)}
    Fl = 512 // tp
    shapes = {s for _, s in kernels}
    assert {(El, 256, Fl), (El, Fl, 256)} <= shapes, kernels  # tgmm: the weights' gradients, this rank's experts
    assert any(len(s) == 2 and s[1] == Fl for s in shapes) and any(len(s) == 2 and s[1] == 256 for s in shapes)
    assert not {s for s in shapes if len(s) == 3 and (s[0] != El or 512 in s)}, kernels  # never more
    assert c.measured.total_bytes < c.plan.device.hbm  # it fits the chip
    # dropless expert parallelism: each MoE layer's runs by ragged all-to-all (models/kernels/experts.py
    # _ragged_routed), forward: the tokens, their experts there, their weights and the outputs back; backward: the
    # transposes of the tokens', the weights' and the outputs'; 4 and 3 in each of the 2 layers' own computations
    ragged = [len(re.findall(r"ragged-all-to-all\(", comp)) for comp in re.split(r"\n(?=\S)", c.measured.text)]
    if El < 4 and not any("remat" in o or "stage" in o or "dispatch_factor=0" in o for o in overrides):
        assert sorted(n for n in ragged if n) == [3, 3, 4, 4], ragged
