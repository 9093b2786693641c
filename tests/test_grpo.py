"""GRPO (models/objectives/grpo.py) against TRL 1.16's GRPOTrainer itself: the fixtures of scripts/make_grpo_fixture.py
(tests/fixtures/grpo: for each loss_type, beta 0 and 0.04, mask_truncated_completions both ways, what TRL's
`_compute_loss` received and returned on its two microbatches of two optimizer steps, num_iterations=2, and what it
logged). Here TRL's own per-token log-probabilities go through meshtrain's loss: the step's loss, kl and every
clip_ratio metric within 1e-5 (relative) of TRL's at both steps, and the advantages of the recorded rewards."""
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from models.objectives import grpo

FIX = Path(__file__).parent / "fixtures" / "grpo"
VARIANTS = [f"{t}_beta{b}_mask{m}" for t in grpo.LOSS_TYPES for b in (0.0, 0.04) for m in (0, 1)]
SETUP = json.loads((FIX / "completions.json").read_text()) if (FIX / "completions.json").exists() else {}


def _close(got, want, what, rel=1e-5, floor=1e-6):
    assert abs(got - want) <= rel * abs(want) + floor, (what, got, want)


def interleaved(f, step: int) -> dict:
    """TRL's two microbatches of one optimizer step as one batch whose rows alternate between them (row i in
    microbatch i % 2, as meshtrain's step splits a batch): {field: array}."""
    mbs = [{k.split("_", 1)[1]: f[k] for k in f.files if k.startswith(f"s{step}m{m}_")} for m in (0, 1)]
    out = {}
    for k, v in mbs[0].items():
        if np.ndim(v) >= 1:
            out[k] = np.stack([v, mbs[1][k]], axis=1).reshape(-1, *v.shape[1:])
    return out


def _step(f, step: int, g: grpo.Grpo) -> dict:
    """meshtrain's step metrics of TRL's recorded microbatches of one optimizer step."""
    b = interleaved(f, step)
    mask = b["completion_mask"].astype(np.float32)
    w = grpo.token_weights(g.loss_type, mask, 2, g.max_completion_length)
    logp = b["per_token_logps"]
    old = b.get("old_per_token_logps", logp)
    ref = b.get("ref_per_token_logps", np.zeros_like(logp))
    got = jax.jit(lambda *a: grpo.sums(g, *a[:4], {"loss": a[4], "metric": a[5]}, a[6]))(
        logp, old, ref, b["advantages"][:, None], w["loss"], w["metric"], mask)
    out = {k: float(v) for k, v in got.items() if np.ndim(v) == 0}
    out.update(grpo.clip_extremes(np.asarray(got["row_low"]), np.asarray(got["row_high"]), 2))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_loss_and_metrics_are_trl_s_on_its_log_probabilities(variant):
    f = np.load(FIX / f"{variant}.npz")
    loss_type, beta = variant.split("_beta")[0], float(variant.split("_beta")[1].split("_")[0])
    g = grpo.Grpo(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
                  max_completion_length=SETUP["max_completion_length"])
    for step in (1, 2):
        got = _step(f, step, g)
        _close(got["loss"], float(f[f"log{step}_loss"]), f"loss at step {step}")
        _close(got["loss"], sum(float(f[f"s{step}m{m}_loss"]) for m in (0, 1)), f"microbatch losses, step {step}")
        for k in ("kl", *grpo.CLIP_METRICS, "clip_ratio/low_min", "clip_ratio/high_max"):
            if f"log{step}_{k}" in f.files:
                _close(got[k], float(f[f"log{step}_{k}"]), f"{k} at step {step}")
    assert 0.05 < float(f["log2_clip_ratio/region_mean"]) < 0.9  # iteration 2 clips some tokens, not all


