"""The accelerator's own program, built on this machine: `plan --compile-for TOPOLOGY` and `plan --lower cuda`.

--compile-for compiles the real train step (the function training jits, with its shardings and
donation) ahead of time for a TPU topology through libtpu: jax describes the topology's chips
without any chip present, and XLA:TPU compiles for them. Its memory analysis, HLO (collectives per
mesh axis) and FLOP count are what the pod would run. Nothing runs: speed and numerics on the
device are not checked.

--lower cuda lowers the step for CUDA on an abstract mesh of the configured size: the StableHLO a
GPU job would hand XLA:GPU, with the GPU's kernel choices. Only the explicit collectives (shard_map's:
ZeRO-2/3's reduce-scatters and gathers, the ring, the pipeline's hops) are in it; the ones XLA:GPU's
partitioner adds from the shardings are not, and no GPU compiler runs here.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib.util
import logging
import os
import re
import time

import numpy as np

from trainer.errors import UserError

EXAMPLES = "v5p:4x4x8, v5e:4x4, v6e:8x8, v4:4x4x4"
_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}  # TensorCores a Cloud TPU accelerator type counts per chip
_SHRINK = "try train.zero_stage=3, model.remat=full, more train.microbatches or a larger mesh.model"


def topology_devices(name: str) -> list:
    """The chips of a TPU topology as jax names it (e.g. v5p:4x4x8), described by libtpu."""
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(f"--compile-for {name} needs libtpu, which is not installed; "
                        "pip install -e '.[tpu]' (Linux x86_64)")
    if name.partition(":")[0] not in _PER_CHIP or ":" not in name:
        raise UserError(f"--compile-for '{name}' is not a TPU topology; give one as jax names it, e.g. {EXAMPLES}")
    from jax.experimental import topologies
    from trainer.platforms import tpu_chips
    if not tpu_chips():  # no TPU VM's metadata to read: say what it would, or libtpu warns on stderr
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        # no chip to guard: processes compiling side by side (test workers) need not take libtpu's lock
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        if accelerator := _accelerator_type(name):
            os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator)
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name, wrap=wraparound(name)).devices)
    except Exception as e:  # noqa: BLE001  (libtpu raises XlaRuntimeError/JaxRuntimeError/ValueError)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--compile-for {name}: libtpu knows no such topology ({first}); "
                        f"give one as jax names it, e.g. {EXAMPLES}") from None


def wraparound(name: str) -> tuple[bool, bool, bool]:
    """Which of a TPU slice's axes close into a ring, as the pod's links do: on the 3D tori (v4, v5p) every axis of
    a slice made of whole 4x4x4 cubes (v5p:4x4x8; not v5p:2x2x4), on the 2D ones (v5e, v6e) an axis of 16 chips.
    libtpu's default is none: compiled without them, XLA:TPU writes each all-gather over a 4x4x8 slice as an
    all-reduce (twice the bytes) and the 7B step compiled a third slower (docs/plan.md)."""
    gen, _, dims = name.partition(":")
    sizes = [int(d) for d in dims.split("x")]
    if gen in ("v4", "v5p"):
        ring = len(sizes) == 3 and all(d % 4 == 0 for d in sizes)
        return (ring, ring, ring)
    return tuple(d == 16 for d in sizes) + (False,) * (3 - len(sizes))


def _accelerator_type(name: str) -> str | None:
    """Cloud TPU's accelerator type of a topology (v5p:2x2x2 -> v5p-16: v4 and v5p count TensorCores)."""
    gen, _, dims = name.partition(":")
    try:
        chips = int(np.prod([int(d) for d in dims.split("x")]))
    except ValueError:
        return None
    per_chip = _PER_CHIP.get(gen)
    prefix = {"v5e": "v5litepod"}.get(gen, gen)
    return f"{prefix}-{chips * per_chip}" if per_chip else None


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A step compiled for a TPU topology: XLA:TPU's figures and the planner's for the same layout."""
    topology: str
    device_kind: str
    seconds: float  # compile time on this host
    measured: object  # trainer.plan.verify.Measured
    plan: object  # trainer.plan.core.Plan
    sampler: dict | None = None  # GRPO: {"prefill", "decode": trainer.plan.verify.Footprint} of the sampler's step

    @property
    def sampling_bytes(self) -> float:
        """GRPO: the sampler's peak per chip, its larger program's (parameters, cache, scratch) with what the run
        holds beside it (the optimizer state, the reference model: the planner's exact figures); else 0."""
        if not self.sampler:
            return 0.0
        return max(f.total_bytes for f in self.sampler.values()) + self.plan.opt_state_bytes + self.plan.reference_bytes

    @property
    def total_bytes(self) -> float:
        """XLA:TPU's per-device peak (trainer.plan.verify.Footprint): the train step's, or GRPO's sampler's where
        it is larger."""
        return max(self.measured.total_bytes, self.sampling_bytes)


def compile_for(cfg, name: str) -> Compiled:
    """Compile cfg's train step for TPU topology `name` and plan the same layout on the same chip."""
    from trainer.config import model_config
    from trainer.hardware import from_kind, get_device
    from trainer.plan.core import estimate, strategy_of
    from trainer.plan.verify import measure
    devices = topology_devices(name)
    row = from_kind(devices[0].device_kind)
    if row is None:
        raise UserError(f"--compile-for {name}: '{devices[0].device_kind}' is not in the device table "
                        f"(trainer/hardware.py); compile for one of {EXAMPLES}")
    if cfg.plan.hbm_gb is not None:
        row = get_device(row.name, cfg.plan.hbm_gb)
    n = len(devices)
    st = strategy_of(cfg, n)
    plan = estimate(model_config(cfg), cfg.train, st, row, -(-n // row.node), cfg.train.dtype or "bfloat16", "tpu")
    t0 = time.perf_counter()
    try:
        m = measure(cfg, devices, grads=False)
        sampler = _sampler(cfg, devices) if cfg.train.objective == "grpo" else None
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (XLA:TPU's errors: out of memory, an unsupported op)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        hint = f"; {_SHRINK}" if "RESOURCE_EXHAUSTED" in first else ""
        raise UserError(f"{st.describe()} does not compile for {name}: {first[:300]}{hint}") from None
    return Compiled(name, devices[0].device_kind, time.perf_counter() - t0, m, plan, sampler)


def _sampler(cfg, devices) -> dict:
    """GRPO's sampler compiled for the devices: its prefill (the longest prompts, the context less
    grpo.max_completion_length) and one decode step."""
    from trainer.plan.verify import Footprint
    from trainer.rl.rollout import compile_sampler
    from trainer.state import make_setup
    s = make_setup(cfg, devices)
    prompt = s.model.seq_len - cfg.grpo.max_completion_length
    return {"prefill": Footprint.of(compile_sampler(s, prompt)), "decode": Footprint.of(compile_sampler(s, 1))}


def overflow(c: Compiled) -> str | None:
    """Why the compiled layout does not fit the chip (XLA:TPU's own figure), else None."""
    hbm = c.plan.device.hbm
    if c.total_bytes <= hbm:
        return None
    return (f"{c.plan.strategy.describe()} does not fit {c.topology}: XLA:TPU needs {c.total_bytes / 1e9:.2f} GB "
            f"per chip, more than the {hbm / 1e9:.1f} GB of {c.plan.device.name}; {_SHRINK}")


# ----------------------------------------------------------------------------- CUDA

_COLLECTIVE = re.compile(r"\b(?:stablehlo|mhlo)\.(all_reduce|all_gather|reduce_scatter|all_to_all|"
                         r"collective_permute)\b")


@dataclasses.dataclass(frozen=True)
class Lowered:
    devices: int
    mesh_shape: dict
    collectives: dict  # (kind, mesh axes) -> ops in the lowered module (a loop's body counted once)
    attention: str  # the attention the program holds: cudnn, xla, manual
    fallback: str | None  # why cuDNN's attention was not lowered, if it was asked for and refused
    seconds: float
    text: str = dataclasses.field(repr=False, default="")


def lower_cuda(cfg, n: int) -> Lowered:
    """Lower cfg's train step for CUDA on an abstract mesh of n devices (none needs to exist)."""
    import jax

    from trainer.config import validate
    from trainer.plan.verify import abstract_inputs
    from trainer.state import setup_on
    from trainer.step import jit_train_step
    mesh = validate(cfg, n).abstract()
    s = setup_on(cfg, mesh, "gpu")
    state, batch = abstract_inputs(s)
    t0 = time.perf_counter()
    with _Fallbacks() as fb, jax.sharding.use_abstract_mesh(mesh):
        try:
            exported = jax.export.export(jit_train_step(s), platforms=["cuda"])(state, batch)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  (an op with no CUDA lowering)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"the train step does not lower for CUDA: {first[:300]}") from None
    text = exported.mlir_module()
    found = collections.Counter()
    for line in text.splitlines():
        if m := _COLLECTIVE.search(line):
            found[(m.group(1).replace("_", "-"), _lowered_axes(line, dict(mesh.shape)))] += 1
    chosen = [a for a in ("cudnn", "xla", "manual") if f"attention_{a}" in text]
    return Lowered(n, dict(mesh.shape), dict(sorted(found.items())), "/".join(chosen) or "none", fb.reason,
                   time.perf_counter() - t0, text)


def _lowered_axes(line: str, mesh_shape: dict) -> tuple[str, ...]:
    """The mesh axes a lowered collective spans, from its replica groups or permutation pairs."""
    from trainer.plan.hlo import axes_of, pair_axes
    if "replica_group_mesh_axes" in line:  # jax 0.12 names the mesh axes themselves
        named = set(re.findall(r'axis_ref<name = "(\w+)"', line.split("replica_group_mesh_axes", 1)[1].split("]>", 1)[0]))
        return tuple(a for a in mesh_shape if a in named and mesh_shape[a] > 1)
    m = re.search(r"(?:replica_groups|source_target_pairs) = dense<(.*?)> : tensor<(\d+)x(\d+)xi64>", line)
    if not m:
        return ("?",)
    body, rows, cols = m.group(1), int(m.group(2)), int(m.group(3))
    if body.startswith('"0x'):  # large constants print as little-endian hex
        ids = np.frombuffer(bytes.fromhex(body.strip('"')[2:]), "<i8")
    else:
        ids = np.array([int(x) for x in re.findall(r"-?\d+", body)])
    ids = np.broadcast_to(ids, (rows * cols,)).reshape(rows, cols)  # a splat is one value for all
    if "source_target_pairs" in m.group(0):
        return pair_axes(ids.tolist(), mesh_shape)
    return axes_of(ids.tolist(), mesh_shape)


class _Fallbacks(logging.Handler):
    """Catches models/kernels/attention.py's one line saying cuDNN's attention was refused."""
    def __init__(self):
        super().__init__(logging.WARNING)
        self.reason = None

    def emit(self, record):
        msg = record.getMessage()
        if "cuDNN" in msg:
            self.reason = msg.split("(", 1)[-1].rsplit(")", 1)[0]

    def __enter__(self):
        from models.kernels import attention
        attention.reset_warnings()  # said once per process: say it again for this lowering
        log = logging.getLogger(attention.__name__)
        self._propagate, log.propagate = log.propagate, False  # the report says it instead
        log.addHandler(self)
        return self

    def __exit__(self, *exc):
        from models.kernels import attention
        log = logging.getLogger(attention.__name__)
        log.removeHandler(self)
        log.propagate = self._propagate
