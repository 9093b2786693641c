"""train.sequence_parallel: the residual stream split over `model` along the sequence (meshes/rules.py `res_seq`),
each column-parallel matmul's input gathered over `model` inside a remat that keeps only the split input
(models/layers.py sublayer_remat through LayerCall.column). Every layout against the one-device run (SGD without
clipping: losses, grad norms and parameters within 1e-5), and the compiled program's own shapes and temp bytes."""
import jax
import pytest
from conftest import SGD, TINY, equals_one_device

SP = SGD + ["train.sequence_parallel=true"]


@pytest.mark.parametrize("mesh", [["mesh.data=1", "mesh.model=8"],
                                  ["mesh.data=2", "mesh.model=4", "train.zero_stage=3"]],
                         ids=["1x1x8", "2x1x4-zero3"])
def test_a_layout_with_sequence_parallelism_trains_as_one_device(mesh):
    equals_one_device(SP + mesh)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    ["mesh.data=1", "mesh.stage=2", "mesh.model=4", "train.pipeline_schedule=1f1b", "train.microbatches=4"],
    ["mesh.data=1", "mesh.context=2", "mesh.model=4"],
    ["mesh.data=2", "mesh.model=4", "model.family=mixtral", "model.n_experts=4", "model.n_experts_per_token=2",
     "train.expert_parallel=true"],
], ids=["1x2x4-1f1b", "context2-model4", "moe-experts-split"])  # with documents: tests/test_documents.py
def test_other_paths_with_sequence_parallelism_train_as_one_device(mesh):
    equals_one_device(SP + mesh)



FAMILIES = {"qwen3": ["model.family=qwen3"], "gemma2": ["model.family=gemma2"], "gemma3": ["model.family=gemma3"],
            "qwen2_moe": ["model.family=qwen2_moe", "model.n_experts=4", "model.n_experts_per_token=2",
                          "train.expert_parallel=true"]}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_each_family_with_sequence_parallelism_trains_as_one_device(family):
    """Every family's layers (their own norms, soft-caps, latent attention, sinks, routers and shared experts) with
    the residual split over `model`, at (2,1,4) ZeRO-3 (the experts split over data): one device's losses, grad
    norms and parameters within 1e-5; and the compiled step holds the (B, T/M, D) residual, which the plain one does
    not (tensors of other names may share that shape by chance: at least ten times as many in the split program;
    measured 393 to 616 against 0, DeepSeek's 553 against 36). DeepSeek's and gpt-oss's configs are their layout
    tests' own; T is 48 so that T/M is a width no other tensor has."""
    from trainer.config import load_config, model_config
    if family == "deepseek_v3":
        from test_deepseek_train import DS as over
        over = over + ["train.expert_parallel=true"]
    elif family == "gpt_oss":
        from test_gpt_oss_train import GO as over
        over = over + ["train.expert_parallel=true"]
    else:
        over = SGD + FAMILIES[family]
    over = over + ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3", "model.seq_len=48"]
    equals_one_device(TINY + over + ["train.sequence_parallel=true"])
    cfg = load_config(TINY + over)
    mc = model_config(cfg)
    shape = f"f32[{cfg.train.batch_size // 2},{mc.seq_len // 4},{mc.d_model}]"
    plain, split = (_measured(over + [f"train.sequence_parallel={sp}"], 8).text.count(shape) for sp in ("false", "true"))
    assert split >= 10 * max(plain, 1), (shape, plain, split)

