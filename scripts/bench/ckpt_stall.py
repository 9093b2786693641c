"""How much an asynchronous checkpoint save slows training: step time during a save vs a normal step.

  python scripts/bench/ckpt_stall.py [key=value ...]

Trains a model whose train state (parameters + AdamW moments) is at least 200 MB. Five times:
three normal steps, then a save through the trainer's Checkpointer and every step until it is
written. The first step during a save is timed from just before `save()` (so its blocking part,
the checksums and the copy off the devices, counts against that step), the others whole; each
save's ratio is their mean over the median of the normal steps just before it.
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from trainer.ckpt.checkpoint import Checkpointer  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.data.batches import Batches, load_corpus  # noqa: E402
from trainer.state import init_state, make_setup  # noqa: E402
from trainer.step import jit_train_step  # noqa: E402

DEFAULTS = ["model.preset=tiny", "model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=8",
            "model.d_ff=2048", "model.vocab_size=8192", "model.seq_len=64", "train.batch_size=16",
            "data.source=synthetic", "mesh.data=-1", "run.progress=false"]


def main(argv, n_rounds=5):
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

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    rounds = []  # (normal steps, blocking part of save(), steps during the save, whole save)
    with jax.set_mesh(s.mesh), tempfile.TemporaryDirectory() as tmp:
        for _ in range(3):  # compile and warm up
            step()
        ck = Checkpointer(s, tmp)
        ck.save(i, state)  # the first save compiles the checksums and warms Orbax up: not timed
        ck.mngr.wait_until_finished()
        for _ in range(n_rounds):
            # Normal steps right before each save, so that both see the same load on the machine.
            normal = [timed(step) for _ in range(3)]
            t0 = time.perf_counter()
            ck.save(i, state)
            blocking = time.perf_counter() - t0
            step()
            during = [time.perf_counter() - t0]
            while ck.mngr.is_saving_in_progress():
                during.append(timed(step))
            rounds.append((normal, blocking, during, time.perf_counter() - t0))
        ck.close()
    ratios = [statistics.mean(d) / statistics.median(n) for n, _, d, _ in rounds]
    worst = max(max(d) / statistics.median(n) for n, _, d, _ in rounds)
    print(f"train state {mb:.0f} MB on {s.mesh.size} {s.mesh.devices.flat[0].platform} device(s), mesh "
          f"{dict(s.mesh.shape)}, ZeRO-{cfg.train.zero_stage}")
    for k, (n, blk, d, whole) in enumerate(rounds):
        print(f"save {k + 1}: normal step {statistics.median(n) * 1e3:.0f} ms | save() blocks {blk * 1e3:.0f} ms | "
              f"{len(d)} step(s) during the {whole * 1e3:.0f} ms save: " + ", ".join(f"{x * 1e3:.0f}" for x in d)
              + f" ms | ratio {ratios[k]:.2f}x")
    print(f"ratio (step during a save / normal step): median {statistics.median(ratios):.2f}x over "
          f"{len(ratios)} saves, worst single step {worst:.2f}x")
    if mb < 200:
        print(f"note: the state is {mb:.0f} MB, under the 200 MB this measurement is meant for")


if __name__ == "__main__":
    main(sys.argv[1:])
