"""The real train step compiled ahead of time for an 8-chip TPU v5p topology (libtpu, no chip: nothing runs).

Each layout compiles in seconds at a small model whose widths are multiples of 128 (TPU tiles). The
checks: XLA:TPU's program runs the TPU kernels (the plain projections and the blockwise attention, read from
the named scopes in its HLO), bfloat16 compute, the planner's state bytes against XLA:TPU's, the
HLO reader on TPU loops (XLA:TPU writes no trip counts), and the collectives per axis where the
planner models XLA:TPU (docs/plan.md says where it does not yet).
"""
import importlib.util
import re

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (it installs on Linux x86_64: pip install -e '.[tpu]')")

# 8 chips; on v5p:2x2x2 XLA:TPU writes every reduce-scatter as an all-reduce, here it keeps them
TOPOLOGY = "v5p:2x4x1"
BASE = ["model.preset=small", "model.d_model=512", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=1024",
        "model.vocab_size=2048", "model.seq_len=128", "model.n_layers=2", "train.batch_size=16",
        "train.dtype=bfloat16"]
# one 128-wide head per rank on (2,2,2): XLA:TPU compiles it in about half the time of BASE's widths
NARROW = ["model.d_model=256", "model.n_heads=2", "model.d_ff=512", "model.vocab_size=1024", "train.batch_size=8"]
LAYOUTS = {
    "d8-zero3-tiled-loss": ["mesh.data=8", "mesh.model=1", "train.zero_stage=3", "model.loss_chunk=64"],
    "d2m4-kv-replicated": ["mesh.data=2", "mesh.model=4", "train.zero_stage=1"],  # 2 kv heads over 4 ranks
    "d2s2m2-1f1b-ring": NARROW + ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.pipeline_schedule=1f1b",
                                  "train.microbatches=2", "train.grad_sync=ring"],
}
_cache = {}


def _compiled(name):
    if name not in _cache:
        from trainer.config import load_config
        from trainer.plan.aot import compile_for
        _cache[name] = compile_for(load_config(BASE + LAYOUTS[name]), TOPOLOGY)
    return _cache[name]


def _scopes(text: str) -> set[str]:
    """Every name in the ops' names of an HLO module's metadata (jit(f)/jvp(kernels_reference)/dot_general:
    jit, f, jvp, kernels_reference, dot_general)."""
    return {w for name in set(re.findall(r'op_name="([^"]*)"', text)) for w in re.findall(r"[A-Za-z_]\w*", name)}


def kernel_problems(text: str) -> list[str]:
    """What in a compiled program is not the accelerator path: CPU fast paths, or an attention other than the
    blockwise one `auto` picks for TPU (XLA's keeps float32 (T, T) scores: models/kernels/attention.py select)."""
    scopes = _scopes(text)
    wrong = sorted(s for s in scopes if s in ("kernels_fast", "attention_xla"))
    missing = sorted({"kernels_reference", "attention_manual"} - scopes)
    return [f"ran {s}" for s in wrong] + [f"lacks {s}" for s in missing]


# the default run compiles one TPU program (test_the_tpu_programs_temp_holds_its_recorded_figure) and checks the
# kernels of one (test_forcing_the_cpu_fast_paths_into_the_tpu_program_is_caught); these under -m slow
SLOW_LAYOUTS = {"d2m4-kv-replicated", "d8-zero3-tiled-loss", "d2s2m2-1f1b-ring"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_LAYOUTS else [])
                                  for n in LAYOUTS])
