"""Goodput as a loop plug-in: at the end of a run, where its wall time went (trainer/observe/goodput.py),
in goodput.jsonl, TensorBoard and the result; the loop times each part as it runs."""
from __future__ import annotations

from trainer.run.plugin import Plugin


class GoodputRecord(Plugin):
    def on_exit(self, run, error):
        if error is None:
            run.goodput_record = run.goodput.record()
            run.writer.write_goodput({"step": run.done, **run.goodput_record})
