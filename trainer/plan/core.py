"""`meshtrain plan`: per-device memory, communication and roofline step time of one layout.

Nothing is allocated and no device is needed (plan 256 devices on a laptop): memory comes from
trainer/plan/memory.py, collectives from trainer/plan/comm.py, device figures from
trainer/hardware.py. The roofline assumes no overlap: step time = compute at peak / (1 - bubble)
+ every collective's bus bytes / the bandwidth of the link its mesh axis crosses.
"""
from __future__ import annotations

import dataclasses

import jax

from meshes import CONTEXT, DATA, EXPERT, MODEL
from models import ModelConfig, flops_per_token, hardware_flops_per_token
from trainer.plan.comm import transfers
from trainer.hardware import Device
from trainer.plan.memory import activation_bytes, buffer_bytes, layer_residuals, state_bytes
from trainer.plan.schedule_cost import cost
from trainer.plan.types import Strategy, Transfer

__all__ = ["Plan", "Strategy", "Transfer", "estimate", "links", "strategy_of"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """One layout's memory per device, collectives, bubble and roofline time."""
    strategy: Strategy
    model: ModelConfig
    device: Device
    hosts: int
    dtype: str
    batch_size: int
    params_bytes: float
    grads_bytes: float
    opt_state_bytes: float
    activations_bytes: float  # saved residuals, logits, pipeline buffers
    buffers_bytes: float  # transient full-size gradients and gathered ZeRO-3 weights
    transfers: tuple[Transfer, ...]
    bubble: float
    compute_s: float
    comm_s: dict  # axis -> seconds
    links: dict  # axis -> "fast" | "net"
    layer_bytes: tuple = (0.0, 0.0)  # one layer's residuals: (bytes whatever the batch, bytes per token)
    reference_bytes: float = 0.0  # DPO's online reference, GRPO's with beta > 0: its parameters, outside the step
    full_state_bytes: float = 0.0  # model.lora: full fine-tuning's parameters, gradients and optimizer state here
    sampling_bytes: float = 0.0  # GRPO: the sampler's KV cache, held between steps (not beside the step's own)

    @property
    def total_bytes(self) -> float:
        step = max(self.activations_bytes + self.buffers_bytes, self.sampling_bytes)
        return self.state_bytes + step + self.reference_bytes

    @property
    def state_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.opt_state_bytes

    @property
    def comm_bytes(self) -> float:
        """The step's collective bytes per device (an MoE dispatch's exact path, taken only where a buffer
        overflows, apart: `overflow_bytes`)."""
        return sum(t.bytes for t in self.transfers if not t.overflow)

    @property
    def overflow_bytes(self) -> float:
        return sum(t.bytes for t in self.transfers if t.overflow)

    def axis_bytes(self, axis: str) -> float:
        return sum(t.bytes for t in self.transfers if t.axis == axis and not t.overflow)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device.hbm

    @property
    def over_bytes(self) -> float:
        """Bytes per device beyond the device's memory (0 when it fits)."""
        return max(0.0, self.total_bytes - self.device.hbm)

    @property
    def step_s(self) -> float:
        """Roofline step time, no overlap assumed: compute / (1 - bubble) + every transfer."""
        return self.compute_s / (1 - self.bubble) + sum(self.comm_s.values())

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    @property
    def mfu(self) -> float:
        peak = self.device.peak(self.dtype) * (1 if self.device.shared else self.strategy.devices)
        return flops_per_token(self.model) * self.tokens_per_step / (peak * self.step_s)


def links(st: Strategy, device: Device, hosts: int) -> dict:
    """Which link each mesh axis's collectives cross: mesh order puts the last axis (`model`) innermost."""
    per_node = max(1, st.devices // hosts)
    out, inner = {}, 1
    for axis, size in reversed(st.mesh.items()):
        inner *= size
        out[axis] = "fast" if inner <= min(per_node, device.node) else "net"
    return out


def estimate(mc: ModelConfig, train, st: Strategy, device: Device, hosts: int, dtype: str,
             platform: str | None = None) -> Plan:
    """The plan of one layout: memory per device, bytes per axis, roofline time; the step's kernels those of
    `platform` (None: this host's devices')."""
    platform = platform or jax.devices()[0].platform
    a = 2 if dtype == "bfloat16" else 4
    batch = train.batch_size
    mc = dataclasses.replace(mc, remat=st.remat)
    p, g, o = state_bytes(mc, train, st)
    # DPO's online reference, GRPO's (beta > 0): the parameters' layout again
    ref = p if (mc.dpo is not None and mc.dpo.online) or (mc.grpo is not None and mc.grpo.beta) else 0.0
    acts = activation_bytes(mc, st, batch, dtype, platform)
    bufs = buffer_bytes(mc, train, st, a, platform)
    moves = tuple(transfers(mc, train, st, batch, a, platform))
    bubble = cost(st.schedule, st.stage, st.microbatches, st.repeats).bubble if st.stage > 1 else 0.0
    tokens = batch * mc.seq_len
    flop_mc = mc if st.stage == 1 else dataclasses.replace(mc, remat="full")  # pipeline stages recompute
    flops = hardware_flops_per_token(flop_mc) * tokens / st.devices
    if st.stage > 1:  # the last stage, the slowest, runs the whole head (trainer/parallel/pipeline.py)
        flops += 6 * mc.d_model * mc.vocab_size * tokens * (st.stage - 1) / st.devices
    peak = device.peak(dtype) / (st.devices if device.shared else 1)
    lk = links(st, device, hosts)
    bw = {"fast": device.fast_bw, "net": device.net_bw}
    comm = {}
    for t in moves:  # a collective over several axes runs at the slowest of their links
        slow = min(bw[lk[a]] for a in t.axis.split(","))
        comm[t.axis] = comm.get(t.axis, 0.0) + t.bytes / slow
    full = sum(state_bytes(dataclasses.replace(mc, lora=None), train, st)) if mc.lora is not None else 0.0
    return Plan(st, mc, device, hosts, dtype, batch, p, g, o, acts, bufs, moves, bubble, flops / peak, comm, lk,
                layer_residuals(mc, st, dtype, platform), ref, full, sampling_bytes=sampling_bytes(mc, st, batch, a))


def sampling_bytes(mc: ModelConfig, st: Strategy, batch: int, itemsize: int) -> float:
    """GRPO's sampler (trainer/rl/rollout.py): the keys and values of `batch` completions at the whole context in
    the compute dtype, each data (and expert) rank its rows where they divide, the kv heads over `model` where they
    divide; 0 for another objective."""
    if mc.grpo is None:
        return 0.0
    rows, heads = st.data, st.model
    return (2.0 * mc.n_layers * (batch // rows if batch % rows == 0 else batch) * mc.seq_len
            * (mc.n_kv_heads // heads if mc.n_kv_heads % heads == 0 else mc.n_kv_heads) * mc.head_dim * itemsize)


def strategy_of(cfg, n_devices: int) -> Strategy:
    """The layout a config describes, on n_devices."""
    from trainer.config import validate
    from trainer.state import rules_for
    t = cfg.train
    shape = validate(cfg, n_devices)
    return Strategy(shape, t.zero_stage, t.microbatches, cfg.model.remat,
                    t.pipeline_repeats, t.grad_sync, t.pipeline_schedule,
                    rules_for(cfg, shape[DATA], context=shape[CONTEXT], expert=shape[EXPERT], model=shape[MODEL]),
                    t.context_load_balance,
                    t.context_attention)
