"""FLOPs of a Mixture of Experts (models/counts.py): the convention's active parameters (each expert weight at k/E
of its size, the router and a shared expert whole) against a sum written out here from the shapes, and against
XLA's cost analysis of the compiled forward and backward of the model's loss, whose count is what the experts'
formulation executes (HANDS)."""
import dataclasses
import functools

import jax
import pytest

from models import abstract_model, from_preset, loss_fn
from models.kernels import experts
from models.batch import abstract
from models.counts import active_param_count, flops_per_token, hardware_flops_per_token, matmul_param_count
from models.counts import param_count

D, H, KV, L, T, V = 64, 4, 2, 2, 32, 256  # width, heads, kv heads, layers, sequence, vocabulary
X, K, F, S = 4, 2, 48, 40  # experts, experts per token, each expert's width, the shared expert's width
Dh = D // H
B = 4  # rows of the compiled step


def _config(family="mixtral", **kw):
    return from_preset("tiny", **{**dict(family=family, d_model=D, n_heads=H, n_kv_heads=KV, n_layers=L, seq_len=T,
                                         vocab_size=V, n_experts=X, n_experts_per_token=K, expert_d_ff=F), **kw})


@pytest.mark.parametrize("family,shared", [("mixtral", None), ("qwen2_moe", S)])
def test_flops_by_hand(family, shared):
    """Mixtral (Llama's attention, k of X experts) and Qwen2-MoE (q/k/v biases, a shared expert behind a sigmoid
    gate): N summed from the shapes; the parameter counts against the model's own arrays."""
    c = _config(family, shared_expert_d_ff=shared, **({} if shared is None else dict(router="softmax_topk")))
    attention = D * H * Dh + D * KV * Dh + D * KV * Dh + H * Dh * D  # q, k, v, o (Qwen2's biases: elementwise)
    router = D * X
    experts = K * (D * F + D * F + F * D)  # gate, up and down of the k experts a token runs, of the X
    shared_expert = 0 if shared is None else D * S + D * S + S * D + D  # gate, up, down; its sigmoid gate (D, 1)
    N = L * (attention + router + experts + shared_expert) + D * V  # and the head
    assert matmul_param_count(c) == N
    causal = 6 * L * T * H * Dh  # 12 L T H Dh, half of it unmasked
    assert flops_per_token(c) == 6 * N + causal
    # remat full: the layer's forward again, the experts' down projection included (the routing weight multiplies
    # its output, so the router's gradient needs that; a shared expert's likewise for its sigmoid gate)
    attention_fwd = 2 * L * T * H * Dh
    assert hardware_flops_per_token(dataclasses.replace(c, remat="full")) == 6 * N + causal + 2 * (N - D * V) + attention_fwd
    assert hardware_flops_per_token(dataclasses.replace(c, remat="dots")) == 6 * N + causal + attention_fwd
    # all parameters, and the active ones: the model's arrays, each expert array at k/X of its size
    arrays = jax.tree_util.tree_flatten_with_path(abstract_model(c).params)[0]
    total = sum(a.size for _, a in arrays)
    experts_all = sum(a.size for path, a in arrays if path[-1].key in ("expert_gate", "expert_up", "expert_down"))
    assert experts_all == L * X * 3 * D * F
    assert param_count(c) == total and active_param_count(c) == total - experts_all + experts_all * K // X


# XLA: 1 FLOP per elementwise op per element, 2 per multiply-add of a dot. Wide shapes (a cost analysis compiles,
# it does not run: the width costs no time) make the elementwise work small next to the matmuls: per element of
# the experts' hidden (D_X matmul FLOPs each, forward and backward: 18 D_X) SiLU, its derivative and the products
# with up and the routing weight are fewer than 48 ops (39 measured, jax 0.10.2); RoPE, norms, softmaxes and the
# loss likewise per element of theirs. So XLA counts the matmuls a formulation executes, by hand below, and < 1%
# more.
D_X, H_X, F_X, S_X = 512, 4, 128, 256  # width, heads, expert width, shared expert width
N_X = B * T  # tokens of the compiled step; M = K N_X choices


