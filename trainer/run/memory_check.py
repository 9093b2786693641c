"""Out of memory as one line (train.memory_check): the plan held against the device's memory before compiling,
the compiled step's own figures after, both before any token, weight or checkpoint is read; and an
out-of-memory error from XLA at compile or run time said as such.

The planner's per-device total (trainer/plan/) is held as it is on CPU. On a GPU or TPU only its parameters and
optimizer state are exact (the arguments' shapes); XLA fuses, recomputes and frees the rest as the planner cannot
follow (docs/plan.md), so there the plan refuses only what cannot fit by a wide margin (SLACK) and the compiled
program's `memory_analysis()` decides. The memory held against is the device's own (`memory_stats()`'s limit,
else the device table's) or, on CPU, the host's available memory shared by its local devices. The kernel's OOM
killer, which ends a process that touches more memory than the host has without any error, is out of reach.
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax

from trainer.errors import UserError
from trainer.hardware import Device, from_kind

GB = 1e9
OOM_MARKS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")
REDUCE = ("model.remat=full, more train.microbatches, model.loss_chunk, a higher train.zero_stage or a larger "
          "mesh (mesh.model, mesh.stage)")
# Where the planner is not XLA's figure, a layout is refused before compiling only when its exact part (parameters
# and optimizer state, which XLA:TPU's padding only enlarges) plus 1/SLACK of the rest exceeds the device: XLA:TPU
# was measured to hold down to 1/5.1 of the planner's gradients + activations + buffers (docs/plan.md), and SLACK
# doubles that for layouts not measured
SLACK = 10
# Test-only: this many bytes as the device's memory, the planner held as on an accelerator (by SLACK), on any
# platform; read here and nowhere else (tests/test_memory_check.py)
TEST_LIMIT = "MESHTRAIN_TEST_DEVICE_BYTES"


@dataclasses.dataclass(frozen=True)
class Limit:
    """The memory one device may use, where that figure comes from, and whether the plan is held as it is."""
    device: Device  # the planner's device row, its hbm the limit
    where: str
    exact: bool  # the planner's total is XLA's (CPU); else only its parameters and optimizer state

    @property
    def bytes(self) -> float:
        return self.device.hbm


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


def device_limit(cfg) -> Limit | None:
    """What the run's step is held against; None: nothing (train.memory_check=false, or the memory is unknown)."""
    if not cfg.train.memory_check:
        return None
    device, where = device_memory()
    test = os.environ.get(TEST_LIMIT)
    if test is not None:
        try:
            hbm = float(test)
        except ValueError:
            raise UserError(f"{TEST_LIMIT}='{test}' is not a number of bytes; unset it") from None
        base = device or Device("test", 1.0, 1.0, 0.0, 1.0, 1.0, 1, {})
        return Limit(dataclasses.replace(base, hbm=hbm), f"the test's limit ({TEST_LIMIT})", exact=False)
    if device is None:
        return None
    return Limit(device, where, exact=jax.local_devices()[0].platform == "cpu")


def check_fits(s, limit: Limit | None) -> None:
    """The run's plan held against `limit` (check_plan), before anything compiles."""
    if limit is None:
        return
    from trainer.plan.core import estimate, strategy_of
    hosts = max(jax.process_count(), 1)
    check_plan(estimate(s.model, s.cfg.train, strategy_of(s.cfg, s.mesh.size), limit.device, hosts, s.dtype.name,
                        s.placement.platform), limit)


def check_plan(plan, limit: Limit) -> None:
    """Stop with one line when the plan cannot fit: its total on CPU; elsewhere its parameters and optimizer
    state plus 1/SLACK of the rest."""
    from trainer.plan.report import EXACT, TERMS, size
    exact = sum(getattr(plan, k) for k in EXACT)
    needs = plan.total_bytes if limit.exact else exact + (plan.total_bytes - exact) / SLACK
    if needs <= limit.bytes:
        return
    key, big = max(((k, getattr(plan, k)) for k in TERMS), key=lambda kv: kv[1])
    if limit.exact:
        raise UserError(f"the plan needs {plan.total_bytes / GB:.2f} GB per device but {limit.where} is "
                        f"{limit.bytes / GB:.2f} GB ({TERMS[key]} {big / GB:.2f} GB the largest); reduce it with "
                        f"{REDUCE}, or set train.memory_check=false to compile anyway")
    raise UserError(f"the plan needs at least {size(needs)} per device (parameters and optimizer state "
                    f"{size(exact)}, exact, + 1/{SLACK} of its {size(plan.total_bytes - exact)} estimate of the "
                    f"rest; {TERMS[key]} {size(big)} the largest) but {limit.where} is {size(limit.bytes)}; reduce "
                    f"it with {REDUCE}, or set train.memory_check=false to compile anyway")


def reference_bytes(s) -> int:
    """Bytes per device that DPO's online reference holds beside the step: the parameters again, in their shardings
    (trainer/run/reference.py); 0 without one."""
    if s.model.dpo is None or not s.model.dpo.online:
        return 0
    leaves = zip(jax.tree.leaves(s.shapes["params"]), jax.tree.leaves(s.shardings["params"]))
    return sum(math.prod(sh.shard_shape(a.shape)) * a.dtype.itemsize for a, sh in leaves)


def check_compiled(fp, limit: Limit | None, held: int = 0) -> None:
    """Stop with one line when the compiled step (its trainer.plan.verify.Footprint: XLA's memory analysis) and
    the `held` bytes that stay in memory beside it (reference_bytes) do not fit the device."""
    if limit is None or fp.total_bytes + held <= limit.bytes:
        return
    from trainer.plan.report import size
    terms = {"arguments": fp.argument_bytes, "temp": fp.temp_bytes,
             "outputs not written into an argument": fp.output_bytes - fp.alias_bytes, "DPO reference (online)": held}
    key = max(terms, key=terms.get)
    beside = f" + DPO reference (online) {size(held)}" if held else ""
    raise UserError(f"the compiled train step needs {size(fp.total_bytes + held)} per device (XLA: arguments "
                    f"{size(fp.argument_bytes)} + temp {size(fp.temp_bytes)} + outputs {size(fp.output_bytes)} - "
                    f"aliased {size(fp.alias_bytes)}{beside}; {key} the largest) but {limit.where} is "
                    f"{size(limit.bytes)}; reduce it with {REDUCE}, or set train.memory_check=false to run anyway")


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
