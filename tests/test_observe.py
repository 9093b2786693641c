"""The FLOP convention against XLA, goodput, step lines and MFU, profiler traces, plots, `meshtrain generate`."""
import dataclasses
import functools
import gzip
import io
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

from conftest import TINY
from models import flops_per_token, from_preset, hardware_flops_per_token, loss_fn, matmul_param_count
from models.batch import abstract
from models.objectives.cross_entropy import cross_entropy
from models.layers import REMAT, rope_tables, sublayer_remat
from models.transformer import embed, head, layer, layer_call
from trainer import UserError, load_config, train
from trainer.data.batches import Batches
from trainer.observe.metrics import MetricsWriter
from trainer.config import step_range
from models import abstract_model

DATA_DELAY_S = 0.05
WRITE_DELAY_S = 0.05  # each metrics line written: time outside every measured part, so "other"


def _unrolled_loss(c, params, batch):
    """loss_fn with the layer scan written out (XLA's cost analysis counts a while body once), each
    layer remat'd as c.remat says (prevent_cse: XLA must not merge the recomputation away)."""
    x = embed(c, params, batch["tokens"], jnp.float32)
    rope = rope_tables(x.shape[1], c.head_dim, c.rope_theta)
    call = layer_call(c, rope, half=sublayer_remat) if c.remat == "sublayer" else layer_call(c, rope)
    f = lambda p, x: layer(c, p, x, call)[0]  # noqa: E731
    if c.remat not in ("none", "sublayer"):
        f = jax.checkpoint(f, policy=REMAT[c.remat], prevent_cse=True)
    for i in range(c.n_layers):
        x = f(jax.tree.map(lambda w: w[i], params["layers"]), x)
    return cross_entropy(head(c, params, x), batch["targets"], batch["loss_weight"]) / batch["loss_weight"].sum()


def _xla_flops_per_token(c, loss, batch=4):
    """XLA's FLOP count of value_and_grad(loss) on one device, per token."""
    shapes = abstract_model(c).params
    compiled = jax.jit(jax.value_and_grad(functools.partial(loss, c))).lower(shapes, abstract(batch, c.seq_len)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax returns one dict per program
    return cost["flops"] / (batch * c.seq_len)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_flop_convention_matches_xla(family):
    """XLA runs the full T x T masked attention, so its count includes the causal half the convention
    leaves out; the rest of the gap is elementwise work (norms, RoPE, softmax, SiLU, loss; Qwen's biases and
    q/k norms) the convention does not count. So: convention + masked half <= XLA < 1.05 x that."""
    c = from_preset("tiny", remat="none", family=family)
    xla = _xla_unrolled(c)
    masked_half = 6 * c.n_layers * c.seq_len * c.n_heads * c.head_dim
    executed = flops_per_token(c) + masked_half
    assert executed <= xla < 1.05 * executed, (xla, executed)
    if family != "llama":
        return
    # the unrolled program is the model's: with one layer the scan runs once and both agree
    one = from_preset("tiny", remat="none", n_layers=1)
    scan = _xla_flops_per_token(one, lambda c, p, b: loss_fn(c, p, b))
    assert abs(scan - _xla_flops_per_token(one, _unrolled_loss)) <= 1e-3 * scan


@pytest.mark.slow  # the windowed layout's planner check runs by default (tests/test_plan.py)
def test_windowed_flop_convention_against_xla():
    """A sliding window (Mistral, window 16, T = 64): the convention counts 12 L H Dh (w - w^2 / 2T) for
    attention, within 1% of the keys each query sees counted by hand (min(i + 1, w)). The CPU fast path computes
    a 16-query block against keys lo..b-1 (lo = a - w + 1): XLA's count must be that, plus elementwise work
    (< 5%), and far below the whole causal context's."""
    c = from_preset("tiny", remat="none", family="mistral", window=16, seq_len=64, attention_block=16)
    T, W, blk = 64, 16, 16
    per_key = 12 * c.n_layers * c.n_heads * c.head_dim
    attention = flops_per_token(c) - 6 * matmul_param_count(c)
    seen = sum(min(i + 1, W) for i in range(T)) / T
    assert abs(attention / per_key - seen) < 0.01 * seen, (attention / per_key, seen)
    computed = sum(blk * (a + blk - max(0, a - W + 1)) for a in range(0, T, blk)) / T
    executed = 6 * matmul_param_count(c) + per_key * computed
    xla = _xla_unrolled(c)
    assert executed <= xla < 1.05 * executed, (xla, executed)
    # the skipped blocks are not computed: the same model without a window runs its blocks' keys 0..b-1, at
    # least per_key FLOPs (and their softmax) more per key
    causal_blocks = sum(blk * (a + blk) for a in range(0, T, blk)) / T
    saved = _xla_unrolled(dataclasses.replace(c, window=None)) - xla
    assert per_key * (causal_blocks - computed) <= saved < 1.2 * per_key * (causal_blocks - computed), saved


@functools.lru_cache(maxsize=None)
def _xla_unrolled(c) -> float:
    return _xla_flops_per_token(c, _unrolled_loss)


def _xla_recomputed(c) -> tuple[float, float]:
    """(FLOPs per token XLA executes in addition under c.remat, i.e. the recomputation; XLA's FLOPs
    per token of the whole step)."""
    step = _xla_unrolled(c)
    return step - _xla_unrolled(dataclasses.replace(c, remat="none")), step


def _recompute_gap(c, hfu_over_mfu: float) -> float:
    """How far hfu's count of recomputed FLOPs (hfu/mfu - 1, times the model FLOPs) falls short of XLA's
    recomputation less the masked half of the recomputed attention (the convention counts causal attention
    only), in units of the whole step's FLOPs. Elementwise work (norms, RoPE, softmax, SiLU) the convention
    does not count makes it a little positive."""
    recomputed, step = _xla_recomputed(c)
    masked = 0 if c.remat == "none" else 2 * c.n_layers * c.seq_len * c.n_heads * c.head_dim
    return (recomputed - masked - (hfu_over_mfu - 1) * flops_per_token(c)) / step


@pytest.mark.parametrize("remat", ["none", "dots", "full", "sublayer"])
def test_recomputed_flops_match_xla(remat):
    """hfu counts what the backward pass recomputes: XLA's count, up to elementwise work under 2% of the step."""
    c = from_preset("tiny", remat=remat)
    gap = _recompute_gap(c, hardware_flops_per_token(c) / flops_per_token(c))
    assert 0 <= gap < 0.02, gap


def _slow_iterate(iterate):
    def slowed(self, *args, **kw):
        for item in iterate(self, *args, **kw):
            time.sleep(DATA_DELAY_S)
            yield item
    return slowed


def _slow_write(write):
    def slowed(self, record):
        time.sleep(WRITE_DELAY_S)
        return write(self, record)
    return slowed


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """4 tiny steps (remat=dots) on 2 devices with a 2:3 trace, every step logged, every batch held back
    DATA_DELAY_S and every metrics line WRITE_DELAY_S; the wall time of train() measured around it."""
    run_dir = tmp_path_factory.mktemp("traced")
    cfg = load_config(TINY + ["train.steps=4", "mesh.data=2", "run.log_every=1", "train.eval_every=2",
                              "train.eval_batches=1", "train.profile_steps=2:3", "model.remat=dots",
                              f"run.dir={run_dir}"])
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Batches, "iterate", _slow_iterate(Batches.iterate))
        mp.setattr(MetricsWriter, "write", _slow_write(MetricsWriter.write))
        t0 = time.perf_counter()
        result = train(cfg, jax.devices()[:2], Console(file=out, width=200))
        wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines += [json.loads(x) for x in (run_dir / "goodput.jsonl").read_text().splitlines()]
    return run_dir, result, lines, out.getvalue(), wall