def test_tpu_program_runs_tpu_kernels_and_the_planner_holds_its_state(name):
    """One compile per layout (a few seconds each), every check of that program in one test."""
    c = _compiled(name)
    m, p = c.measured, c.plan
    assert m.platform == "tpu" and c.device_kind == "TPU v5" and p.device.name == "tpu-v5p"
    assert kernel_problems(m.text) == []
    width = [o.split("=")[1] for o in BASE + LAYOUTS[name] if o.startswith("model.d_model=")][-1]
    assert p.dtype == "bfloat16" and re.search(rf"bf16\[\d+,\d+,{width}\]", m.text)  # bfloat16 activations
    # parameters + optimizer state: shapes the planner gets from the same rules table
    assert p.params_bytes + p.opt_state_bytes == pytest.approx(m.params_opt_bytes, rel=0.01)
    assert c.total_bytes < p.device.hbm and m.flops > 0
    kinds = {k for (k, axes), b in m.collectives.items() if axes == ("data",) and b}
    if "zero" in name:  # ZeRO-3 gradients are reduce-scattered over data (and the weights all-gathered)
        assert {"reduce-scatter", "all-gather"} <= kinds, kinds
    if "zero3" in name:  # the weights' gathers move bfloat16 (the step casts the layers', XLA:TPU the embedding's)
        gathers = [t for t in re.findall(r"= (\w+)\[[^\]]*\]\S* all-gather(?:-start)?\(", m.text)]
        assert gathers and set(gathers) == {"bf16"}, gathers
        mine = sum(t.bytes for t in p.transfers if t.axis == "data" and t.kind == "all-gather")
        assert mine == pytest.approx(m.collectives[("all-gather", ("data",))], rel=0.01)
    if "tiled" in name:  # the loss in tiles (models/objectives/cross_entropy.py), named in the program's stack frames
        assert '"tiled_cross_entropy' in m.text
    if "1f1b" in name:
        _pipeline_loops_are_counted(c)


def _pipeline_loops_are_counted(c):
    """XLA:TPU's loops carry no known_trip_count: the tick loop's trips come from its condition, each
    0-or-1-trip step's from the function its ops are scoped by; then the pipeline's hops over `stage`
    and its once-per-step ring sync over `data` are the planner's to the byte (within 1%)."""
    from trainer.plan import hlo
    from trainer.plan.report import by_axis
    from trainer.plan.schedule_cost import cost
    text = c.measured.text
    assert "known_trip_count" not in text
    comps, _ = hlo._computations(text)
    counted = [hlo._counted(comps, cond) for cond in re.findall(r"\bcondition=%([\w.\-]+)", text)]
    assert cost("1f1b", 2, c.plan.strategy.microbatches).ticks in counted  # the tick loop
    assert counted.count(None) == 3  # loss, backward and backward-with-embedding steps: data-dependent
    axes = by_axis(c.plan, c.measured)
    for axis in ("data", "stage"):
        mine, xla = axes[axis]
        assert mine == pytest.approx(xla, rel=0.01), axis


# (context 2 x stage 2 x model 2): ring attention inside a 1F1B pipeline, the vocabulary split over `model`; a model
# of one 128-wide head per rank, one layer per stage
RING_IN_PIPELINE = BASE + NARROW + ["mesh.data=1", "mesh.stage=2", "mesh.context=2", "mesh.model=2",
                                    "train.pipeline_schedule=1f1b", "train.microbatches=2",
                                    "train.context_attention=ring"]


@pytest.mark.slow  # the default run compiles a TPU program in test_the_tpu_programs_temp_holds_its_recorded_figure
def test_ring_in_a_pipeline_on_tpu_passes_blocks_and_gathers_the_embedding():
    """XLA:TPU's program of the ring inside a pipeline has neither of XLA:CPU's workarounds: each step of the ring is
    a collective-permute over `context` (the planner's bytes within 1%), no all-gather over `context` (on CPU: two
    within pairs of neighbours, meshes/collectives.py BRANCHED), and stage 0 embeds a microbatch by a gather of its
    vocabulary shard: no matmul (formerly a one-hot product, 2 x V x D FLOPs a token)."""
    from test_pipeline import embedding_ops
    from trainer.config import load_config
    from trainer.plan.aot import compile_for
    c = compile_for(load_config(RING_IN_PIPELINE), TOPOLOGY)
    m, p = c.measured, c.plan
    assert m.platform == "tpu" and not [x for x in kernel_problems(m.text) if x.startswith("ran")]  # ring: its own
    assert not [k for k in m.collectives if k[0] == "all-gather" and "context" in k[1] and m.collectives[k]]
    ring = sum(t.bytes for t in p.transfers if t.axis == "context" and t.kind == "collective-permute")
    assert ring > 0 and m.collectives[("collective-permute", ("context",))] == pytest.approx(ring, rel=0.01)
    ops = embedding_ops(m.text)
    assert "gather" in ops, ops
    assert not ops & {"dot", "convolution"}, ops


