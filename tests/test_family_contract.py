"""A Mixture-of-Experts family written here from models/spec.py's contract alone (its config, inventory, layer and the
hooks the contract names; no import of models/families/moe.py): it trains on (2,1,4) ZeRO-3 with its experts split
over `data` exactly as on one device, `meshtrain plan` lists its expert collectives, and the counters take its active
parameters. Nothing outside this file changes for it.

The toy: Llama's attention, a router choosing one expert per token (top-1, weighted by its softmax probability,
Switch's), experts of two matrices with GELU between (not SwiGLU's three), the router's z-loss as an aux output.
Under expert parallelism each rank gathers every rank's tokens and routing weights over `experts`, runs its own experts
on all of them and reduce-scatters the sums back (one collective each, through LayerCall.collectives).
"""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SGD, TINY, corpus

from models import ModelConfig, ModelSpec, Param, register
from models.counts import active_param_count, matmul_param_count, param_count
from models.families.llama import llama_inventory
from models.layers import rms_norm
from models.transformer import layer


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyMoEConfig(ModelConfig):
    """Its own fields are no model.* keys (no models/config.py `key`): a family registered by a test module, after
    the config schema is written, runs with their defaults."""
    experts: int = 4
    expert_ff: int = 32
    z_weight: float = 0.01


def toy_inventory(c: ToyMoEConfig) -> dict:
    inv = llama_inventory(c)
    D, X, F = c.d_model, c.experts, c.expert_ff
    layers = {k: v for k, v in inv["layers"].items() if k not in ("w_gate", "w_up", "w_down")}
    layers.update(router=Param((D, X), ("embed", None), "normal", False),
                  up=Param((X, D, F), ("experts", "embed", "mlp"), "normal", True),
                  down=Param((X, F, D), ("experts", "mlp", "embed"), "residual", True))
    return {**inv, "layers": layers}


TOKENS, ROUTED = ("batch", "seq", "embed"), ("batch", "seq", None)
UP, DOWN = ("experts", "embed", "mlp"), ("experts", "mlp", "embed")


def _experts(coll, h_BTD, w_BTX, up_XDF, down_XFD):
    """One rank's blocks: every rank's tokens and weights gathered over `experts`, this rank's experts on all of them,
    the sums over `mlp` added and scattered back to the tokens' ranks."""
    B, T, D = h_BTD.shape
    h_ND = coll.all_gather(h_BTD.reshape(B * T, D), "experts", 0)
    w_NX = coll.all_gather(w_BTX.reshape(B * T, -1), "experts", 0)
    El = up_XDF.shape[0]
    mine_NE = jax.lax.dynamic_slice_in_dim(w_NX, coll.axis_index("experts") * El, El, axis=1)
    a_ENF = jax.nn.gelu(jnp.einsum("nd,edf->enf", h_ND, up_XDF))
    y_ND = jnp.einsum("enf,efd,ne->nd", a_ENF, down_XFD, mine_NE)
    return coll.reduce_scatter(coll.psum(y_ND, "mlp"), "experts", 0).reshape(B, T, D)


def toy_mlp(c: ToyMoEConfig, p: dict, x_BTD, call):
    h_BTD = rms_norm(x_BTD, p["mlp_norm"].astype(x_BTD.dtype), c.norm_eps)
    logits_BTX = jnp.einsum("btd,dx->btx", h_BTD.astype(jnp.float32), p["router"])
    probs_BTX = jax.nn.softmax(logits_BTX, axis=-1)
    w_BTX = jnp.where(jax.nn.one_hot(jnp.argmax(probs_BTX, -1), c.experts, dtype=bool), probs_BTX, 0.0)
    run = call.collectives.region(functools.partial(_experts, call.collectives), (TOKENS, ROUTED, UP, DOWN), TOKENS)
    y_BTD = run(h_BTD, w_BTX.astype(x_BTD.dtype), p["up"].astype(x_BTD.dtype), p["down"].astype(x_BTD.dtype))
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_BTX, axis=-1)))
    return call.constrain(x_BTD + y_BTD, TOKENS), {"router_z": z}


def toy_collectives(c: ToyMoEConfig, tokens: int, ranks: int, a: int) -> list:
    n = ranks * tokens  # the gathered arrays, as trainer/plan/comm.py counts them
    return [("all-gather", "tokens to every rank", n * c.d_model * a, True, True),
            ("all-gather", "routing weights", n * c.experts * a, True, True),
            ("reduce-scatter", "outputs back to their tokens", n * c.d_model * a, True, False)]


TOY = register(ModelSpec(
    "toy_moe", toy_inventory, layer, config=ToyMoEConfig, mlp=toy_mlp, aux=("router_z",),
    aux_counts=lambda c, batch: {"router_z": jnp.float32(batch["segment_ids"].size * c.n_layers)},
    aux_weights=lambda c: {"router_z": c.z_weight},
    experts_active=lambda c: 1,
    experts_over=lambda c, ranks, axis="data": None if c.experts % ranks == 0 else
    f"{c.experts} toy experts over {ranks} ranks",
    expert_collectives=toy_collectives,
    experts_line=lambda c, ranks, over: f"toy experts {c.experts} {'over' if over else 'replicated over'} "
                                        f"data={ranks} | ",
    split_keys={"mlp": ("expert_ff",)}))