@pytest.mark.parametrize("variant", ["dapo_beta0.0_mask0", "grpo_beta0.04_mask1"])
def test_the_advantages_are_trl_s_of_the_recorded_rewards(variant):
    f = np.load(FIX / f"{variant}.npz")
    adv, metrics = grpo.advantages(f["rewards_per_func"], SETUP["reward_weights"], SETUP["G"])
    trl = np.concatenate([f[f"s1m{m}_advantages"] for m in (0, 1)])
    np.testing.assert_allclose(np.sort(adv), np.sort(trl), rtol=1e-5, atol=1e-6)  # TRL shuffles them into microbatches
    for k in ("reward", "reward_std", "frac_reward_zero_std"):
        _close(metrics[k], float(f[f"log1_{k}"]), k)
    from trainer.rl.rewards import metrics as per_function
    names = sorted({k.split("/")[1] for k in f.files if k.startswith("log1_rewards/")})
    got = per_function(names, f["rewards_per_func"])  # TRL's columns are its functions in the order given
    for n in names:
        for stat in ("mean", "std"):
            _close(got[f"rewards/{n}/{stat}"], float(f[f"log1_rewards/{n}/{stat}"]), f"rewards/{n}/{stat}")


ONE = ("mesh.data=1", "mesh.stage=1", "mesh.model=1")


def _setup(variant: str, mesh=ONE, extra=()):
    """A meshtrain Setup of the fixture's model and the variant's GRPO settings, SGD at TRL's learning rate."""
    from trainer import load_config, resolve
    from trainer.state import make_setup
    loss_type, beta, masked = variant.split("_beta")[0], variant.split("_beta")[1].split("_mask")[0], variant[-1]
    cfg = resolve(load_config([f"model.init_from={FIX / 'policy'}", "model.seq_len=32", "train.batch_size=12",
                               "train.microbatches=2", "train.optimizer=sgd", f"train.lr={SETUP['lr']}",
                               "train.grad_clip=0", "train.warmup_steps=0", "train.min_lr_ratio=1", "train.b1=0",
                               "train.weight_decay=0", "train.objective=grpo", f"grpo.loss_type={loss_type}",
                               f"grpo.beta={beta}", "grpo.epsilon=0.2", "grpo.epsilon_high=0.28",
                               "grpo.temperature=0.7", f"grpo.num_generations={SETUP['G']}",
                               f"grpo.max_completion_length={SETUP['max_completion_length']}",
                               f"grpo.mask_truncated_completions={'true' if masked == '1' else 'false'}", *mesh,
                               *extra]))
    from meshes import devices_named
    return make_setup(cfg, jax.devices()[:devices_named(cfg.mesh)])


ZERO3 = ("mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3")
PIPE = ("mesh.data=1", "mesh.stage=2", "mesh.model=2", "train.pipeline_schedule=1f1b")
CONTEXT = ("mesh.data=2", "mesh.stage=1", "mesh.model=2", "mesh.context=2", "train.context_attention=ring")


@pytest.mark.parametrize("variant,mesh", [("dapo_beta0.04_mask0", ONE)]
                         + [pytest.param(v, m, marks=pytest.mark.slow) for v in VARIANTS for m in (ONE, ZERO3)
                            if (v, m) != ("dapo_beta0.04_mask0", ONE)]
                         + [pytest.param(v, m, marks=pytest.mark.slow) for v in ("dapo_beta0.04_mask0",
                                                                                 "bnpo_beta0.04_mask1")
                            for m in (PIPE, CONTEXT)])
def test_the_learning_step_is_trl_s_over_two_iterations(variant, mesh):
    """TRL's completions learnt by meshtrain's train step (one device; every variant on one device and on (2,1,4)
    ZeRO-3, two on a (1,2,2) 1F1B pipeline and on two context ranks (ring), under -m slow): its own old and
    reference log-probabilities (TRL's within 1e-5), at iteration 1 the
    gradient's norm (relative 1e-5) and the first layer's q_proj gradient (1e-4), at iteration 2 the loss, kl and clip
    ratios (relative 1e-5)."""
    f = np.load(FIX / f"{variant}.npz")
    m1, m2, got = learnt(variant, mesh)
    assert got["old_gap"] < 1e-5 and got["ref_gap"] < 1e-5, got
    _close(float(m1["grad_norm"]), float(f["grad_norm"]), "grad_norm at iteration 1")
    q0 = got["q0_grad"]  # (D, H, E): HF's (H E, D) transposed
    np.testing.assert_allclose(q0.reshape(q0.shape[0], -1).T, f["grad_q0"], rtol=1e-4, atol=1e-6)
    _close(float(m2["loss"]), float(f["log2_loss"]), "loss at iteration 2")
    for i, m in ((1, m1), (2, m2)):  # TRL's entropy: the microbatches' masked means, averaged
        _close(float(m["aux/entropy"]), float(f[f"log{i}_entropy"]), f"entropy at iteration {i}")
    for k in ("kl", *grpo.CLIP_METRICS):
        if f"log2_{k}" in f.files:
            _close(float(m2[k if "/" in k else f"aux/{k}"]), float(f[f"log2_{k}"]), f"{k} at iteration 2")


