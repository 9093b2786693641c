"""How much an asynchronous checkpoint save slows training: step time during a save vs a normal step.

  python scripts/ckpt_stall.py [key=value ...]

Trains a model whose train state (parameters + AdamW moments) is at least 200 MB, times normal
steps, then starts saves through the trainer's Checkpointer and times every step until each save
has been written. A "step during a save" is timed from just before `save()` is called (so its
blocking part, the copy off the devices, counts against that step) to the end of the step, and
then each further step that starts while the background write is still going.
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from trainer.checkpoint import Checkpointer  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.data import Batches, load_corpus  # noqa: E402
from trainer.state import init_state, make_setup  # noqa: E402
from trainer.step import jit_train_step  # noqa: E402

DEFAULTS = ["model.preset=tiny", "model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=8",
            "model.d_ff=2048", "model.vocab_size=8192", "model.seq_len=64", "train.batch_size=8",
            "data.source=synthetic", "mesh.data=-1", "run.progress=false"]


def main(argv):
    cfg = load_config(DEFAULTS + argv)
    s = make_setup(cfg)
    state = init_state(s)
    mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6
    step_fn = jit_train_step(s)
    b = Batches(load_corpus("synthetic"), 0, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size)
    batch = jax.device_put(b.global_train(0), s.batch_sharding())
    i = 0

    def step():
        nonlocal state, i
        state, m = step_fn(state, batch)
        jax.block_until_ready(m)
        i += 1

    with jax.set_mesh(s.mesh), tempfile.TemporaryDirectory() as tmp:
        for _ in range(3):  # compile and warm up
            step()
        normal = []
        for _ in range(8):
            t = time.perf_counter()
            step()
            normal.append(time.perf_counter() - t)
        ck = Checkpointer(s, tmp)
        ck.save(i, state)  # the first save compiles the checksums and warms Orbax up: not timed
        ck.mngr.wait_until_finished()
        during, blocking, writes = [], [], []
        for _ in range(3):
            t0 = time.perf_counter()
            ck.save(i, state)
            blocking.append(time.perf_counter() - t0)
            step()
            during.append(time.perf_counter() - t0)
            while ck.mngr.is_saving_in_progress():
                t = time.perf_counter()
                step()
                during.append(time.perf_counter() - t)
            writes.append(time.perf_counter() - t0)
        ck.close()
    base = statistics.median(normal)
    print(f"train state {mb:.0f} MB on {s.mesh.size} {s.mesh.devices.flat[0].platform} device(s), mesh "
          f"{dict(s.mesh.shape)}, ZeRO-{cfg.train.zero_stage}")
    print(f"normal step {base * 1e3:.1f} ms (median of {len(normal)})")
    print(f"save(): blocking part {statistics.mean(blocking) * 1e3:.1f} ms; whole save written in "
          f"{statistics.mean(writes) * 1e3:.0f} ms on average ({len(writes)} saves)")
    print(f"steps during a save: {len(during)}, mean {statistics.mean(during) * 1e3:.1f} ms, "
          f"max {max(during) * 1e3:.1f} ms")
    print(f"ratio (step during a save / normal step): mean {statistics.mean(during) / base:.2f}x, "
          f"max {max(during) / base:.2f}x")
    if mb < 200:
        print(f"note: the state is {mb:.0f} MB, under the 200 MB this measurement is meant for")


if __name__ == "__main__":
    main(sys.argv[1:])