def test_a_condition_against_a_constant_is_a_trip_count():
    """_counted on hand-written HLO: `counter < 7` is 7 trips, unsigned too (XLA:TPU's windowed einsum loops count in
    u32); a data-dependent bound is unknown."""
    from trainer.plan.hlo import _computations, _counted
    text = """HloModule m

%cond (p: (s32[], f32[])) -> pred[] {
  %p = (s32[], f32[]) parameter(0)
  %c = s32[]{:T(128)} constant(7)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT
}

%data (p: (s32[], s32[])) -> pred[] {
  %p = (s32[], s32[]) parameter(0)
  %n = s32[] get-tuple-element(%p), index=1
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%windows (p: (u32[], f32[])) -> pred[] {
  %p = (u32[], f32[]) parameter(0)
  %c = u32[]{:T(128)} constant(4)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT
}
"""
    comps, _ = _computations(text)
    assert _counted(comps, "cond") == 7 and _counted(comps, "data") is None and _counted(comps, "windows") == 4


def test_forcing_the_cpu_fast_paths_into_the_tpu_program_is_caught(monkeypatch):
    """The kernel check can fail: with kernels_for patched to pick the CPU's kernels whatever the
    target, the TPU program runs them, and kernel_problems says so."""
    import models.transformer as T
    from trainer.config import load_config
    from trainer.plan.aot import compile_for
    real = T.kernels_for
    monkeypatch.setattr(T, "kernels_for", lambda c, platform=None: real(c, "cpu"))
    c = compile_for(load_config(["model.preset=tiny", "train.batch_size=16", "mesh.data=8"]), TOPOLOGY)
    assert kernel_problems(c.measured.text) == ["ran kernels_fast", "lacks kernels_reference"]