def learnt(variant: str, mesh, extra=()) -> tuple[dict, dict, dict]:
    """(the step metrics of iteration 1 and 2, {old_gap, ref_gap: the largest differences of meshtrain's old and
    reference log-probabilities from TRL's; q0_grad: iteration 1's first-layer wq gradient}) of meshtrain's train step
    learning TRL's recorded completions of a variant, from the fixture's policy (its own forward gives the old and
    reference log-probabilities, as in a run)."""
    from models.objectives.grpo import token_weights
    from trainer.ckpt.initial import state_from_params
    from trainer.ckpt.params import init_params
    from trainer.data.completions import gather_targets, rows
    from trainer.rl.rollout import logps
    from trainer.step import jit_train_step
    f = np.load(FIX / f"{variant}.npz")
    s = _setup(variant, mesh, extra)
    g = s.model.grpo
    b = interleaved(f, 1)
    prompts = [list(p[m.astype(bool)]) for p, m in zip(b["prompt_ids"], b["prompt_mask"])]
    mask = b["completion_mask"].astype(np.float32)
    w = token_weights(g.loss_type, mask, 2, g.max_completion_length)
    zeros = np.zeros_like(mask)
    per = {"loss_weight": w["loss"], "metric_weight": w["metric"], "old_logp": zeros, "ref_logp": zeros,
           "advantage": np.broadcast_to(b["advantages"][:, None], mask.shape), "completion": mask}
    params = init_params(s, s.cfg.model.init_from)
    layout = rows(prompts, b["completion_ids"], per, s.model.seq_len)
    with jax.set_mesh(s.mesh):
        old = gather_targets(logps(s.model, params, layout, 2), prompts, mask.shape[1])  # as a run: per microbatch
        ref = gather_targets(logps(s.model, init_params(s, str(FIX / "reference")), layout, 2), prompts,
                             mask.shape[1]) if g.beta else zeros
    gaps = {"old_gap": float(np.abs((old - b["old_per_token_logps"]) * mask).max()),
            "ref_gap": float(np.abs((ref - b["ref_per_token_logps"]) * mask).max()) if g.beta else 0.0}
    batch = rows(prompts, b["completion_ids"], {**per, "old_logp": old, "ref_logp": ref}, s.model.seq_len)
    step = jit_train_step(s)
    state = state_from_params(s, params)
    with jax.set_mesh(s.mesh):
        state, m1 = step(state, jax.device_put(batch, s.batch_sharding()))
        new_q = np.asarray(state["params"]["layers"]["wq"][0])
        state, m2 = step(state, jax.device_put(batch, s.batch_sharding()))
    gaps["q0_grad"] = (np.asarray(params["layers"]["wq"][0]) - new_q) / SETUP["lr"]
    gaps["params"], gaps["initial"] = jax.tree.map(np.asarray, state["params"]), jax.tree.map(np.asarray, params)
    return m1, m2, gaps


