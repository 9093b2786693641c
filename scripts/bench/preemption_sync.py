"""What agreeing on a stop after every step costs: jax's preemption sync point against a step, and against the
all-gather the processes used before (which is why they agreed only at logging steps).

  python scripts/bench/preemption_sync.py [PROCS] [DEVICES_PER_PROC] [key=value ...]   # default 2 x 4 CPU devices

Starts PROCS processes joined by jax.distributed on 127.0.0.1 (the launcher of scripts/launch_local.sh, by hand).
Each compiles the train step of a tiny model and runs ROUNDS rounds of STEPS steps, alternately with
StopRequest.agreed() after every step (the Preemption plug-in's call: jax's sync point) and without, each round
timed whole with the state fetched at its end; then times the sync point alone and the old all-gather alone.
Process 0 prints the per-step time with and without, their ratio (median of the rounds), and the per-call costs.
"""
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DEFAULTS = ["model.preset=tiny", "train.batch_size=16", "data.source=synthetic", "mesh.data=-1",
            "run.progress=false"]
ROUNDS, STEPS, CALLS = 8, 20, 20000


def _rounds(step_fn, state, batch, request):
    """Alternating rounds with and without the agreement after each step: seconds per step of each."""
    import jax
    times = {True: [], False: []}
    for r in range(2 * ROUNDS):
        agree = r % 2 == 0
        t0 = time.perf_counter()
        for _ in range(STEPS):
            state, metrics = step_fn(state, batch)
            if agree and request.agreed():
                raise SystemExit("a stop was agreed with no signal sent")
        jax.block_until_ready(state)
        times[agree].append((time.perf_counter() - t0) / STEPS)
    return state, times


def worker(argv):
    from trainer.config import load_config
    from trainer.run.distributed import initialize
    cfg = load_config(DEFAULTS + argv)
    initialize(cfg.dist)
    import jax
    from trainer.ckpt.preempt import StopRequest, any_process
    from trainer.data.batches import Batches, load_corpus
    from trainer.run.context import to_global
    from trainer.run.distributed import process_rows
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step
    s = make_setup(cfg)
    step_fn, state = jit_train_step(s), init_state(s)
    b = Batches(load_corpus("synthetic"), 0, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size,
                *process_rows(s.row_sharding(), cfg.train.batch_size))
    batch = to_global(s, b.train(0))
    request = StopRequest()
    with jax.set_mesh(s.mesh):
        state, _ = _rounds(step_fn, state, batch, request)  # compile and warm up
        state, times = _rounds(step_fn, state, batch, request)
    t0 = time.perf_counter()
    for _ in range(CALLS):
        request.agreed()
    sync_us = (time.perf_counter() - t0) / CALLS * 1e6
    t0 = time.perf_counter()
    for _ in range(20):
        any_process(False)
    gather_ms = (time.perf_counter() - t0) / 20 * 1e3
    on, off = statistics.median(times[True]), statistics.median(times[False])
    if jax.process_index() == 0:
        print(f"{jax.process_count()} processes x {jax.local_device_count()} devices, jax {jax.__version__}, "
              f"sync point owned by jax: {request.jax_owns_sigterm}")
        print(f"step with the agreement after it {on * 1e3:.2f} ms, without {off * 1e3:.2f} ms: ratio {on / off:.4f} "
              f"(median of {ROUNDS} rounds of {STEPS} steps each)")
        print(f"sync point alone {sync_us:.2f} us per call ({sync_us / (off * 1e6):.2e} of a step); the old "
              f"all-gather {gather_ms:.2f} ms per call ({gather_ms / (off * 1e3):.2f} of a step)")


def main(argv):
    procs = int(argv.pop(0)) if argv and argv[0].isdigit() else 2
    devices = int(argv.pop(0)) if argv and argv[0].isdigit() else 4
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    ps = [subprocess.Popen([sys.executable, __file__, "--worker", *argv, f"dist.coordinator=127.0.0.1:{port}",
                            f"dist.num_processes={procs}", f"dist.process_id={i}"], env=env) for i in range(procs)]
    return max(p.wait() for p in ps)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
