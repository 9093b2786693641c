"""Out of memory as one line: the plan held against the device's memory before compiling
(train.memory_check), and an out-of-memory error from XLA at compile or run time said as such.

The figure checked is the planner's per-device total (trainer/plan/: state, activations, buffers); the
memory it is held against is the device's own (`memory_stats()`'s limit, else the device table's) or, on
CPU, the host's available memory shared by its local devices. The kernel's OOM killer, which ends a
process that touches more memory than the host has without any error, is out of reach of both checks.
"""
from __future__ import annotations

import dataclasses
import os

import jax

from trainer.errors import UserError
from trainer.hardware import Device, from_kind

GB = 1e9
OOM_MARKS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")
REDUCE = ("model.remat=full, more train.microbatches, model.loss_chunk, a higher train.zero_stage or a larger "
          "mesh (mesh.model, mesh.stage)")


def host_available_bytes() -> float:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_memory() -> tuple[Device | None, str]:
    """The local device as the planner's Device with the memory one device may use, and where it comes from."""
    dev = jax.local_devices()[0]
    if dev.platform == "cpu":
        n = len(jax.local_devices())
        hbm = host_available_bytes() / n
        # only the memory matters here: the planner's step time is not used, so nothing is measured
        row = Device("cpu", 1.0, 1.0, hbm, 1.0, 1.0, 1 << 30, {"hbm": "available host memory"}, shared=True)
        return row, f"this host's available memory{f' / {n} local devices' if n > 1 else ''}"
    row = from_kind(dev.device_kind)
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if limit:
        base = row or Device(dev.device_kind, 1.0, 1.0, 0.0, 1.0, 1.0, 1, {})
        return dataclasses.replace(base, hbm=float(limit)), f"{dev.device_kind}'s memory limit"
    if row is not None:
        return row, f"the device table's memory of {row.name}"
    return None, f"unknown memory for {dev.device_kind}"


def check_fits(s) -> None:
    """Stop with one line, before anything compiles, when the plan does not fit the device."""
    cfg = s.cfg
    if not cfg.train.memory_check:
        return
    device, where = device_memory()
    if device is None:
        return
    from trainer.plan.core import estimate, strategy_of
    from trainer.plan.report import TERMS
    hosts = max(jax.process_count(), 1)
    plan = estimate(s.model, cfg.train, strategy_of(cfg, s.mesh.size), device, hosts, s.dtype.name,
                    s.placement.platform)
    if plan.fits:
        return
    key, big = max(((k, getattr(plan, k)) for k in TERMS), key=lambda kv: kv[1])
    raise UserError(f"the plan needs {plan.total_bytes / GB:.2f} GB per device but {where} is "
                    f"{device.hbm / GB:.2f} GB ({TERMS[key]} {big / GB:.2f} GB the largest); reduce it with "
                    f"{REDUCE}, or set train.memory_check=false to compile anyway")


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (jax.errors.JaxRuntimeError, MemoryError)) and \
        (isinstance(e, MemoryError) or any(m in str(e) for m in OOM_MARKS))


def out_of_memory(e: BaseException, phase: str) -> UserError:
    """The one line for an out-of-memory error XLA raised while `phase` ran."""
    text = str(e)
    i = max((text.rfind(m) for m in OOM_MARKS), default=-1)
    said = text[i:].splitlines()[0][:200] if i >= 0 else type(e).__name__
    return UserError(f"out of memory while {phase}: {said}; reduce the memory per device with {REDUCE}; "
                     "the checkpoints are as they were")