def test_plan_counts_the_sampler_s_cache_and_the_reference(capsys):
    """meshtrain plan of train.objective=grpo (beta 0.04, 16 completions, (2,1,2) data x model): its sampling KV
    cache per device is the bytes each device holds of the cache as a run places it (trainer/rl/rollout.py, the
    arrays' own shards on 4 devices), the reference model the parameters again, and the total counts the larger of
    the cache and the step's activations and buffers."""
    import jax.numpy as jnp
    from models.decode import init_cache
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.cli import main
    from trainer.rl.rollout import placement
    from trainer.state import make_setup
    over = [f"model.init_from={FIX / 'policy'}", "train.objective=grpo", "train.batch_size=16", "grpo.beta=0.04",
            "grpo.rewards=[regex:x]", "grpo.max_completion_length=16", "mesh.data=2", "mesh.model=2",
            "model.seq_len=64"]
    assert main(["plan", *over, "--devices", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    s = make_setup(resolve(load_config(over)), jax.devices()[:4])
    where = placement(s.model, init_params(s, str(FIX / "policy")), 16)
    cache = jax.tree.map(lambda a: jax.device_put(a, where[1]), init_cache(s.model, 16, 64, jnp.float32))
    held = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(cache))
    assert plan["sampling_bytes"] == held and held < sum(a.nbytes for a in jax.tree.leaves(cache)) / 2
    assert plan["reference_bytes"] == plan["params_bytes"] > 0
    assert plan["total_bytes"] == (plan["params_bytes"] + plan["grads_bytes"] + plan["opt_state_bytes"]
                                   + plan["reference_bytes"]
                                   + max(plan["activations_bytes"] + plan["buffers_bytes"], held))


@pytest.mark.slow
def test_the_learning_step_compiles_for_a_tpu_topology(capsys):
    """meshtrain plan --compile-for of GRPO: XLA:TPU (libtpu, no chip) compiles the learning step with its batch's
    fields (old and reference log-probabilities, advantages, weights) and the sampler's prefill and decode step on 8
    chips; the cache each chip holds (the step's donated cache) is the planner's figure; it fits."""
    import importlib.util
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install -e '.[tpu]')")
    from trainer.cli import main
    assert main(["plan", f"model.init_from={FIX / 'policy'}", "train.objective=grpo", "train.batch_size=16",
                 "grpo.beta=0.04", "grpo.rewards=[regex:x]", "grpo.max_completion_length=64", "mesh.data=8",
                 "--compile-for", "v5p:2x4x1",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["xla_tpu"]["fits"] and doc["predicted"]["sampling_bytes"] > 0, doc
    for program in ("prefill", "decode"):
        assert doc["xla_tpu"]["sampler"][program]["alias_bytes"] == doc["predicted"]["sampling_bytes"], doc
    assert doc["xla_tpu"]["total_bytes"] >= doc["xla_tpu"]["sampling_total_bytes"] > 0


def _prompts(tmp_path, n=8, long=False):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": ("x " * 40 if long and i == 3 else f"Question {i}: what is {i} + 1?"),
                                     "answer": str(i + 1)}) + "\n" for i in range(n)))
    return f


GRPO_RUN = ["train.objective=grpo", "grpo.rewards=[regex:x,numeric:answer]", "grpo.reward_weights=[1.0,0.5]",
            "grpo.num_generations=4", "train.batch_size=8", "grpo.max_completion_length=8", "grpo.num_iterations=2",
            "grpo.beta=0.04", "grpo.temperature=0.9", "model.seq_len=32", "mesh.data=-1", "train.optimizer=sgd",
            "train.lr=0.05", "train.warmup_steps=0", "train.min_lr_ratio=1", "train.grad_clip=0",
            "checkpoint.every=2", "run.progress=false", "run.log_every=1"]