MODEL = SGD + ["model.family=toy_moe", "train.expert_parallel=true"]
SPLIT = ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3"]


@functools.lru_cache(maxsize=None)
def _train(layout: tuple, steps: int = 2):
    """(each step's loss, grad_norm and aux/router_z, the parameters, the setup) of `steps` SGD steps of one layer
    (compiling is most of the time)."""
    from meshes import devices_named
    from trainer.config import load_config
    from trainer.data.batches import Batches
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step
    cfg = load_config(TINY + MODEL + ["model.n_layers=1", *layout])
    s = make_setup(cfg, jax.devices()[:devices_named(cfg.mesh)])
    state, step, out = init_state(s), jit_train_step(s), []
    b = Batches(corpus(), cfg.train.seed, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
    with jax.set_mesh(s.mesh):
        for i in range(steps):
            state, m = step(state, jax.device_put(b.global_train(i), s.batch_sharding()))
            out.append([float(m[k]) for k in ("loss", "grad_norm", "aux/router_z")])
    return np.array(out), jax.tree.map(np.asarray, state["params"]), s


def test_trains_on_2_1_4_with_its_experts_split_over_data_as_on_one_device():
    """SGD without clipping, 2 steps: loss, grad_norm, the z-loss and every parameter within 1e-5 of one device's;
    each device holds 2 of the 4 experts (asserted from the state's shardings) and the banner says so."""
    from trainer.run.context import describe
    want, want_p, _ = _train(("mesh.data=1", "mesh.stage=1", "mesh.model=1"))
    got, got_p, s = _train(tuple(SPLIT))
    assert s.layout.rules["experts"] == "data" and s.model.experts == 4
    up = s.shardings["params"]["layers"]["up"]
    assert up.shard_shape(s.param_shapes["layers"]["up"].shape)[1:3] == (2, 64)  # (L, X/data, D, F/model)
    assert "toy experts 4 over data=2 | " in describe(s)
    assert np.all(np.abs(got - want) <= 1e-5 * np.abs(want)), (got, want)
    assert want[1, 0] != want[0, 0] and want[0, 2] > 0  # it trained, and the aux output reached the metrics
    for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p)):
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))


def test_meshtrain_plan_lists_its_expert_collectives(capsys):
    """In-process `meshtrain plan --json` on (2,1,4): its three collectives over `data`, forward and backward, each
    at its bytes by hand: 8 rows x 32 tokens per rank, 2 ranks, float32, 2 layers, (K-1)/K = 1/2 of the array."""
    from trainer.cli import main
    assert main(["plan", "--json", *TINY, *MODEL, *SPLIT]) == 0
    got = {(t["kind"], t["what"]): t["bytes"] for t in json.loads(capsys.readouterr().out)["transfers"]
           if t["what"].startswith("experts: ")}
    n = 2 * 8 * 32
    tokens, weights = 2 * 0.5 * n * 64 * 4, 2 * 0.5 * n * 4 * 4
    assert got == {("all-gather", "experts: tokens to every rank (forward)"): tokens,
                   ("reduce-scatter", "experts: tokens to every rank (backward)"): tokens,
                   ("all-gather", "experts: routing weights (forward)"): weights,
                   ("reduce-scatter", "experts: routing weights (backward)"): weights,
                   ("reduce-scatter", "experts: outputs back to their tokens (forward)"): tokens,
                   ("all-gather", "experts: outputs back to their tokens (backward)"): tokens}, got


def test_its_active_parameters_count_one_expert_of_four():
    """By hand from the shapes: each layer's attention (q, o 64x64; k, v 64x32), router 64x4 and experts 4 x 2 x
    64x32, of which a token runs 1 of 4; the norms, embedding and (tied) head."""
    from trainer.config import load_config, model_config
    mc = model_config(load_config(TINY + MODEL))
    attention, router, expert = 2 * 64 * 64 + 2 * 64 * 32, 64 * 4, 2 * 64 * 32
    outer, norms = 256 * 64 + 64, 2 * 64
    assert param_count(mc) == outer + 2 * (attention + router + 4 * expert + norms)
    assert active_param_count(mc) == outer + 2 * (attention + router + expert + norms)
    assert matmul_param_count(mc) == 2 * (attention + router + expert) + 64 * 256


def test_a_split_key_its_config_lacks_is_refused_at_registration():
    """A width field the family's config does not have (a typo, another family's key) is refused when it registers,
    not read as absent later."""
    from models import FAMILIES
    with pytest.raises(ValueError, match=r"split_keys \['expert_d_ff'\] are not fields of its config"):
        register(dataclasses.replace(TOY, name="toy_typo", split_keys={"mlp": ("expert_d_ff",)}))
    assert "toy_typo" not in FAMILIES
