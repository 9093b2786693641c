"""The hardware: the one device table (peak FLOP/s, memory, links and node size, each with its source)
and the matmul rate of this host, measured in this process.

Read by `meshtrain plan`, `meshtrain simulate` and the MFU of `meshtrain train`
(trainer/observe/metrics.py). Bandwidths are bytes/s one device sends in one direction, the
figure a ring collective's bus bytes are divided by: `fast` inside a node (NVLink) or ICI slice,
`net` across them (InfiniBand / data-center network). A bidirectional datasheet figure is halved.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from trainer.errors import UserError

GB = 1e9
GIB = 2 ** 30
US = 1e-6
PEAK_N, PEAK_REPS = 1024, 8  # the CPU peak: an n x n x n matmul, the fastest of reps runs


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_bf16: float  # dense FLOP/s
    peak_f32: float  # dense FLOP/s (TF32 tensor cores on GPUs, which XLA uses for f32 matmuls)
    hbm: float  # bytes
    fast_bw: float  # bytes/s per device per direction, inside a node / slice
    net_bw: float  # bytes/s per device per direction, between nodes / slices
    node: int  # devices joined by the fast links (GPUs per node; chips per ICI slice on TPU)
    source: dict  # field -> where the figure comes from
    fast_lat: float = 0.0  # seconds per ring step on the fast links
    net_lat: float = 0.0  # seconds per ring step on the network
    kinds: tuple = ()  # substrings of jax's device_kind that name this device (lower case)
    shared: bool = False  # simulated devices: the peak is the whole host's, not each device's

    def peak(self, dtype: str) -> float:
        return self.peak_bf16 if dtype == "bfloat16" else self.peak_f32

    @property
    def platform(self) -> str:
        """The jax platform of this device ("cpu", "gpu", "tpu"): the kernels a program for it uses."""
        return "tpu" if self.name.startswith("tpu") else "cpu" if self.name == "cpu" else "gpu"


_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16 dense, 494 TF32 dense, 80 GB HBM3"
_NVL4 = "NVLink 4: 900 GB/s bidirectional per GPU (H100/H200 datasheets), halved"
_NDR = "DGX/HGX H100 and H200: one 400 Gb/s ConnectX-7 NIC per GPU = 50 GB/s"
_V5P = "https://cloud.google.com/tpu/docs/v5p"
_V5E = "https://cloud.google.com/tpu/docs/v5e"
_V4 = "https://cloud.google.com/tpu/docs/v4"
_V6E = "https://cloud.google.com/tpu/docs/v6e"
# No datasheet gives a per-step latency; these are assumptions of the simulator, said as such.
_LAT_GPU = {"fast_lat": "assumed: 3 us per NVLink ring step", "net_lat": "assumed: 10 us per InfiniBand ring step"}
_LAT_TPU = {"fast_lat": "assumed: 2 us per ICI ring step", "net_lat": "assumed: 25 us per DCN ring step"}

DEVICES = {
    "h100-80g": Device("h100-80g", 989e12, 494e12, 80 * GB, 450 * GB, 50 * GB, 8, {
        "peak": _H100, "hbm": _H100, "fast_bw": _NVL4, "net_bw": _NDR, "node": "8 GPUs per DGX/HGX node",
        **_LAT_GPU}, 3 * US, 10 * US, ("h100",)),
    "h200": Device("h200", 989e12, 494e12, 141 * GB, 450 * GB, 50 * GB, 8, {
        "peak": "NVIDIA H200 datasheet (SXM): same Hopper tensor cores as H100",
        "hbm": "NVIDIA H200 datasheet: 141 GB HBM3e", "fast_bw": _NVL4, "net_bw": _NDR,
        "node": "8 GPUs per HGX H200 node", **_LAT_GPU}, 3 * US, 10 * US, ("h200",)),
    "a100-80g": Device("a100-80g", 312e12, 156e12, 80 * GB, 300 * GB, 25 * GB, 8, {
        "peak": "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 156 TF32 dense",
        "hbm": "NVIDIA A100 datasheet: 80 GB HBM2e",
        "fast_bw": "NVLink 3: 600 GB/s bidirectional per GPU (A100 datasheet), halved",
        "net_bw": "DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU = 25 GB/s", "node": "8 GPUs per DGX A100",
        **_LAT_GPU}, 3 * US, 10 * US, ("a100",)),
    "tpu-v5p": Device("tpu-v5p", 459e12, 459e12, 95 * GIB, 600 * GB, 6.25 * GB, 6144, {
        "peak": f"{_V5P}: 459 TFLOP/s bf16 per chip (f32 matmuls run as bf16 passes at most this fast)",
        "hbm": f"{_V5P}: 95 GiB HBM2e per chip",
        "fast_bw": f"{_V5P}: ICI 1200 GB/s bidirectional per chip (4800 Gb/s each way, 6 torus links), halved",
        "net_bw": f"{_V5P}: DCN 50 Gb/s per chip", "node": f"{_V5P}: largest single slice 6144 chips",
        **_LAT_TPU}, 2 * US, 25 * US, ("tpu v5p", "tpu v5")),
    "tpu-v5e": Device("tpu-v5e", 197e12, 197e12, 16 * GB, 200 * GB, 3.125 * GB, 256, {
        "peak": f"{_V5E}: 197 TFLOP/s bf16 per chip", "hbm": f"{_V5E}: 16 GB HBM per chip",
        "fast_bw": f"{_V5E}: ICI 400 GB/s bidirectional per chip, halved",
        "net_bw": f"{_V5E}: 2 x 100 Gb/s NICs per 8-chip host", "node": f"{_V5E}: 256 chips per pod",
        **_LAT_TPU}, 2 * US, 25 * US, ("tpu v5 lite", "tpu v5e")),
    "tpu-v4": Device("tpu-v4", 275e12, 275e12, 32 * GIB, 1.1e15 / 4096, 6.25 * GB, 4096, {
        "peak": f"{_V4}: 275 TFLOP/s bf16 per chip", "hbm": f"{_V4}: 32 GiB HBM2 per chip",
        "fast_bw": f"{_V4}: all-reduce bandwidth 1.1 PB/s per 4096-chip pod, per chip",
        "net_bw": "not published for v4; assumed equal to v5p's 50 Gb/s DCN per chip",
        "node": f"{_V4}: 4096 chips per pod", **_LAT_TPU}, 2 * US, 25 * US, ("tpu v4",)),
    "tpu-v6e": Device("tpu-v6e", 918e12, 918e12, 32 * GB, 224 * GB, 3.125 * GB, 256, {
        "peak": f"{_V6E}: 918 TFLOP/s bf16 per chip", "hbm": f"{_V6E}: 32 GB HBM per chip",
        "fast_bw": f"{_V6E}: ICI 3584 Gb/s bidirectional per chip, halved",
        "net_bw": "not published per chip; assumed equal to v5e's", "node": f"{_V6E}: 256 chips per pod",
        **_LAT_TPU}, 2 * US, 25 * US, ("tpu v6 lite", "tpu v6e")),
}
# Short names configs already use (sim.hardware=h100, ...) for the same rows.
ALIASES = {"h100": "h100-80g", "a100": "a100-80g", "v5p": "tpu-v5p", "v5e": "tpu-v5e", "v4": "tpu-v4",
           "v6e": "tpu-v6e"}


def from_kind(device_kind: str) -> Device | None:
    """The table's row for a device jax reports (its `device_kind`), or None if the table lacks it."""
    kind = device_kind.lower()
    # the longer names first: 'tpu v5 lite' is v5e, a bare 'tpu v5' is v5p
    keys = sorted(((k, d) for d in DEVICES.values() for k in d.kinds), key=lambda kd: -len(kd[0]))
    return next((d for k, d in keys if k in kind), None)


