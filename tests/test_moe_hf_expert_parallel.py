"""Hugging Face MoE checkpoints onto expert parallelism (the experts split over `data`): the Mixtral and Qwen3-MoE
fixtures (tests/fixtures/hf, made by transformers) imported into (4,1,2) ZeRO-3 with one expert per data rank give
transformers' logits (1e-4) and greedy tokens; exported back from that layout they are bitwise the fixture; and
imported by 2 processes x 4 devices, each process reads, of the experts' tensors, exactly the bytes of the experts its
devices hold (tests/hf_ranges_child.py records every byte the import reads)."""
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import SGD, TINY
from hf_check import FIX, read_folder
from test_moe_hf import _one_forward

ROOT = Path(__file__).resolve().parents[1]
EP = ["mesh.data=4", "mesh.stage=1", "mesh.model=2", "train.zero_stage=3", "train.expert_parallel=true"]
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _loaded(name):
    import jax
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    cfg = resolve(load_config(TINY + SGD + EP + ["train.batch_size=4", f"model.init_from={FIX / name}",
                                                 "model.seq_len=23"]))
    s = make_setup(cfg, jax.devices()[:8])
    return s, init_params(s, cfg.model.init_from)


def _one_expert_per_data_rank(params):
    """Each device holds one expert of each expert weight (dim 1 of (layers, experts, ...)), the same one on the two
    devices of a data rank, and each expert's hidden units split in two over them."""
    for k in ("expert_gate", "expert_up", "expert_down"):
        a = params["layers"][k]
        assert {sh.data.shape[1] for sh in a.addressable_shards} == {1}, k
        by_expert = {}
        for sh in a.addressable_shards:
            by_expert.setdefault(range(a.shape[1])[sh.index[1]][0], []).append(sh.data.size)
        assert sorted(by_expert) == [0, 1, 2, 3] and all(len(v) == 2 for v in by_expert.values()), k
        assert all(n * 4 == a.size // 2 for v in by_expert.values() for n in v), k  # 1/4 experts x 1/2 of F


@pytest.mark.parametrize("name", [pytest.param("mixtral_e4k2_f32"),
                                  pytest.param("qwen3_moe_norm_f32")])
def test_expert_parallel_import_gives_transformers_logits_and_exports_bitwise(name, tmp_path):
    """(4,1,2) ZeRO-3, expert parallel: the reference tokens' logits and the long prompt's last 8 (1e-4), the greedy
    tokens; written back by the adapter from those shards, every tensor bitwise under its name."""
    from trainer.ckpt.hf_export import write_hf
    s, params = _loaded(name)
    assert s.model.n_experts == 4
    _one_expert_per_data_rank(params)
    ref = np.load(FIX / name / "reference.npz")
    got = _one_forward(s, params, ref)
    T, P, G = ref["tokens"].shape[1], ref["prompt"].shape[1], ref["greedy"].shape[1]
    LP, LG = ref["long_prompt"].shape[1], ref["long_greedy"].shape[1]
    assert np.abs(got[:2, :T] - ref["logits"]).max() < 1e-4
    assert np.abs(got[3, LP - 8:LP] - ref["long_logits"]).max() < 1e-4
    np.testing.assert_array_equal(got[2, P - 1:P + G - 1].argmax(-1), ref["greedy"][0])
    np.testing.assert_array_equal(got[3, LP - 1:LP + LG - 1].argmax(-1), ref["long_greedy"][0])
    write_hf(params, s.model, tmp_path / "own")
    src, out = read_folder(FIX / name), read_folder(tmp_path / "own")
    assert sorted(out) == sorted(src)
    for k, (code, a) in src.items():
        assert out[k][0] == code and out[k][1].shape == a.shape and out[k][1].tobytes() == a.tobytes(), k


def _tensor_bytes(path: Path) -> dict[str, range]:
    """Each tensor's bytes in a .safetensors file (offsets in the file), from its header, parsed here."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    return {k: range(8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in head.items() if k != "__metadata__"}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_read_only_the_bytes_of_their_experts(tmp_path):
    """Mixtral's fixture imported into (4,1,2) ZeRO-3 expert parallel by 2 processes of 4 CPU devices each: each
    process holds 2 of the 4 experts (the two disjoint) and, of the 24 expert tensors (2 layers x 4 experts x 3), reads
    every byte of those of its experts and no byte of the others'."""
    name = "mixtral_e4k2_f32"
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", JAX_PLATFORMS="cpu",
               XLA_FLAGS=re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
               + " --xla_force_host_platform_device_count=4")
    keys = TINY + SGD + EP + ["train.batch_size=4", f"model.init_from={FIX / name}", "model.seq_len=23",
                              f"dist.coordinator=127.0.0.1:{port}", "dist.num_processes=2"]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "hf_ranges_child.py"), str(tmp_path / f"{i}.json"),
                               *keys, f"dist.process_id={i}"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [log[-2000:] for log in logs]
    got = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    assert [g["process"] for g in got] == [0, 1]
    file = FIX / name / "model.safetensors"
    tensors = {k: r for k, r in _tensor_bytes(file).items() if EXPERT.search(k)}
    assert len(tensors) == 24
    held = []
    for g in got:
        assert len({tuple(v) for v in g["held"].values()}) == 1, g["held"]  # gate, up and down alike
        mine = set(g["held"]["expert_gate"])
        held.append(mine)
        read = [r for f, rs in g["read"].items() if Path(f).resolve() == file.resolve() for r in rs]
        read_bytes = set().union(*(range(a, b) for a, b in read))
        for k, r in tensors.items():
            touched = len(read_bytes.intersection(r))
            if int(EXPERT.search(k).group(1)) in mine:
                assert touched == len(r), (g["process"], k, touched, len(r))
            else:
                assert touched == 0, (g["process"], k, touched)
    assert [len(h) for h in held] == [2, 2] and held[0].isdisjoint(held[1]) and held[0] | held[1] == {0, 1, 2, 3}