def _xla(c, impl, monkeypatch) -> float:
    """XLA's FLOPs of value_and_grad of the model's loss on one device, the experts' matmuls by `impl`."""
    monkeypatch.setitem(experts.BY_PLATFORM, "cpu", impl)
    step = jax.jit(jax.value_and_grad(functools.partial(loss_fn, c)))
    cost = step.lower(abstract_model(c).params, abstract(B, T)).compile().cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def _wide(family="mixtral", layers=2, **kw):
    return _config(family, d_model=D_X, n_heads=H_X, n_layers=layers, expert_d_ff=F_X, remat="none",
                   scan_layers=False, **kw)


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_convention_against_xla_all_experts(family, monkeypatch):
    """`all_experts` runs every expert on every token: X / K = 2 times the active experts' matmuls. XLA's count of
    the step is: the convention (6 N + the causal half of attention), plus the experts not chosen (their matmuls
    run, weighted 0), plus the attention's masked half (XLA computes the whole T x T scores), plus the dot that
    spreads the k routing weights over the X experts (2 K X per token forward, again for the weights' gradient), all
    counted by hand from the shapes, plus elementwise work under 1%."""
    shared = S_X if family == "qwen2_moe" else None
    c = _wide(family, shared_expert_d_ff=shared)
    Dh_X = D_X // H_X
    attention = D_X * H_X * Dh_X + 2 * D_X * KV * Dh_X + H_X * Dh_X * D_X
    shared_expert = 0 if shared is None else 3 * D_X * shared + D_X
    active = L * (attention + D_X * X + K * 3 * D_X * F_X + shared_expert) + D_X * V
    convention = 6 * active + 6 * L * T * H_X * Dh_X
    assert flops_per_token(c) == convention
    not_chosen = 6 * L * (X - K) * 3 * D_X * F_X
    masked_half = 6 * L * T * H_X * Dh_X
    spread = L * 2 * (2 * K * X)
    executed = N_X * (convention + not_chosen + masked_half + spread)
    xla = _xla(c, "all_experts", monkeypatch)
    assert executed <= xla < 1.01 * executed, (xla / executed, xla, executed)
    # so XLA's count / the convention's is the experts' X / K on their share, the masked half on attention's
    experts_share = 6 * L * K * 3 * D_X * F_X / convention
    assert abs(xla / (N_X * convention) - (1 + experts_share * (X / K - 1) + (masked_half + spread) / convention)) \
        < 0.01 * xla / (N_X * convention)


def _rows(impl: str) -> int:
    """Rows per layer through each expert matmul that XLA's cost analysis counts, per formulation: `tiles` pads each
    expert's choices to whole tiles (a static ceil(M / 128) + X of them) and counts them all; `tile_scan` runs those
    tiles in a lax.scan, whose body XLA counts once (one tile); `ragged_dot` on XLA:CPU is lowered to every group's
    matmul over all M rows, masked (X M)."""
    M = K * N_X
    return {"tiles": experts.padded_tiles(M, X) * experts.TILE, "tile_scan": experts.TILE, "ragged_dot": X * M}[impl]


@pytest.mark.parametrize("impl", [pytest.param("tiles", marks=pytest.mark.slow), "tile_scan",
                                  pytest.param("ragged_dot", marks=pytest.mark.slow)])
def test_what_xla_counts_of_each_formulation(impl, monkeypatch):
    """XLA's count of an MoE step = the convention less its active experts' matmuls, plus the masked half of
    attention, plus the experts' matmuls over the rows the formulation runs as XLA sees them (_rows, from the shapes),
    forward and backward (6 x 3 D F per row and layer), plus elementwise work under 1%: docs/performance.md's
    statement of where XLA counts padded or masked work."""
    c = _wide()
    Dh_X = D_X // H_X
    convention = flops_per_token(c)
    experts_active = 6 * L * K * 3 * D_X * F_X
    masked_half = 6 * L * T * H_X * Dh_X
    executed = N_X * (convention - experts_active + masked_half) + 6 * L * 3 * D_X * F_X * _rows(impl)
    xla = _xla(c, impl, monkeypatch)
    assert executed <= xla < 1.01 * executed, (xla / executed, xla, executed)
