"""The cluster simulator: ring traffic, topology, the bubble, stragglers, and its command line."""
from pathlib import Path

import pytest

from meshes import mesh_shape
from models import param_count
from trainer.cli import main
from trainer.config import load_config, model_config
from trainer.hardware import get_device
from trainer.plan.simulate import point, ring_allreduce, simulate

BASE = ["model.preset=1b", "mesh.data=8", "mesh.stage=1", "mesh.model=1", "train.batch_size=64",
        "sim.max_devices=64", "sim.steps=16"]


@pytest.mark.parametrize("k", [2, 4, 8])
def test_ring_traffic_is_what_the_compiled_ring_sends(k):
    """Bytes per device and hops of the simulator's ring against trainer/parallel/sync.py's ring all-reduce as
    XLA compiles it on k devices: its collective-permutes, counted in the HLO."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from meshes import build_mesh
    from trainer.parallel import sync
    from trainer.plan.hlo import collective_ops
    mesh, n = build_mesh(data=k, model=8 // k), 8 * 1000  # floats per device
    r = sync.make("ring", "data", k)
    f = jax.shard_map(lambda x: r.all_reduce_tree({"g": x}, {"g": 0}, {"g": P()})["g"], mesh=mesh,
                      in_specs=P("data"), out_specs=P("data"), axis_names={"data"}, check_vma=False)
    with jax.set_mesh(mesh):
        text = jax.jit(f).lower(np.zeros((k * n,), np.float32)).compile().as_text()
    sent = [b for kind, _, b, _ in collective_ops(text, dict(mesh.shape)) if kind == "collective-permute"]
    bw, lat = 25e9, 1e-5
    sim = ring_allreduce(4 * n, k, bw, lat)
    assert sim.bytes == pytest.approx(sum(sent), rel=1e-12)
    assert sim.seconds == pytest.approx(sum(lat + b / bw for b in sent), rel=1e-12)  # one latency a hop


def test_ring_traffic_by_hand():
    """3 GB over 4 devices: 6 hops of 0.75 GB; at 25 GB/s and 10 us a hop, 6 x 30.01 ms. One device: nothing."""
    r = ring_allreduce(3.0e9, 4, 25e9, 1e-5)
    assert (r.bytes, r.seconds) == (pytest.approx(4.5e9, rel=1e-12), pytest.approx(0.18006, rel=1e-12))
    one = ring_allreduce(3.0e9, 1, 25e9, 1e-5)
    assert (one.bytes, one.seconds) == (0, 0)


def test_data_axis_traffic_of_a_step_inside_and_across_nodes():
    cfg = load_config(BASE + ["mesh.data=4", "mesh.model=2", "sim.hardware=a100"])
    mc, hw = model_config(cfg), get_device("a100")
    grad = param_count(mc) / 2 * 4  # float32 gradient of one model-parallel slice
    shape = mesh_shape({"data": 4, "model": 2})
    inside = point(cfg, mc, hw, shape, 4)  # 4 replicas x 2 fill one node of 8: one NVLink ring
    assert inside.data_comm.bytes == pytest.approx(2 * 3 / 4 * grad, rel=1e-12)
    across = point(cfg, mc, hw, shape, 16)  # 4 nodes x 4 members: ring of 4 inside, of 4 shards between
    assert across.data_comm.bytes == pytest.approx(2 * 3 / 4 * grad + 2 * 3 / 4 * grad / 4, rel=1e-12)
    assert across.data_comm.seconds == pytest.approx(
        ring_allreduce(grad, 4, hw.fast_bw, hw.fast_lat).seconds
        + ring_allreduce(grad / 4, 4, hw.net_bw, hw.net_lat).seconds, rel=1e-12)
    z3 = point(load_config(BASE + ["train.zero_stage=3"]), mc, hw, mesh_shape({"data": 8}), 8)
    assert z3.data_comm.bytes == pytest.approx(1.5 * 2 * 7 / 8 * param_count(mc) * 4, rel=1e-12)


def test_bubble_share_is_s_minus_1_over_m_plus_s_minus_1():
    quiet = ["sim.straggler=none", "sim.intra_bw=1e9", "sim.inter_bw=1e9"]  # only link latencies remain
    rows = simulate(load_config(BASE + ["mesh.data=2", "mesh.stage=2", "train.microbatches=4"] + quiet),
                    out=lambda *_: None)
    for r in rows:
        assert r["lost"]["stragglers"] == 0
        assert r["lost"]["bubble"] == pytest.approx((2 - 1) / (4 + 2 - 1), rel=5e-3)


def test_stragglers_cost_sync_more_as_k_grows_and_local_sgd_recovers_it():
    rows = simulate(load_config(BASE + ["sim.straggler=slow", "sim.slow_fraction=0.01", "sim.slow_factor=3",
                                        "sim.max_devices=1024", "sim.steps=64"]), out=lambda *_: None)
    lost = [r["lost"]["stragglers"] for r in rows]
    assert lost[0] < 0.05 < 0.3 < lost[-1]  # one device is rarely slow; 1,024 almost always include one
    big = rows[-1]
    assert big["mfu"]["local"] > 1.3 * big["mfu"]["sync"]
    assert big["local_bytes"] == pytest.approx(big["dp_bytes"] / big["H"])


def test_simulate_cli(tmp_path, capsys):
    plot = tmp_path / "sim.png"
    assert main(["simulate"] + BASE + [f"sim.plot={plot}"]) == 0
    assert "<- config" in capsys.readouterr().out and plot.stat().st_size > 0
    assert main(["simulate"] + BASE + ["sim.hardware=b200"]) == 2
    assert "sim.hardware='b200' is unknown" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[1].glob("docs/simulate/*.yaml")), ids=lambda p: p.stem)
def test_documented_comparisons_simulate(path):
    cfg = load_config([str(path), "sim.steps=8"])
    own = [r for r in simulate(cfg, out=lambda *_: None) if r["own"]]
    assert len(own) == 1 and 0.3 < own[0]["mfu"]["sync"] < own[0]["hfu"] <= 0.75


@pytest.mark.parametrize("sched,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1)])
def test_table_executor_step_follows_its_table(sched, v):
    """On the table executor (every schedule, gpipe too): the bubble is the table's idle cells, both hops
    run every tick of the table, the top gradients are summed over `stage`, and the stage's share of the gradients (its layers, the whole top) syncs once, after the tick loop."""
    from trainer.parallel import schedules
    S, M, K = 4, 8, 2
    cfg = load_config(BASE + ["mesh.data=2", "mesh.stage=4", "train.microbatches=8", f"train.pipeline_schedule={sched}",
                              f"train.pipeline_repeats={v}", "train.zero_stage=3", "sim.overlap=0.5"])
    mc, hw = model_config(cfg), get_device("h100")
    p = point(cfg, mc, hw, mesh_shape({"data": K, "stage": S}), K)
    table = schedules.build(sched, S, M, v)
    idle = sum(op is None for row in table for op in row) / (len(table) * S)
    assert p.bubble == pytest.approx(p.compute * idle / (1 - idle), rel=1e-12)
    act = 64 // K // M * mc.seq_len * mc.d_model * 2  # one microbatch's bfloat16 residual stream
    top = mc.vocab_size * mc.d_model + mc.d_model  # tied embedding and head, final norm
    hops = 2 * len(table) * (hw.fast_lat + act / hw.fast_bw)
    stage_sum = 2 * (S - 1) * (hw.fast_lat + 4 * top / S / hw.fast_bw)  # ring all-reduce over the stages
    if v == 1:
        assert p.pipeline == pytest.approx(hops + stage_sum, rel=1e-9)
    else:  # plus the blocks stored on one stage and run on another, there and back
        assert p.pipeline > hops + stage_sum
    share = (param_count(mc) - top) / S + top
    assert p.data_comm.bytes == pytest.approx(2 * (K - 1) / K * share * 4, rel=1e-12)  # ZeRO-3: gather + scatter
    assert p.data_exposed == p.data_comm.seconds  # nothing left to overlap after the loop
