"""Joining a multi-process run: jax.distributed.initialize from the dist.* keys or a detected cluster.

One process per host (or per GPU under SLURM) runs the same program; `initialize` must run
before jax touches a device. Explicit keys win; otherwise `dist.cluster=auto` joins when the
environment is a cluster jax bootstraps from (a SLURM step or Open MPI job with several
tasks, a multi-host TPU slice), and runs as one process everywhere else.
"""
from __future__ import annotations

import inspect
import logging
import os
import signal
import threading

import jax
import numpy as np

from trainer.errors import UserError
from trainer.logs import last_words
from trainer.config.sections import CLUSTERS

# dist.cluster's choices, as the schema lists them: the names detect() returns are these
AUTO, NONE, SLURM, OMPI, GCETPU, GKETPU, MPI4PY = CLUSTERS
log = logging.getLogger(__name__)


def _tasks(env, key: str) -> int:
    try:
        return int(env.get(key, "1").split("(")[0])  # SLURM may write '4(x2)'
    except ValueError:
        return 1


def _tpu_vm() -> bool:
    """A Cloud TPU VM, as jax itself decided at import (private, so guarded)."""
    try:
        from jax._src import cloud_tpu_init
        return bool(cloud_tpu_init.running_in_cloud_tpu_vm) and "TPU_SKIP_MDS_QUERY" not in os.environ
    except (ImportError, AttributeError):
        return False


def detect(env=None) -> str | None:
    """Name of the cluster this process runs in, if it spans several processes; else None."""
    env = os.environ if env is None else env
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm) and _tasks(env, "SLURM_NTASKS") > 1:
        return SLURM
    if "OMPI_MCA_orte_hnp_uri" in env and _tasks(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return OMPI
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([h for h in hosts.split(",") if h]) > 1:
        return GKETPU
    if env is os.environ and _tpu_vm():
        return GCETPU  # a single-host VM joins as one process, which costs nothing
    return None


def _explicit(d) -> dict | None:
    """initialize() arguments from dist.coordinator / num_processes / process_id, or None if unset."""
    given = {"coordinator": d.coordinator, "num_processes": d.num_processes, "process_id": d.process_id}
    if all(v is None for v in given.values()):
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise UserError(f"dist.{missing[0]} is not set; give dist.coordinator=HOST:PORT, dist.num_processes=N "
                        "and dist.process_id=I together (or none of them)")
    host, _, port = d.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"dist.coordinator='{d.coordinator}' is not HOST:PORT; give process 0's address and a free "
                        "port, e.g. dist.coordinator=10.0.0.1:1234")
    if d.num_processes < 1 or not 0 <= d.process_id < d.num_processes:
        raise UserError(f"dist.process_id={d.process_id} is not in 0..dist.num_processes-1 "
                        f"(num_processes={d.num_processes}); number the processes 0, 1, ..., N-1")
    return {"coordinator_address": d.coordinator, "num_processes": d.num_processes, "process_id": d.process_id}


def initialize(d) -> bool:
    """Join the cluster that `d` (the config's dist section) names or that is detected; True if joined."""
    kw = _explicit(d)
    if kw is None:
        method = None if d.cluster == NONE else detect() if d.cluster == AUTO else d.cluster
        if method is None:
            return False
        kw = {} if d.cluster == AUTO else {"cluster_detection_method": method}
    else:
        method = None
    if kw.get("num_processes") == 1:
        return False
    if jax.distributed.is_initialized():  # joined already (a notebook or a wrapper script)
        return True
    accepted = inspect.signature(jax.distributed.initialize).parameters
    # jax aborts the process (no exception) when its own deadline passes: the watchdog fires first
    for name, value in (("initialization_timeout", d.timeout_s + 30), ("heartbeat_timeout_seconds", d.heartbeat_s)):
        if name in accepted:
            kw[name] = value
    try:  # CPU collectives across processes; GPU/TPU hosts ignore it
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):
        pass
    who = f"process {kw['process_id']} of {kw['num_processes']}" if "process_id" in kw else "this process"
    where = kw.get("coordinator_address", f"the coordinator of the {method} cluster")
    joined = _watchdog(d.timeout_s, f"{who} waited dist.timeout_s={d.timeout_s}s at {where} and "
                       "not every process joined; start all of them with the same dist.coordinator (process ids "
                       "0..N-1), or raise dist.timeout_s")
    try:
        jax.distributed.initialize(**kw)
    except RuntimeError as e:
        if "must be called before" in str(e):
            raise UserError("jax was already using devices when dist.* took effect; join before any jax call "
                            "(meshtrain train does; in Python call trainer.run.distributed.initialize first)") from None
        raise
    except ValueError as e:
        raise UserError(f"dist.cluster={d.cluster}: jax found no cluster to join ({str(e).strip()}); give "
                        "dist.coordinator, dist.num_processes and dist.process_id, or set dist.cluster=none") from None
    finally:
        joined.set()
    return True