@pytest.mark.slow
def test_meshtrain_train_learns_from_rewards_and_resumes_bit_for_bit(tmp_path):
    """`meshtrain train train.objective=grpo` on a prompt file: 4 steps, a generation every 2 (num_iterations), TRL's
    metrics in metrics.jsonl; the same run stopped after step 2 and resumed gives steps 3 and 4 bit for bit."""
    from hf_check import cli
    data = _prompts(tmp_path)
    base = [f"model.init_from={FIX / 'policy'}", f"data.source={data}", *GRPO_RUN]
    assert cli("train", *base, f"run.dir={tmp_path / 'a'}", "train.steps=4") == 0
    assert cli("train", *base, f"run.dir={tmp_path / 'b'}", "train.steps=2") == 0
    assert cli("train", *base, f"run.dir={tmp_path / 'b'}", "train.steps=4") == 0
    a, b = ([json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in "ab")
    assert [r["step"] for r in a] == [1, 2, 3, 4] == [r["step"] for r in b]
    for k in ("loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/high_max", "reward",
              "reward_std",
              "rewards/regex/mean", "rewards/numeric/std", "frac_reward_zero_std", "completions/mean_length",
              "completions/clipped_ratio", "num_tokens"):
        assert all(k in r for r in a), k
        assert [r[k] for r in a[2:]] == [r[k] for r in b[2:]], k
    assert a[0]["reward"] == a[1]["reward"] and a[2]["reward"] != a[0]["reward"]  # one generation per 2 steps


def test_a_prompt_past_the_context_is_one_line(tmp_path):
    from trainer import load_config
    from trainer.errors import UserError
    from trainer.run.grpo import prompts
    cfg = load_config([f"data.source={_prompts(tmp_path, long=True)}", *GRPO_RUN])
    with pytest.raises(UserError, match=r"prompts.jsonl:4: its prompt's 80 tokens plus grpo.max_completion_length=8 "
                                        r"exceed the model's context of 64") as e:
        prompts(cfg, lambda rec, where: list(rec["prompt"].encode()), 64)
    assert "\n" not in str(e.value)


def test_fewer_than_two_generations_is_one_line():
    from trainer import load_config
    from trainer.config import validate
    from trainer.errors import UserError
    with pytest.raises(UserError, match=r"grpo.num_generations") as e:
        load_config(["train.objective=grpo", "grpo.num_generations=1"])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"grpo.max_completion_length=64 leaves no room for a prompt in the model's "
                                        r"context of 64 tokens") as e:
        validate(load_config(["train.objective=grpo", "grpo.max_completion_length=64", "model.seq_len=64",
                              "mesh.data=1"]), 1)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_kill_9_resumes_the_same_completions_and_losses(tmp_path):
    """The GRPO run killed (-9) once its step-4 checkpoint (a generation boundary) is written, then started again:
    steps 5 and 6 (a new generation) log what the uninterrupted run logs, bit for bit."""
    import os
    import subprocess
    import time
    from hf_check import cli
    root = Path(__file__).parent.parent
    data = _prompts(tmp_path)
    base = [f"model.init_from={FIX / 'policy'}", f"data.source={data}", *GRPO_RUN, "train.steps=6"]
    assert cli("train", *base, f"run.dir={tmp_path / 'a'}") == 0
    run = tmp_path / "b"
    with open(tmp_path / "b.log", "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "trainer.cli", "train", *base, f"run.dir={run}"], cwd=root,
                             env=dict(os.environ, PYTHONPATH=str(root)), stdout=log, stderr=subprocess.STDOUT)
        t0 = time.time()
        while not (run / "checkpoints" / "4").is_dir():
            assert p.poll() is None and time.time() - t0 < 300, (tmp_path / "b.log").read_text()
            time.sleep(0.002)
        p.kill()
        assert p.wait() == -9 and not (run / "checkpoints" / "6").exists()  # killed mid-run, not after its end
    assert cli("train", *base, f"run.dir={run}") == 0
    a, b = ([json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in "ab")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert a == b


@pytest.mark.slow
def test_the_learning_step_with_lora_is_the_same_on_every_layout():
    """GRPO with LoRA (rank 4 on every projection of the fixture's policy, the base frozen): TRL's completions learnt
    for two iterations on (2,1,4) ZeRO-3, a (1,2,2) 1F1B pipeline and two context ranks give one device's loss,
    grad_norm, kl, clip ratios and adapters (1e-5), the base unchanged."""
    lora = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[all-linear]")
    v = "dapo_beta0.04_mask0"
    m1, m2, one = learnt(v, ONE, lora)
    assert float(m2["loss"]) != float(np.load(FIX / f"{v}.npz")["log2_loss"])  # LoRA's step, not full fine-tuning's
    for k, w in one["params"]["layers"].items():
        if not k.endswith(("_lora_a", "_lora_b")):
            np.testing.assert_array_equal(w, one["initial"]["layers"][k], err_msg=f"the base's {k} moved")
    for mesh in (ZERO3, PIPE, CONTEXT):
        n1, n2, other = learnt(v, mesh, lora)
        for k in ("loss", "grad_norm", "aux/kl", "clip_ratio/region_mean"):
            for a, b in ((m1, n1), (m2, n2)):
                _close(float(b[k]), float(a[k]), f"{k} on {mesh}")
        for k, w in one["params"]["layers"].items():
            got = other["params"]["layers"][k]
            got = got.reshape(w.shape) if got.size == w.size else got
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=f"{k} on {mesh}")


