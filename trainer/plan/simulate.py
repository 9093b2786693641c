"""`meshtrain simulate`: utilization of K accelerators, step by step, as the cluster grows.

The model and mesh come from the same config as `train`/`plan`; the `sim.*` keys describe the
machine. Devices are placed mesh-order (model innermost, then stage, then data), `devices_per_node`
to a node: fast links inside a node (NVLink / ICI), the network between nodes (InfiniBand / DCN).
Per step and device:
  compute   hardware FLOPs (remat included) / (peak x sim.efficiency), times a straggler factor
            drawn per device and step: lognormal exp(sigma z) and/or, with probability
            slow_fraction, slow_factor x slower.
  bubble    the schedule table's idle share (trainer/plan/schedule_cost.py cost).
  tensor    4 activation all-reduces per layer and microbatch (6 with full remat), not overlapped.
  pipeline  the table executor (trainer/parallel/pipeline.py): one activation send forward and one
            cotangent send back every tick of the table (idle ticks too), the stage all-reduce of
            the embedding/head gradients and, with V > 1, the layer blocks moved to their circular
            stages and back.
  data      the gradient ring all-reduce (ZeRO-3: all-gather twice + reduce-scatter = 1.5x),
            sim.overlap x compute of it hidden behind the backward pass. A pipeline syncs the
            stage's share once, after its tick loop (ZeRO-3: one all-gather before it, one
            reduce-scatter after: 1x), with nothing left to hide it behind.
A ring all-reduce of S bytes over K devices takes 2(K-1) steps of S/K bytes, each costing latency +
S/K / bandwidth (trainer/parallel/collective_costs.py); the devices' figures are trainer/hardware.py's. Groups
that span nodes all-reduce hierarchically: rings inside nodes, then a ring of shards between them.
Training modes: sync waits for the slowest device every step; local-SGD(H) lets replicas run H
steps apart, then waits once and all-reduces the parameters; async never waits (each replica
pushes 2 x its gradient to sharded parameter servers), at the price of updates d-1 steps stale.
Weak scaling: `data` grows with K; rows per replica, microbatches, stage and model stay fixed.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from meshes import DATA, MODEL, STAGE, MeshShape, devices_named
from models import ModelConfig, flops_per_token, hardware_flops_per_token, param_count
from trainer.config import Config, model_config, validate
from trainer.parallel.collective_costs import bus_factor, ring_seconds
from trainer.errors import UserError
from trainer.parallel.circular import circular_moves
from trainer.hardware import GB, Device, get_device
from trainer.plan.schedule_cost import cost
from trainer.plan.types import Transfer

DRAWS = 2 ** 25  # straggler factors drawn per cluster size, at most (float64: 256 MB)


def ring_allreduce(size: float, k: int, bw: float, lat: float) -> Transfer:
    """Reduce-scatter (K-1 steps) then all-gather (K-1 steps) of `size` bytes around K devices."""
    return Transfer(DATA, "all-reduce", "ring all-reduce", bus_factor("all-reduce", k) * size,
                    seconds=ring_seconds("all-reduce", size, k, bw, lat))


def hop(hw: Device, k: int, stride: int) -> tuple[float, float]:
    """(bandwidth, latency) of the links of a group of k devices `stride` apart in mesh order."""
    if stride * k <= hw.node:
        return hw.fast_bw, hw.fast_lat
    return hw.net_bw, hw.net_lat


def group_allreduce(hw: Device, size: float, k: int, stride: int) -> Transfer:
    """All-reduce over k devices `stride` apart: one ring inside a node; across n nodes with c
    members each, hierarchical (NCCL / XLA multi-slice): a ring inside each node, a ring of the
    nodes' 1/c shards between nodes (each member drives its own NIC), then the gather inside."""
    c = max(1, min(k, hw.node // stride))
    if c >= k:
        return ring_allreduce(size, k, hw.fast_bw, hw.fast_lat)
    inside = ring_allreduce(size, c, hw.fast_bw, hw.fast_lat)
    across = ring_allreduce(size / c, k // c, hw.net_bw, hw.net_lat)
    return dataclasses.replace(inside, bytes=inside.bytes + across.bytes, seconds=inside.seconds + across.seconds)


@dataclasses.dataclass
class Point:
    """One cluster size: the nominal per-step costs (seconds per device) and what they do to MFU."""
    devices: int
    data: int
    batch: int
    model_flops: float
    hw_flops: float
    compute: float
    bubble: float
    tensor: float
    pipeline: float
    data_comm: Transfer  # the synchronous step's data-axis traffic
    param_sync: Transfer  # local SGD: one all-reduce of the parameters
    data_exposed: float
    async_comm: float


def hardware(cfg: Config) -> Device:
    """The simulated device: its row of the device table, with the sim.* overrides."""
    sim = cfg.sim
    hw = get_device(sim.hardware, key="sim.hardware")
    over = {"node": sim.devices_per_node, "fast_bw": sim.intra_bw and sim.intra_bw * GB,
            "net_bw": sim.inter_bw and sim.inter_bw * GB}
    return dataclasses.replace(hw, **{k: v for k, v in over.items() if v})


def point(cfg: Config, mc: ModelConfig, hw: Device, shape: MeshShape, data: int) -> Point:
    """Nominal costs of one training step with `data` replicas of the config's block (its mesh less `data`)."""
    t, sim = cfg.train, cfg.sim
    s, m = shape[STAGE], shape[MODEL]
    rows = t.batch_size // shape[DATA]  # per replica, kept as the cluster grows
    k, mb = data * (shape.devices // shape[DATA]), t.microbatches
    tokens = rows * data * mc.seq_len
    model_flops, hw_flops = flops_per_token(mc) * tokens, hardware_flops_per_token(mc) * tokens
    compute = hw_flops / (k * hw.peak_bf16 * sim.efficiency)
    v = getattr(t, "pipeline_repeats", 1)
    piped = s > 1  # trainer/parallel/pipeline.py runs every schedule from its table
    idle = cost(t.pipeline_schedule, s, mb, v).bubble if piped else 0.0
    bubble = compute * idle / (1 - idle)
    act_bytes = 4 if t.dtype == "float32" else 2
    act = rows / mb * mc.seq_len * mc.d_model * act_bytes  # one microbatch's activations
    per_layer = 6 if mc.remat == "full" else 4
    tensor = mb * (mc.n_layers // s) * per_layer * group_allreduce(hw, act, m, 1).seconds
    pipeline = 0.0
    grad = param_count(mc) / (s * m) * 4  # float32 gradients, this device's (stage, model) slice
    if piped:  # every stage holds (and syncs) the whole embedding, head and final norm beside its layers
        pipeline = _table_pipeline(mc, hw, t.pipeline_schedule, s, m, mb, v, act)
        grad = (param_count(mc) + (s - 1) * _top_params(mc)) / (s * m) * 4
    plain = ring = group_allreduce(hw, grad, data, s * m)
    if t.zero_stage >= 3 and not piped:  # all-gather in the forward and the backward, reduce-scatter: 1.5 rings
        ring = dataclasses.replace(ring.times(1.5), kind="all-gather x2, reduce-scatter", count=3)
    elif t.zero_stage >= 3:  # once per step: all-gather before the tick loop, reduce-scatter after it
        ring = dataclasses.replace(ring, kind="all-gather, reduce-scatter", count=2)
    exposed = max(0.0, ring.seconds - (0.0 if piped else sim.overlap) * compute)
    bw, lat = hop(hw, data, s * m)
    push_pull = 2 * grad / bw + 2 * lat if data > 1 else 0.0
    return Point(k, data, rows * data, model_flops, hw_flops, compute, bubble, tensor, pipeline, ring, plain,
                 exposed, max(0.0, push_pull - sim.overlap * compute))


def _table_pipeline(mc: ModelConfig, hw: Device, schedule: str, s: int, m: int, mb: int, v: int,
                    act: float) -> float:
    """Seconds of the table executor's stage traffic: two hops every tick, the top gradients summed
    over `stage`, and with v > 1 the layer blocks moved to their circular stages and back."""
    pbw, plat = hop(hw, 2, m)
    hops = 2 * cost(schedule, s, mb, v).ticks * (plat + act / pbw)
    total = hops + group_allreduce(hw, _top_params(mc) / m * 4, s, m).seconds  # float32 gradients
    if v > 1:  # each stage sends the blocks it stores but does not run, one ppermute per group
        layers = (param_count(mc) - _top_params(mc)) / (s * m) * 4
        moved = sum(b // v != b % s for b in range(s * v)) / (s * v)
        groups = sum(1 for g in circular_moves(s, v) if g[0])
        total += 2 * (groups * plat + moved * layers / pbw)
    return total


def _top_params(mc: ModelConfig) -> int:
    """Parameters outside the layer stack: embedding, head unless tied, final norm."""
    return (1 if mc.tie_embeddings else 2) * mc.vocab_size * mc.d_model + mc.d_model


def straggler_factors(cfg: Config, steps: int, k: int, rng) -> np.ndarray:
    """(steps, k) multipliers of each device's compute time."""
    sim = cfg.sim
    f = np.ones((steps, k))
    if sim.straggler == "lognormal":
        f *= np.exp(sim.sigma * rng.standard_normal((steps, k)))
    elif sim.straggler == "slow":
        f *= np.where(rng.random((steps, k)) < sim.slow_fraction, sim.slow_factor, 1.0)
    return f


def drawn_steps(cfg: Config, h: int) -> int:
    """Steps simulated per cluster size: sim.steps, whole blocks of local SGD's h."""
    return max(1, cfg.sim.steps // h) * h


def step_times(cfg: Config, p: Point, h: int, rng) -> dict:
    """Mean seconds per step for sync, local-SGD(h) and async, from simulated straggler draws."""
    s_m = p.devices // p.data
    n = drawn_steps(cfg, h)
    f = straggler_factors(cfg, n, p.devices, rng).reshape(n, p.data, s_m)
    work = p.compute + p.bubble  # the pipeline stretches with its slowest stage
    fixed = p.tensor + p.pipeline
    replica = f.max(axis=2)  # (steps, data): a replica is itself synchronous
    sync = work * f.max(axis=(1, 2)) + fixed + p.data_exposed
    blocks = (work * replica + fixed).reshape(n // h, h, p.data).sum(axis=1)  # (blocks, data)
    local = (blocks.max(axis=1) + p.param_sync.seconds) / h  # averaging waits; nothing to overlap it with
    per_replica = (work * replica + fixed + p.async_comm).mean(axis=0)
    async_ = p.data / np.sum(1.0 / per_replica)  # replicas' rates add up
    return {"sync": float(sync.mean()), "local": float(local.mean()), "async": float(async_),
            "straggle": float(work * (f.max(axis=(1, 2)).mean() - 1.0))}


def cluster_sizes(shape: MeshShape, max_devices: int) -> list[int]:
    """Replica counts: powers of two up to max_devices, plus the config's own."""
    block = shape.devices // shape[DATA]
    ds = {shape[DATA]} | {2 ** i for i in range(0, 40) if 2 ** i * block <= max_devices}
    return sorted(ds)


def check(cfg: Config) -> MeshShape:
    """The config's mesh shape on its cluster, once the cluster sizes' straggler draws are known to fit."""
    sim = cfg.sim
    named = devices_named(cfg.mesh)
    if named is None and not sim.devices:
        raise UserError("simulate needs the cluster size: give every mesh axis a size, or set sim.devices")
    shape = validate(cfg, sim.devices or named)  # sim.* keys' ranges and choices too (trainer/config/sections.py)
    largest = max(cluster_sizes(shape, sim.max_devices)) * (shape.devices // shape[DATA])
    n = drawn_steps(cfg, local_h(cfg))
    if n * largest > DRAWS:
        raise UserError(f"simulate would draw {n} steps x {largest} devices = {n * largest} straggler factors, more "
                        f"than {DRAWS} (256 MB of float64); lower sim.steps, sim.max_devices, the mesh or "
                        "train.sync_every (local SGD's H)")
    return shape


def local_h(cfg: Config) -> int:
    """Local SGD's H: train.sync_every, at least 2 (1 would be synchronous)."""
    return max(getattr(cfg.train, "sync_every", 8), 2)


def simulate(cfg: Config, out=print) -> list[dict]:
    """Rows of (K, MFU and goodput per mode, loss breakdown) as `data` grows; prints a table."""
    shape = check(cfg)
    mc, hw = model_config(cfg), hardware(cfg)
    h = local_h(cfg)
    rng = np.random.default_rng(cfg.sim.seed)
    out(f"model {param_count(mc) / 1e9:.3g}B params | mesh {shape.describe()} | "
        f"{cfg.sim.hardware}: "
        f"{hw.peak_bf16 / 1e12:.0f} TFLOP/s, {hw.node}/node, {hw.fast_bw / GB:.0f} | {hw.net_bw / GB:.3g} GB/s "
        f"in | between nodes | efficiency {cfg.sim.efficiency:.2f}, overlap {cfg.sim.overlap:.2f}, "
        f"stragglers {cfg.sim.straggler}")
    out(f"{'K':>6} {'data':>5} {'batch':>6} | {'MFU':>5} {'HFU':>5} {'goodput':>7} {'lost: straggle':>14} "
        f"{'comm':>5} {'bubble':>6} | {'local(H=' + str(h) + ')':>10} {'async':>5} | DP GB/device/step sync, local")
    rows = []
    for data in cluster_sizes(shape, cfg.sim.max_devices):
        p = point(cfg, mc, hw, shape, data)
        t = step_times(cfg, p, h, rng)
        mfu = {mode: p.model_flops / (t[mode] * p.devices * hw.peak_bf16) for mode in ("sync", "local", "async")}
        comm = p.tensor + p.pipeline + p.data_exposed
        lost = {"stragglers": t["straggle"] / t["sync"], "communication": comm / t["sync"],
                "bubble": p.bubble / t["sync"]}
        row = {"devices": p.devices, "data": data, "batch": p.batch, "mfu": mfu,
               "hfu": p.hw_flops / (t["sync"] * p.devices * hw.peak_bf16), "goodput": p.compute / t["sync"],
               "lost": lost, "dp_bytes": p.data_comm.bytes,
               "local_bytes": p.param_sync.bytes / h, "step_s": t, "H": h,
               "own": data == shape[DATA]}
        rows.append(row)
        gb, gb_local = p.data_comm.bytes / GB, p.param_sync.bytes / GB
        out(f"{p.devices:>6} {data:>5} {p.batch:>6} | {mfu['sync']:>5.1%} {row['hfu']:>5.1%} {row['goodput']:>7.1%} "
            f"{lost['stragglers']:>14.1%} {lost['communication']:>5.1%} {lost['bubble']:>6.1%} | "
            f"{mfu['local']:>10.1%} {mfu['async']:>5.1%} | {gb:.3g}, {gb_local / h:.3g}" + ("  <- config" if row["own"] else ""))
    worst = rows[-1]["lost"]
    main = max(worst, key=worst.get)
    out(f"at K={rows[-1]['devices']}: synchronous utilization is lost mostly to {main} "
        f"({worst[main]:.1%} of the step); local-SGD(H={h}) MFU {rows[-1]['mfu']['local']:.1%}, "
        f"async {rows[-1]['mfu']['async']:.1%} (async updates are {rows[-1]['data'] - 1} steps stale)")
    return rows


def plot(rows: list[dict], path: str, title: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ks = [r["devices"] for r in rows]
    h = rows[0]["H"]
    for mode, label in (("sync", "synchronous"), ("local", f"local SGD (H={h})"), ("async", "asynchronous")):
        ax.plot(ks, [100 * r["mfu"][mode] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("accelerators K")
    ax.set_ylabel("MFU (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
