"""lm-evaluation-harness during training: eval.harness_tasks scored every eval.harness_every steps (0:
train.eval_every) and after the last, by the run's own parameters on its own mesh (trainer/run/harness.py, as
`meshtrain eval` scores a checkpoint); each task's numeric scores logged as `<task>/<metric>` (lm-eval's filter
after a slash where it is not `none`) to metrics.jsonl and TensorBoard. Its time is the eval part of goodput, and
the step watchdog watches it as any other phase."""
from __future__ import annotations

from trainer.run.plugin import Plugin


def metric_name(task: str, key: str) -> str:
    """lm-eval's 'acc,none' of a task as '<task>/acc'; 'exact_match,strip' as '<task>/exact_match/strip'."""
    metric, _, flt = key.partition(",")
    return f"{task}/{metric}" + (f"/{flt}" if flt and flt != "none" else "")


def scores(results: dict) -> dict:
    """Every numeric score of lm-eval's results by metric_name (standard errors and sample counts left out)."""
    return {metric_name(task, k): float(v) for task, got in results["results"].items() for k, v in got.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "_stderr" not in k and k != "sample_len"}


class Benchmarks(Plugin):
    part, waits = "eval", "lm-evaluation-harness tasks (eval.harness_tasks)"

    def __init__(self, run):
        e = run.cfg.eval
        self.tasks = list(e.harness_tasks)
        self.every = e.harness_every or run.cfg.train.eval_every
        if not self.tasks:
            return
        from trainer.run.harness import Tokenizer, need_lm_eval, task_configs, tokenizer_of
        need_lm_eval()
        self.configs = task_configs(self.tasks, list(e.include_path))  # a bad name stops the run before step 1
        self.tok = Tokenizer(tokenizer_of(run.cfg))

    def due(self, run, step: int) -> bool:
        return bool(self.tasks) and self.every > 0 and (step % self.every == 0 or step == run.cfg.train.steps)

    def at_sync(self, run, step: int):
        if not self.due(run, step):
            return
        from trainer.run.harness import lm_results, make_lm
        from meshes import DATA
        e = run.cfg.eval
        lm = make_lm(run.s.model, run.state["params"], self.tok, run.s.model.seq_len, run.s.mesh.shape[DATA])
        got = lm_results(lm, self.configs, num_fewshot=e.num_fewshot, limit=e.limit)  # meshtrain eval's seed
        run.record.update({"step": step, **scores(got)})
