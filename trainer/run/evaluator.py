"""Evaluation every train.eval_every steps (and after the last): the mean loss over the counted tokens
of train.eval_batches held-out batches, and bits per byte where the data's bytes per token are known."""
from __future__ import annotations

import jax
import numpy as np

from trainer.data.batches import bits_per_byte
from trainer.run.plugin import Plugin


class Eval(Plugin):
    part, waits = "eval", "eval (its loss is a mean over the devices)"

    def __init__(self, run):
        self.every, self.n = run.cfg.train.eval_every, run.cfg.train.eval_batches
        self.bpt = run.batches.c.bytes_per_token

    def due(self, run, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == run.cfg.train.steps)

    def at_sync(self, run, step: int):
        if not self.due(run, step):
            return
        # (loss sum, counted tokens) per batch: one mean over all their counted tokens
        sums = jax.device_get([run.eval_fn(run.state["params"], run.batch(run.batches.eval(i))) for i in range(self.n)])
        total, count = np.sum(sums, axis=0, dtype=np.float64)  # a collective's result: every process waits
        run.eval_loss = float(total / count) if count > 0 else 0.0
        run.record.update({"step": step, "eval_loss": run.eval_loss, "eval_counted_tokens": int(count)})
        if self.bpt:
            run.record["eval_bpb"] = bits_per_byte(run.eval_loss, self.bpt)