def _synthetic(init_from: Path, mesh, start=None) -> tuple[dict, dict]:
    """(the metrics, the parameters after it) of one GRPO iteration (dapo, beta 0) on seeded prompts, completions
    and advantages of a model folder, laid out as `mesh`: a layout check needing no reference tool. The old
    log-probabilities are the folder's weights'; the iteration starts from them or from `start` (parameters an
    earlier iteration gave, so that the ratios are away from 1 and clipped)."""
    from meshes import devices_named
    from models.objectives.grpo import token_weights
    from trainer import load_config, resolve
    from trainer.ckpt.initial import state_from_params
    from trainer.ckpt.params import init_params
    from trainer.data.completions import gather_targets, rows
    from trainer.rl.rollout import logps
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    cfg = resolve(load_config([f"model.init_from={init_from}", "model.seq_len=32", "train.batch_size=8",
                               "train.microbatches=2", "train.optimizer=sgd", "train.lr=0.1", "train.grad_clip=0",
                               "train.warmup_steps=0", "train.min_lr_ratio=1", "train.b1=0", "train.weight_decay=0",
                               "train.objective=grpo", "grpo.loss_type=dapo", "grpo.max_completion_length=12",
                               "grpo.num_generations=4", *mesh]))
    s = make_setup(cfg, jax.devices()[:devices_named(cfg.mesh)])
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(1, 255, n)) for n in (5, 9, 3, 7, 4, 8, 6, 10)]
    completions = rng.integers(1, 255, (8, 12))
    mask = (np.arange(12)[None, :] < rng.integers(4, 13, 8)[:, None]).astype(np.float32)
    w = token_weights("dapo", mask, 2, 12)
    per = {"loss_weight": w["loss"], "metric_weight": w["metric"], "completion": mask,
           "advantage": np.broadcast_to(rng.normal(size=(8, 1)).astype(np.float32), mask.shape),
           "old_logp": np.zeros_like(mask), "ref_logp": np.zeros_like(mask)}
    params = init_params(s, cfg.model.init_from)
    with jax.set_mesh(s.mesh):
        per["old_logp"] = gather_targets(logps(s.model, params, rows(prompts, completions, per, 32)), prompts, 12)
        batch, step = rows(prompts, completions, per, 32), jit_train_step(s)
        state, m = step(state_from_params(s, params if start is None else start),
                        jax.device_put(batch, s.batch_sharding()))
    return {k: float(v) for k, v in m.items() if np.ndim(v) == 0}, jax.tree.map(np.asarray, state["params"])


@pytest.mark.slow
def test_the_learning_step_of_an_moe_is_the_same_with_the_experts_split():
    """GRPO on a Mixtral (4 experts, k 2) on (2,1,4) ZeRO-3 with the experts split over data gives one device's
    loss, grad_norm, clip ratios and parameters (1e-5): a first iteration, and a second from the parameters one
    device's first gave (its ratios clipped). Each iteration starts from the same weights on both layouts: over two
    chained iterations at this rate (SGD at 0.1, grad_norm 12) the routing makes the second iteration chaotic, its
    grad_norm moving by 3.4e-5 when one device's initial weights move by 3e-7 (relative, about 2 ulp), by 2.3e-5 with
    the layout (scripts/checks/grpo_conditioning.py)."""
    mix = Path(__file__).parent / "fixtures" / "hf" / "mixtral_e4k2_f32"
    split = ("mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3", "train.expert_parallel=true")
    start = None
    for i in range(2):
        (m, p), (n, q) = _synthetic(mix, ONE, start), _synthetic(mix, split, start)
        for k in ("loss", "grad_norm", "clip_ratio/region_mean", "clip_ratio/low_mean"):
            _close(n[k], m[k], (i, k))
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        start = p
    assert m["clip_ratio/region_mean"] > 0  # the second iteration's ratios are clipped


