"""Evaluation every train.eval_every steps (and after the last): the mean loss over the counted tokens
of train.eval_batches held-out batches, and bits per byte where the data's bytes per token are known. A mixture
(data.mixture): each source's (eval_loss/NAME, eval_bpb/NAME) and eval_loss their mean by the step's weights."""
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
        if hasattr(run.batches, "eval_of"):  # a mixture: each source's, and their mean by the step's weights
            return self._mixture(run, step)
        if run.cfg.train.objective == "dpo":
            return self._pairs(run, step)
        total, count = self._mean(run, run.batches.eval)
        run.eval_loss = float(total / count) if count > 0 else 0.0
        run.record.update({"step": step, "eval_loss": run.eval_loss, "eval_counted_tokens": int(count)})
        if self.bpt:
            run.record["eval_bpb"] = bits_per_byte(run.eval_loss, self.bpt)

    def _pairs(self, run, step: int):
        """Preference pairs: eval_loss (the pair loss over the held-out pairs, plus the sft term) and each metric's
        mean over them, as eval_rewards/accuracies and so on (TRL's names)."""
        got = jax.device_get([run.eval_fn(run.state["params"], run.batch(run.batches.eval(i))) for i in range(self.n)])
        tot = {k: float(np.sum([g[k] for g in got], dtype=np.float64)) for k in got[0]}
        per = lambda k, n: tot[k] / tot[n] if tot[n] > 0 else 0.0  # noqa: E731
        run.eval_loss = per("pair", "pairs") + run.cfg.dpo.sft_weight * per("sft", "chosen")
        run.record.update({"step": step, "eval_loss": run.eval_loss, "eval_pairs": int(tot["pairs"])})
        from models.objectives.dpo import METRICS
        run.record.update({f"eval_{k}": per(k, "pairs") for k in METRICS})

    def _mean(self, run, batch_of) -> tuple[float, float]:
        """(loss sum, counted tokens) over the eval batches: one mean over all their counted tokens."""
        sums = jax.device_get([run.eval_fn(run.state["params"], run.batch(batch_of(i))) for i in range(self.n)])
        return np.sum(sums, axis=0, dtype=np.float64)  # a collective's result: every process waits

    def _mixture(self, run, step: int):
        b, losses, counted = run.batches, [], 0
        for j, name in enumerate(b.names):
            total, count = self._mean(run, lambda i, j=j: b.eval_of(j, i))
            losses.append(float(total / count) if count > 0 else 0.0)
            counted += int(count)
            run.record[f"eval_loss/{name}"] = losses[-1]
            if bpt := b.parts[j].c.bytes_per_token:
                run.record[f"eval_bpb/{name}"] = bits_per_byte(losses[-1], bpt)
        w = b.weights(step - 1)
        run.eval_loss = float(np.dot(w, losses) / w.sum())
        run.record.update({"step": step, "eval_loss": run.eval_loss, "eval_counted_tokens": counted})