def _measured(over: list[str], devices: int = 4):
    """The compiled train step of the config on the first `devices` devices (trainer/plan/verify.py measure)."""
    from trainer.config import load_config
    from trainer.plan.verify import measure
    return measure(load_config(TINY + over), jax.devices()[:devices], grads=False)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_the_125m_step_needs_less_temp_memory(remat):
    """The 125m step (B 4, T 2048, D 768, 12 layers, float32) at (1,1,4): XLA's temp bytes with sequence
    parallelism below those without by at least a hand count of what it splits (0.8 of it at remat full). At remat
    none autodiff keeps, per layer, each half's input x (for its norm's backward) and its normed input h (for the column matmuls' weight
    gradients), all (B, T, D) on every model rank: sequence parallelism keeps x split (1/M) and recomputes h from it
    in the backward (the gather included): 2 (M-1)/M + 2 of (B, T, D) per layer fewer. At remat full only each
    layer's input is kept: (M-1)/M of (B, T, D) per layer fewer. The program's residual stream is (B, T/M, D); at
    remat none the planner's temp within 10% of XLA's."""
    over = ["model.preset=125m", "train.batch_size=4", "mesh.data=1", "mesh.model=4", f"model.remat={remat}"]
    plain, split = (_measured(over + [f"train.sequence_parallel={sp}"]) for sp in ("false", "true"))
    # the compiled program's residual stream: (B, T/M, D) per device with it, never without
    assert "f32[4,512,768]" in split.text and "f32[4,512,768]" not in plain.text
    if remat == "none":  # the planner traces one rank's layer (trainer/plan/trace.py one_model_rank): within 10%
        from trainer.config import load_config, model_config
        from trainer.hardware import get_device
        from trainer.plan.core import estimate, strategy_of
        cfg = load_config(TINY + over + ["train.sequence_parallel=true"])
        p = estimate(model_config(cfg), cfg.train, strategy_of(cfg, 4), get_device("h100"), 1, "float32", "cpu")
        planned = p.activations_bytes + p.grads_bytes + p.buffers_bytes
        assert abs(planned / split.temp_bytes - 1) < 0.10, (planned, split.temp_bytes)
    plain, split = plain.temp_bytes, split.temp_bytes
    BTD, L, M = 4 * 2048 * 768 * 4, 12, 4
    fewer = L * BTD * ((2 * (M - 1) / M + 2) if remat == "none" else (M - 1) / M)
    print(f"remat {remat}: temp {plain / 1e6:.1f} MB -> {split / 1e6:.1f} MB (hand count {fewer / 1e6:.1f} MB)")
    # the whole count at remat none: keeping the gathered h (jax#25010's trap) saves only 2 (M-1)/M per layer, and
    # XLA's other split buffers made up most of the rest (measured: 1000 MB fewer, under the 1057 MB counted)
    assert plain - split >= (1.0 if remat == "none" else 0.8) * fewer, (plain, split, fewer)


@pytest.mark.slow
def test_the_7b_tpu_program_needs_less_temp_memory():
    """The 7B on v5p:4x4x8 (data 16, model 8, ZeRO-3, 16 x 4096, remat full, bfloat16), compiled ahead of time by
    XLA:TPU (libtpu in the venv): temp per chip with sequence parallelism below without it (measured: 1.219 GB
    against 2.585 GB on jaxlib 0.10.2; 1.244 GB on jax 0.12)."""
    pytest.importorskip("libtpu")
    from trainer.config import load_config
    from trainer.plan.aot import compile_for
    base = ["model.preset=7b", "mesh.data=-1", "mesh.model=8", "train.zero_stage=3", "train.batch_size=16",
            "model.seq_len=4096", "model.remat=full", "train.dtype=bfloat16"]
    plain, split = (compile_for(load_config(base + [f"train.sequence_parallel={sp}"]), "v5p:4x4x8").measured.temp_bytes
                    for sp in ("false", "true"))
    print(f"7B on v5p:4x4x8: temp {plain / 1e9:.3f} GB -> {split / 1e9:.3f} GB")
    assert split < 0.6 * plain, (plain, split)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_the_small_tpu_program_at_remat_none_needs_less_temp_memory(zero):
    """XLA:TPU at the default remat (none), where autodiff would keep each column matmul's gathered input: the small
    preset (T 1024, bfloat16) at (2,1,4) on v5p:2x2x2 needs less temp with sequence parallelism than without, at
    ZeRO 0 and 3 (measured, jaxlib 0.10.2: 86.4 vs 91.3 MB and 92.3 vs 114.4 MB; the custom VJP's conditional that
    XLA:CPU needs (models/layers.py column_remat) held 95.5 MB at ZeRO 0 and failed libtpu 0.0.50 at ZeRO 3)."""
    pytest.importorskip("libtpu")
    from trainer.config import load_config
    from trainer.plan.aot import compile_for
    base = ["model.preset=small", "model.seq_len=1024", "train.batch_size=8", "mesh.data=2", "mesh.model=4",
            "train.dtype=bfloat16", f"train.zero_stage={zero}"]
    plain, split = (compile_for(load_config(base + [f"train.sequence_parallel={sp}"]), "v5p:2x2x2").measured.temp_bytes
                    for sp in ("false", "true"))
    print(f"ZeRO-{zero}: temp {plain / 1e6:.1f} MB -> {split / 1e6:.1f} MB")
    assert split < plain, (plain, split)


@pytest.mark.slow
def test_the_pipeline_hops_carry_a_model_rank_s_tokens():
    """(1,2,4) 1F1B, 4 microbatches: the stage-to-stage hops (collective-permute over `stage` in the compiled
    program) send 1/M of the bytes with sequence parallelism (each model rank its T/M tokens), as the planner
    counts them."""
    from trainer.config import load_config, model_config
    from trainer.hardware import get_device
    from trainer.plan.core import estimate, strategy_of
    from trainer.plan.verify import measure
    over = ["mesh.data=1", "mesh.stage=2", "mesh.model=4", "train.pipeline_schedule=1f1b", "train.microbatches=4"]
    sent = {}
    for sp in ("false", "true"):
        cfg = load_config(TINY + over + [f"train.sequence_parallel={sp}"])
        xla = measure(cfg, jax.devices()[:8], grads=False).collectives[("collective-permute", ("stage",))]
        plan = estimate(model_config(cfg), cfg.train, strategy_of(cfg, 8), get_device("h100"), 1, "float32", "cpu")
        planned = sum(t.bytes for t in plan.transfers if t.axis == "stage" and t.kind == "collective-permute")
        assert planned == pytest.approx(xla, rel=0.01), (sp, planned, xla)
        sent[sp] = xla
    assert sent["true"] == pytest.approx(sent["false"] / 4, rel=0.01), sent