def measure_matmul_rate(dtype=jnp.float32, n: int = PEAK_N, reps: int = PEAK_REPS, device=None) -> float:
    """FLOP/s of an n x n x n matmul on one device, measured now in this process."""
    device = device or jax.local_devices()[0]  # jax.devices()[0] belongs to process 0 only
    # its own one-device mesh: callable inside a training loop's jax.set_mesh(...) too
    one = jax.sharding.Mesh(np.array([device]), ("one",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(one):
        a = jax.device_put(jnp.ones((n, n), dtype), device)
        f = jax.jit(lambda x, y: x @ y)
        f(a, a).block_until_ready()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            f(a, a).block_until_ready()
            best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


@functools.lru_cache(maxsize=None)
def _cpu() -> Device:
    """This host, measured now: simulated CPU devices share its cores, memory and memory bus."""
    f32, bf16 = measure_matmul_rate(jnp.float32), measure_matmul_rate(jnp.bfloat16)
    a = np.ones(1 << 24, np.float32)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        a.copy()
        best = min(best, time.perf_counter() - t)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    copy = a.nbytes / best
    return Device("cpu", bf16, f32, ram, copy, copy, 1 << 30, {
        "peak": "measured matmul rate of this host, shared by its simulated devices",
        "hbm": "this host's RAM", "fast_bw": "measured memory copy rate of this host",
        "net_bw": "measured memory copy rate of this host", "node": "one host"}, shared=True)


def get_device(name: str, hbm_gb: float | None = None, key: str = "plan.device") -> Device:
    """The device called `name` (or an alias of it), with plan.hbm_gb overriding its memory."""
    name = ALIASES.get(name, name)
    names = list(DEVICES) + ["cpu"]
    if name == "cpu":
        dev = _cpu()
    elif name in DEVICES:
        dev = DEVICES[name]
    else:
        import difflib
        near = [n for n in names if n.startswith(name)] or difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise UserError(f"{key}='{name}' is unknown; {hint}choose one of {', '.join(names)}")
    if hbm_gb is not None:  # a config's plan.hbm_gb, whose range the schema checked
        dev = dataclasses.replace(dev, hbm=hbm_gb * GB, source={**dev.source, "hbm": "plan.hbm_gb"})
    return dev