def leave_stopped():
    """Before a stopped-early exit: SIGTERM ignored and jax.distributed's shutdown barrier passed, so that every
    process is past its last write when the first exits non-zero; srun --kill-on-bad-exit then sends the others
    SIGTERM, and they leave with the same status instead of a signal's, which srun would report as the step's."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def _watchdog(seconds: float, message: str) -> threading.Event:
    """An event to set within `seconds`, or else `message` logged as an error and exit status 2."""
    done = threading.Event()  # the wait for peers runs in C++ with the GIL released: this thread runs meanwhile

    def watch():
        if not done.wait(seconds):
            last_words(log, message)
            os._exit(2)

    threading.Thread(target=watch, name="meshtrain-join-watchdog", daemon=True).start()
    return done


def process_rows(sharding, batch_size: int, process_of=None, me: int | None = None) -> tuple[int, int]:
    """(index, count): the block of the batch (cut into `count`) that this process's devices hold."""
    # with the batch replicated over processes (data inside a host) that is the whole batch: (0, 1)
    process_of = process_of or (lambda dev: dev.process_index)
    me = jax.process_index() if me is None else me
    rows = set()
    for dev, idx in sharding.devices_indices_map((batch_size,)).items():
        if process_of(dev) == me:
            rows.update(range(batch_size)[idx[0]])
    lo, n = min(rows), len(rows)
    if rows != set(range(lo, lo + n)) or batch_size % n or lo % n:
        raise UserError(f"this process's devices hold batch rows {sorted(rows)}, not one block of the batch; "
                        "order the mesh so that each host holds a contiguous part of mesh.data (mesh.dcn_data)")
    return lo // n, batch_size // n


def process_tokens(sharding, shape: tuple, me: int | None = None) -> slice:
    """The tokens (dim 1 of a (B, T) batch field of `shape`) this process's devices hold: all of them unless
    context parallelism splits rows over processes (mesh.context spanning hosts); then one contiguous block."""
    me = jax.process_index() if me is None else me
    cols = set()
    for dev, idx in sharding.devices_indices_map(tuple(shape)).items():
        if dev.process_index == me:
            cols.update(range(shape[1])[idx[1]] if len(idx) > 1 else range(shape[1]))
    lo, n = min(cols), len(cols)
    if cols != set(range(lo, lo + n)):
        raise UserError(f"this process's devices hold tokens {sorted(cols)} of each row, not one block; order the "
                        "mesh so that each host holds a contiguous part of mesh.context")
    return slice(lo, lo + n)


def describe(mesh, rows: slice, batch_size: int) -> str:
    """'process 1 of 2 | 4 devices at data 0-3 stage 0 model 0 | batch rows 8:16 of 16'."""
    me = jax.process_index()
    at = np.argwhere(np.vectorize(lambda dev: dev.process_index == me)(mesh.devices))
    span = " ".join(f"{name} {lo}" + (f"-{hi}" if hi > lo else "")
                    for name, lo, hi in zip(mesh.axis_names, at.min(0), at.max(0)))
    return (f"process {me} of {jax.process_count()} | {len(at)} devices at {span} | "
            f"batch rows {rows.start}:{rows.stop} of {batch_size}")