PLANNED = {"2x1x4-none": ["mesh.data=2", "mesh.model=4"],
           "2x1x4-zero3-full": ["mesh.data=2", "mesh.model=4", "train.zero_stage=3", "model.remat=full"],
           "1x2x4-1f1b": ["mesh.data=1", "mesh.stage=2", "mesh.model=4", "train.pipeline_schedule=1f1b",
                          "train.microbatches=4"],
           "2x1x4-kv2": ["mesh.data=2", "mesh.model=4", "model.n_kv_heads=2"]}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "2x1x4-none" else pytest.mark.slow)
                                  for n in PLANNED])
def test_the_planner_counts_the_gathers_and_scatters_xla_compiles(name):
    """Every collective of the compiled step over `model` and over the other axes (trainer/plan/hlo.py reading the
    HLO) within 5% of the planner's (trainer/plan/split_residual.py): the reduce-scatters (XLA:CPU's all-reduce and
    slice), the column inputs' gathers forward and again for the weight gradients, the cotangents' gathers, the
    vocab-split embedding looked up whole along the sequence (no gathered table) and the head's ends."""
    from trainer.config import load_config, model_config
    from trainer.hardware import get_device
    from trainer.plan.core import estimate, strategy_of
    from trainer.plan.verify import measure
    cfg = load_config(TINY + PLANNED[name] + ["train.batch_size=8", "train.sequence_parallel=true"])
    m = measure(cfg, jax.devices()[:8], grads=False)
    plan = estimate(model_config(cfg), cfg.train, strategy_of(cfg, 8), get_device("h100"), 1, "float32", "cpu")
    assert plan.strategy.sequence_parallel and "sequence-parallel" in plan.strategy.describe()
    for axis in {a for _, axes in m.collectives for a in axes} | {t.axis for t in plan.transfers}:
        xla = sum(b for (kind, axes), b in m.collectives.items() if ",".join(axes) == axis)
        planned = sum(t.bytes for t in plan.transfers if t.axis == axis)
        print(f"{name} {axis}: planned {planned:,.0f} XLA {xla:,.0f}")
        assert planned == pytest.approx(xla, rel=0.05), (axis, planned, xla)
    kinds = {kind for (kind, axes) in m.collectives if axes == ("model",)}
    assert "all-gather" in kinds  # gathered out of the split residual (XLA:CPU writes the scatters as all-reduces)


@pytest.mark.slow  # two searches (7 s); the default run checks the planner's bytes under sequence parallelism above
def test_the_search_weighs_sequence_parallelism_and_takes_it_where_only_it_fits():
    """plan --search tries each tensor-parallel layout with and without the split residual: on a tiny model of 512
    tokens over 2 devices with too little memory for the layout of mesh.model 2 without it, that layout fits with it (the
    same but for the split residual's activations), and where memory is plenty the faster, without, ranks first."""
    from trainer.config import load_config, model_config
    from trainer.hardware import get_device
    from trainer.plan.search import search
    cfg = load_config(TINY + ["model.seq_len=512", "train.batch_size=4"])
    mc, device = model_config(cfg), get_device("h100")
    ranked = search(mc, cfg.train, 2, device, 1, "float32", "cpu")
    tp = [p for p in ranked.plans if p.strategy.model == 2 and p.strategy.zero == 0 and p.strategy.remat == "none"
          and p.strategy.microbatches == 1]
    on, off = ([p for p in tp if p.strategy.sequence_parallel == sp] for sp in (True, False))
    assert len(on) == len(off) == 1, [p.strategy.describe() for p in tp]
    on, off = on[0], off[0]
    assert on.activations_bytes < 0.8 * off.activations_bytes and on.comm_bytes > off.comm_bytes
    assert off.step_s < on.step_s
    import dataclasses
    tight = dataclasses.replace(device, hbm=(on.total_bytes + off.total_bytes) / 2)
    fit = search(mc, cfg.train, 2, tight, 1, "float32", "cpu").plans
    assert any(p.strategy.describe() == on.strategy.describe() for p in fit)
    assert not any(p.strategy.describe() == off.strategy.describe() for p in fit)
