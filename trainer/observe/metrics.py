"""Throughput, MFU, and the run's outputs: metrics.jsonl, TensorBoard, console lines."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from trainer.hardware import PEAK_N, PEAK_REPS, from_kind, measure_matmul_rate


def device_peak(dtype) -> tuple[float | None, str]:
    """Peak FLOP/s of one device for `dtype`, and where the figure comes from."""
    dev = jax.local_devices()[0]
    if dev.platform == "cpu":
        # Measured once, before training: inside the loop it would compete with the steps and be
        # counted as eval time. Simulated CPU devices share the host's cores: the process-wide rate is the peak.
        rate = measure_matmul_rate(dtype, PEAK_N, PEAK_REPS)
        return rate, f"measured: {jnp.dtype(dtype).name} {PEAK_N}^3 matmul, best of {PEAK_REPS}, on this CPU"
    row = from_kind(dev.device_kind)  # the one device table: datasheet figures with their sources
    if row is None:
        return None, f"unknown peak for {dev.device_kind}"
    return row.peak(jnp.dtype(dtype).name), f"datasheet peak for {dev.device_kind} ({row.source['peak']})"


def peak_devices(mesh) -> int:
    """Devices whose peaks add up: simulated CPU devices share one host, so count 1 there."""
    return 1 if mesh.devices.flat[0].platform == "cpu" else mesh.size


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a line cut short by a crash
        return float("inf")


class MetricsWriter:
    """metrics.jsonl and TensorBoard scalars; only one process writes (process 0)."""

    def __init__(self, run_dir: Path, enabled: bool = True, resume_step: int = 0):
        self.enabled = enabled
        self.file = self.tb = None
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        if path.exists():  # drop records past the step training resumes from: each step is logged once
            keep = [ln for ln in path.read_text().splitlines(keepends=True) if _step_of(ln) <= resume_step]
            tmp = path.with_name(path.name + ".tmp")  # a kill mid-write must not lose the kept lines
            tmp.write_text("".join(keep))
            os.replace(tmp, path)
        self.file = open(path, "a", buffering=1)
        self.goodput_path = run_dir / "goodput.jsonl"
        from tensorboardX import SummaryWriter
        self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def write(self, record: dict):
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self._scalars(record)

    def _scalars(self, record: dict):
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):  # a skipped NaN step stays in the jsonl
                self.tb.add_scalar(k, v, record["step"])

    def write_goodput(self, record: dict):
        """One line per training session in goodput.jsonl (a resumed run adds one), and the same
        scalars in TensorBoard; metrics.jsonl keeps only step and eval records."""
        if not self.enabled:
            return
        with open(self.goodput_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self._scalars(record)

    def flush(self):
        if self.enabled:
            self.file.flush()
            self.tb.flush()

    def close(self):
        if self.enabled:
            self.file.close()
            self.tb.close()