def test_sampling_through_a_pipeline_is_refused_in_one_line(tmp_path, capsys):
    """meshtrain train of GRPO with mesh.stage > 1: its sampling is not built through a pipeline's stages (its
    learning step is, tested above): one line, exit 2, nothing written."""
    from trainer.cli import main
    run = tmp_path / "run"
    assert main(["train", f"model.init_from={FIX / 'policy'}", f"data.source={_prompts(tmp_path)}", *GRPO_RUN,
                 "mesh.data=4", "mesh.stage=2", "train.microbatches=2", f"run.dir={run}", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "sampling through a pipeline's stages is not built" in err, err
    assert not run.exists()


def test_prepared_prompts_are_the_ones_trl_samples_after(tmp_path):
    """`meshtrain prepare` of a prompt file (the fixture's four text prompts, a conversation, fields for the rewards):
    the loop reads each training prompt of the .bin with the ids TRL 1.16's `_tokenize_prompts` gives a text prompt
    (`tokenizer(text=prompts)`: the tokenizers library's encode with its special tokens, BOS first; the fixture's
    recorded ids, which its rollout_func encoded without them, follow the BOS) and the ids it encodes from the file
    itself (the conversation rendered by the chat template with the generation prompt), every other field of the
    record kept; a prepare that mixes prompts with texts is one line, nothing written."""
    from trainer import load_config
    from trainer.data.prepare import prepare
    from trainer.errors import UserError
    from tokenizers import Tokenizer
    from trainer.run.grpo import _codec, prompts
    f = np.load(FIX / "dapo_beta0.0_mask0.npz")
    recorded = {tuple(int(x) for x in p[m.astype(bool)]) for k in ("s1m0", "s1m1")
                for p, m in zip(f[f"{k}_prompt_ids"], f[f"{k}_prompt_mask"])}
    hf = Tokenizer.from_file(str(FIX / "policy" / "tokenizer.json"))
    records = [{"prompt": p, "answer": str(i), "meta": {"n": [i]}} for i, p in enumerate(SETUP["prompts"])]
    records.append({"prompt": [{"role": "user", "content": "Count the a's in banana."}], "answer": "3"})
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare([str(src)], str(tmp_path / "p.bin"), tokenizer=str(FIX / "policy"), heldout=0.0, log=lambda *_: 0,
                   show_progress=False)
    assert meta["prompts"] == {"path": "p.bin.prompts.jsonl", "train": 5, "heldout": 0}
    got = {}
    for source in (tmp_path / "p.bin", src):
        cfg = load_config([f"model.init_from={FIX / 'policy'}", f"data.source={source}", *GRPO_RUN])
        got[source.suffix] = prompts(cfg, _codec(cfg)[0], 64)
    assert got[".bin"] == got[".jsonl"] and [{k: v for k, v in r.items() if k != "prompt_ids"}
                                             for r in got[".bin"]] == records
    for r in got[".bin"][:4]:
        assert r["prompt_ids"] == hf.encode(r["prompt"]).ids and r["prompt_ids"][0] == hf.token_to_id("<|begin_of_text|>"), r
    assert recorded and recorded <= {tuple(r["prompt_ids"][1:]) for r in got[".bin"][:4]}
    from trainer.data.checks import check_data
    with pytest.raises(UserError, match=r"p.bin holds prompts alone .* train.objective=lm cannot learn from"):
        check_data(load_config([f"data.source={tmp_path / 'p.bin'}", "model.preset=tiny"]))
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "2 + 2 ="}) + "\n" + json.dumps({"text": "a document"}) + "\n")
    with pytest.raises(UserError, match=r"mixed.jsonl:2: prompts alone \(GRPO's\) and records to train on") as e:
        prepare([str(mixed)], str(tmp_path / "m.bin"), tokenizer=str(FIX / "policy"), heldout=0.0,
                log=lambda *_: 0, show_progress=False)
    assert "\n" not in str(e.value) and sorted(x.name for x in tmp_path.iterdir() if x.name.startswith("m.")) == []