def test_compile_for_cli_prints_xla_tpu_beside_the_plan_and_refuses_bad_topologies(capsys):
    from trainer.cli import main
    assert main(["plan", "model.preset=tiny", "mesh.data=8", "train.batch_size=16", "--compile-for",
                 TOPOLOGY, "--json"]) == 0
    import json
    doc = json.loads(capsys.readouterr().out)
    assert doc["topology"] == TOPOLOGY and doc["predicted"]["devices"] == 8 and doc["xla_tpu"]["fits"]
    assert doc["xla_tpu"]["total_bytes"] == (doc["xla_tpu"]["argument_bytes"] + doc["xla_tpu"]["temp_bytes"]
                                             + doc["xla_tpu"]["output_bytes"] - doc["xla_tpu"]["alias_bytes"])
    for bad, says in (("v9:2x2", "is not a TPU topology"), ("v5p:3x3x3", "libtpu knows no such topology")):
        assert main(["plan", "--compile-for", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


# The guard (docs/plan.md): XLA:TPU's temp per chip of a small ZeRO-3 step whose head dominates (vocabulary 32000,
# T = 256) on v5p:2x2x2. `python scripts/bench/tpu_compare.py 6da7880 5cbc3bb --topology v5p:2x2x2 -- GUARD`: 0.182
# against 0.272 GB (+50%, from e7d493f); the head's weights gathered after the layers, their gradient reduce-scattered
# before the layers' backward (trainer/step.py _head_first): 0.144 GB under jax 0.10.2, 0.275 under 0.12.0.1 (whose
# XLA:TPU holds four whole float32 (32000, 512) buffers, the embedding's and head's gradients and their all-reduces,
# either way: its memory-usage report). Recorded with the jax and libtpu that compiled it; under others the test fails
# naming both, to be re-recorded on purpose (the same command at HEAD).
GUARD = ["model.preset=small", "model.d_model=512", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=1024",
         "model.vocab_size=32000", "model.seq_len=256", "model.n_layers=2", "train.batch_size=8",
         "train.dtype=bfloat16", "mesh.data=8", "mesh.model=1", "train.zero_stage=3", "model.remat=full"]
GUARD_TEMP = {("0.10.2", "0.0.42.1"): 144_036_608, ("0.12.0.1", "0.0.50.1"): 275_108_096}


def test_the_tpu_programs_temp_holds_its_recorded_figure():
    import importlib.metadata

    import jax
    from trainer.config import load_config
    from trainer.plan.aot import compile_for
    versions = (jax.__version__, importlib.metadata.version("libtpu"))
    recorded = ", ".join(f"jax {j} with libtpu {t}" for j, t in GUARD_TEMP)
    assert versions in GUARD_TEMP, (f"the guard's figure was recorded under {recorded}, this is jax {versions[0]} "
                                    f"with libtpu {versions[1]}: compile it here and record it in GUARD_TEMP")
    temp = compile_for(load_config(GUARD), "v5p:2x2x2").measured.temp_bytes
    assert abs(temp / GUARD_TEMP[versions] - 1) <= 0.02, (temp, GUARD_TEMP[versions])


@pytest.mark.slow
def test_7b_zero3_compiles_for_a_128_chip_v5p_pod(capsys):
    """The docs/plan.md command (about 50 s here): XLA:TPU's temp per chip at most MaxText 0.2.5's for the same shapes
    under the same jax and libtpu (6,030,067,360 B: docs/plan.md); with XLA's attention it does not fit: one line."""
    from trainer.cli import main
    args = ["plan", "model.preset=7b", "mesh.data=-1", "train.zero_stage=3", "train.batch_size=128", "--json",
            "--compile-for", "v5p:4x4x8"]
    assert main(args + ["model.remat=full"]) == 0
    import json
    doc = json.loads(capsys.readouterr().out)
    x, p = doc["xla_tpu"], doc["predicted"]
    assert doc["device_kind"] == "TPU v5" and p["devices"] == 128 and x["fits"]
    assert p["params_bytes"] + p["opt_state_bytes"] == pytest.approx(x["params_opt_bytes"], rel=0.01)
    assert x["temp_bytes"] <= 6_030_067_360, x["temp_bytes"]
    assert main(args + ["model.attention=xla"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RESOURCE_EXHAUSTED" in err[0] and "model.remat=full" in err[0], err


# MaxText 0.2.5's train_compile of llama2-7b, one sequence of 131,072 tokens, ici_context_parallelism=8, flash
# attention, remat full, v5p-16 (8 chips): XLA:TPU temp per chip under jax 0.12.0.1 and libtpu 0.0.50.1
# (docs/performance.md's long-context table)
MAXTEXT_7B_131K_TEMP = 24_690_000_000


@pytest.mark.slow
def test_7b_at_131072_tokens_over_8_v5p_chips_fits_in_maxtexts_memory(capsys):
    """docs/performance.md's long-context command for the ring (about a minute here): XLA:TPU's temp per chip at most
    1.05x MaxText's for the same model, sequence and chips, and the step fits by XLA:TPU's own figure (before the
    ring attended blockwise: 104.3 GB, and 95.9 GB while JAX's partial evaluation stacked its masks)."""
    import json

    from trainer.cli import main
    args = ["plan", "model.preset=7b", "model.seq_len=131072", "mesh.data=1", "mesh.context=8", "train.batch_size=1",
            "train.zero_stage=3", "train.dtype=bfloat16", "model.remat=full", "train.context_attention=ring",
            "--json", "--compile-for", "v5p:2x2x2"]
    assert main(args) == 0
    x = json.loads(capsys.readouterr().out)["xla_tpu"]
    assert x["fits"] and x["temp_bytes"] <= 1.05 * MAXTEXT_7B_131K_TEMP, x["temp_bytes"]


def test_with_libtpu_installed_a_cpu_process_starts_no_tpu_runtime(tmp_path):
    """JAX_PLATFORMS unset, libtpu installed, no chip: bare jax starts libtpu (its warnings on stderr);
    importing meshtrain first leaves TPU out (trainer/platforms.py): no warning, the CPU devices, and
    the processes it starts inherit that."""
    import os
    import subprocess
    import sys
    # as a fresh shell has it: no platform chosen, none of what --compile-for tells libtpu in this process
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "ALLOW_MULTIPLE_LIBTPU_LOAD") and not k.startswith("TPU_")}
    # While another process holds libtpu's lock (the other worker compiling for TPU), a bare jax skips libtpu without
    # a word: both probes may load it beside that process, so that each shows what it would do alone
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    probe = "import os, jax; print(jax.devices()[0].platform, os.environ.get('JAX_PLATFORMS'))"
    bare = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=tmp_path)
    ours = subprocess.run([sys.executable, "-c", "import trainer; " + probe], env=env, capture_output=True,
                          text=True, cwd=tmp_path)
    assert bare.returncode == 0 and "TPU" in bare.stderr  # the scenario is real: libtpu tries to start
    assert ours.returncode == 0 and ours.stderr == "" and ours.stdout.split() == ["cpu", "cpu"]