def test_goodput_breakdown(traced_run):
    run_dir, result, lines, console, wall = traced_run
    g = lines[-1]
    assert g == {"step": 4, **result.goodput}
    parts = [g[f"time_{k}_s"] for k in ("compile", "compute", "data", "checkpoint", "eval", "other")]
    assert min(parts) >= 0
    # against clocks outside the accounting: the parts cover train()'s wall time, less its closing lines
    assert wall - 2.0 < sum(parts) <= wall, (sum(parts), wall)
    assert g["time_data_s"] >= 4 * DATA_DELAY_S  # the held-back batches are counted as data wait
    assert g["time_other_s"] >= 4 * WRITE_DELAY_S  # 4 metrics lines written outside every measured part
    assert g["time_compile_s"] > 0 and g["time_compute_s"] > 0 and g["time_eval_s"] > 0
    assert g["time_checkpoint_s"] > 0  # the final save
    assert g["goodput"] == pytest.approx(g["time_compute_s"] / g["time_total_s"])
    assert re.search(r"goodput [\d.]+% of [\d.]+s: compile [\d.]+s \(\d+%\) \| compute", console)


def test_step_lines_show_metrics_and_mfu(traced_run):
    run_dir, result, lines, console, _ = traced_run
    steps = [r for r in lines if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert 0 < r["mfu"] < r["hfu"] < 1
        assert 0 <= _recompute_gap(result.setup.model, r["hfu"] / r["mfu"]) < 0.02  # remat=dots: XLA's recomputation
        assert r["tokens_per_sec"] == pytest.approx(16 * 32 / r["step_time_s"])
        line = re.search(rf"step {r['step']}/4 \| loss ([\d.]+) \| grad norm ([\d.]+) \| lr (\S+) \| "
                         rf"([\d,]+) tok/s \| MFU ([\d.]+)%", console)
        assert line, console
        assert float(line.group(1)) == pytest.approx(r["loss"], abs=1e-3)
        assert float(line.group(2)) == pytest.approx(r["grad_norm"], abs=1e-3)
        assert float(line.group(3)) == pytest.approx(r["lr"], rel=1e-2, abs=1e-9)
        assert float(line.group(5)) == pytest.approx(100 * r["mfu"], abs=0.06)


def test_profile_trace_covers_requested_steps(traced_run):
    run_dir = traced_run[0]
    runs = list((run_dir / "tensorboard" / "plugins" / "profile").iterdir())
    assert len(runs) == 1 and list(runs[0].glob("*.xplane.pb"))
    (trace,) = runs[0].glob("*.trace.json.gz")
    events = json.load(gzip.open(trace))["traceEvents"]
    traced = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    assert traced == [2, 3]


def test_profile_steps_parsing():
    assert load_config(["train.profile_steps=5:8"]).train.profile_steps == "5:8"  # not YAML's 308
    key = "train.profile_steps"
    assert step_range("5:8", key) == (5, 8) and step_range("", key) is None
    for bad in ("8:5", "0:3", "5", "a:b"):
        with pytest.raises(UserError, match="train.profile_steps"):
            step_range(bad, key)
    # the same parser reads train.inject_nan_at, where a single step is allowed too
    assert step_range("5", "train.inject_nan_at", single=True) == (5, 5)
    with pytest.raises(UserError, match="train.inject_nan_at='5:2' is not STEP or A:B"):
        step_range("5:2", "train.inject_nan_at", single=True)


def _color_pixels(img, rgb):
    return int((np.abs(img[..., :3] - np.array(rgb) / 255).max(axis=-1) < 0.08).sum())


def test_plot_overlays_two_runs(traced_run, tmp_path):
    import matplotlib.image
    from trainer.observe.plot import plot_runs
    other = tmp_path / "other"
    other.mkdir()
    recs = [{"step": s, "loss": 6.0 - s, "tokens_per_sec": 900.0 + s, "mfu": None} for s in (1, 2, 3, 4)]
    recs += [{"step": 2, "eval_loss": 4.5}, {"step": 4, "eval_loss": 3.5}]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 5, "lo')
    out = tmp_path / "runs.png"
    shown = plot_runs([str(traced_run[0]), str(other)], str(out))
    assert shown == {"loss": 2, "eval_loss": 2, "eval_bpb": 1, "tokens_per_sec": 2, "mfu": 1}
    img = matplotlib.image.imread(out)
    assert img.shape[:2] == (700, 1500)
    h, w, m = img.shape[0] // 2, img.shape[1] // 3, 100  # m: tight_layout may widen a panel past its third
    quads = {"eval_loss": img[:h, w + m:2 * w], "eval_bpb": img[:h, 2 * w + m:], "tokens_per_sec": img[h:, :w],
             "mfu": img[h:, w + m:2 * w]}
    blue, orange = (31, 119, 180), (255, 127, 14)  # matplotlib's C0 and C1: run 1 and run 2
    for name in ("eval_loss", "tokens_per_sec"):
        assert _color_pixels(quads[name], blue) > 20 and _color_pixels(quads[name], orange) > 20, name
    for name in ("mfu", "eval_bpb"):  # the second run logged no MFU and predates eval_bpb
        assert _color_pixels(quads[name], blue) > 20 and _color_pixels(quads[name], orange) == 0, name


def test_plot_bad_input(tmp_path):
    from trainer.observe.plot import plot_runs
    with pytest.raises(UserError, match="no metrics.jsonl"):
        plot_runs([str(tmp_path)], str(tmp_path / "x.png"))


@pytest.mark.slow
def test_bench_config_mfu_on_cpu(tmp_path):
    """The bench config (4 x 256 wide, seq 256, batch 4, float32, 1 device): MFU is logged, in (0, 1)."""
    cfg = load_config(["model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
                       "model.d_ff=1024", "model.vocab_size=256", "model.seq_len=256", "train.batch_size=4",
                       "train.dtype=float32", "mesh.data=1", "train.steps=6", "run.log_every=1",
                       "run.progress=false", "train.eval_every=0", f"run.dir={tmp_path}"])
    result = train(cfg, jax.devices()[:1])
    mfus = [r["mfu"] for r in result.history if "mfu" in r]
    assert len(mfus) == 6 and all(0 < m < 1 for m in mfus), mfus


def test_generate_cli_restores_and_streams(traced_run, capsys):
    """The CLI restores the 2-device run's checkpoint onto one device and prints what the final
    in-memory parameters decode greedily."""
    from models.decode import generate
    from trainer.cli import main
    run_dir, result = traced_run[:2]
    assert main(["generate", "--run", str(run_dir), "--prompt", "def ", "--tokens", "12", "--temperature", "0",
                 "--top_k", "0"]) == 0
    params = jax.device_get(result.state["params"])
    toks = [int(t[0]) for t in generate(result.setup.model, params, np.array([list(b"def ")], np.int32), 12)]
    assert capsys.readouterr().out == "def " + bytes(toks).decode("utf-8", errors="replace") + "\n"


@pytest.mark.parametrize("args,msg", [(["--tokens", "0"], "--tokens 0 must be at least 1"),
                                      (["--temperature", "-1"], "--temperature"),
                                      ([], "holds no checkpoints")])
def test_generate_bad_input(tmp_path, capsys, args, msg):
    from trainer.cli import main
    assert main(["generate", "--run", str(tmp_path)] + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain: error:") and msg in err and err.count("\n") == 1
