"""The metrics lines of a run: loss, grad norm, lr, tokens/s, MFU every run.log_every steps (StepMetrics, the
loop's usual sync point), written to metrics.jsonl and TensorBoard and shown with a progress bar (Report)."""
from __future__ import annotations

import time

import jax
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from models import flops_per_token, hardware_flops_per_token
from models.objectives.dpo import METRICS as DPO_METRICS, unit
from trainer.observe.metrics import device_peak, peak_devices
from trainer.run.plugin import Plugin


def _count(x) -> int | float:
    """The step's counted tokens: a whole number for 0/1 loss weights, as written."""
    x = float(x)
    return int(x) if x.is_integer() else x


class StepMetrics(Plugin):
    """On a logged step: the step's metrics fetched to the host (run.host) and their record fields."""
    part = "compute"  # the fetch waits for the step to finish

    def __init__(self, run):
        s = run.s
        self.peak, src = device_peak(s.dtype)  # measured once, before training, on CPU
        self.n_peak = peak_devices(s.mesh)
        self.tokens = s.cfg.train.batch_size * s.model.seq_len
        self.fpt, self.hfpt = flops_per_token(s.model), hardware_flops_per_token(s.model)
        run.console.print(f"init+compile {run.compile_s:.1f}s | peak {self.peak and self.peak / 1e12:.3g} TFLOP/s x "
                          f"{self.n_peak} ({src}) | {self.fpt / 1e6:.1f} MFLOP/token")
        self.t_from, self.from_step, self.rewind = None, run.start, None

    def before_step(self, run, step: int):
        if run.rewound_at is not self.rewind:  # a rollback: time the steps from there
            self.rewind, self.t_from = run.rewound_at, None
        if self.t_from is None:  # from the end of the last sync point: eval and saves are not step time
            self.t_from, self.from_step = run.synced_at, step - 1

    def at_sync(self, run, step: int):
        if not run.logging(step):
            return
        m = run.host = jax.device_get(run.metrics)  # the loop's only regular host sync
        dt = (time.perf_counter() - self.t_from) / (step - self.from_step)
        self.t_from = None
        tps, peak = self.tokens / dt, (self.peak * self.n_peak if self.peak else None)
        run.record.update({"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                           "lr": float(m["lr"]), "counted_tokens": _count(m["counted_tokens"]),
                           "tokens_per_sec": tps, "step_time_s": dt,
                           "mfu": self.fpt * tps / peak if peak else None,
                           "hfu": self.hfpt * tps / peak if peak else None,
                           "skipped": int(m["skipped"]), "bad_streak": int(m["bad_streak"]),
                           # a family's auxiliary outputs (models/spec.py), each its mean over the step, and its
                           # statistics (an MoE's moe/dropped, moe/overflow; DeepSeek's moe/imbalance per layer)
                           **{k: float(v) for k, v in m.items() if k.startswith(("aux/", "moe/"))},
                           **{k: float(m[k]) for k in DPO_METRICS if k in m},  # train.objective=dpo (models/objectives/dpo.py)
                           **({"data_offset": run.offset} if run.offset else {})})


class Report(Plugin):
    """The step's record (metrics, eval) written and shown: metrics.jsonl, TensorBoard, the console."""

    def __init__(self, run):
        t = run.cfg.train
        self.progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}"), console=run.console, disable=not run.cfg.run.progress)
        self.progress.start()
        self.task = self.progress.add_task("train", total=t.steps, completed=run.start, info="")
        self.unit = f" {unit(run.s.model.dpo)}" if run.s.model.dpo is not None else ""  # the token loss's: none

    def at_sync(self, run, step: int):
        rec = run.record
        if len(rec) <= 1:
            return
        run.writer.write(rec)
        run.history.append(dict(rec))
        if "loss" in rec:
            mfu = rec["mfu"]
            info = (f"loss {rec['loss']:.3f}{self.unit} | grad norm {rec['grad_norm']:.3f} | lr {rec['lr']:.2e} | "
                    f"{rec['tokens_per_sec']:,.0f} tok/s | MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
                    + (f" | eval {rec['eval_loss']:.3f}" if "eval_loss" in rec else ""))
            self.progress.update(self.task, completed=step, info=info)
            run.console.print(f"step {step}/{run.cfg.train.steps} | {info}")

    def on_exit(self, run, error):
        self.progress.update(self.task, completed=run.done)
        self.progress.stop()
