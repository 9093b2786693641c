"""`meshtrain train` with train.objective=grpo: prompts from data.source (trainer/data/prompts.py: JSONL or Parquet
records with a `prompt`, text or a list of messages, and any other fields, which reach the reward functions, as they
are or prepared by `meshtrain prepare`), a generation every
grpo.num_iterations steps (trainer/rl/rollout.py: train.batch_size completions, grpo.num_generations per prompt, the
prompts of generation g a function of (train.seed, g)), one optimizer step of the train step per iteration.

Checkpoints are written at generation boundaries only (a step that starts a generation): a resume samples the
generation that an uninterrupted run samples there, from the same parameters and key, so it continues bit for bit.
Metrics, as TRL 1.16 names them, go to metrics.jsonl each step: loss, grad_norm, kl, entropy, clip_ratio/* (low_min
and high_max from one more forward at a generation's later iterations), and the
generation's reward, reward_std, rewards/{fn}/mean and std, frac_reward_zero_std, completions/*, num_tokens,
sampling/logp_difference/max."""
from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console

from meshes import STAGE
from trainer.ckpt.checkpoint import Checkpointer
from trainer.ckpt.initial import initial_state
from trainer.ckpt.params import init_params
from trainer.ckpt.sources import resolve
from trainer.config import Config, to_yaml
from trainer.data.records import read
from trainer.errors import UserError
from trainer.observe.metrics import MetricsWriter
from trainer.rl import rewards as reward_fns
from trainer.rl.rollout import Settings, generation
from trainer.run.context import Result, check_run_dir
from trainer.state import make_setup
from trainer.step import jit_train_step


def _codec(cfg: Config):
    """(encode(record, where) -> its prompt's ids, decode(ids) -> text, end ids, pad id) of the run's tokenizer
    (data.tokenizer, else the model.init_from folder's tokenizer.json), else bytes."""
    from trainer.config import replace
    from trainer.data import prompts as prompt_ids
    from trainer.run.generate import _Bytes, _Tokens
    path = cfg.data.tokenizer
    if path is None and cfg.model.init_from and (Path(cfg.model.init_from) / "tokenizer.json").is_file():
        path = str(Path(cfg.model.init_from) / "tokenizer.json")
    if path is None:
        if cfg.model.vocab_size is not None and cfg.model.vocab_size > 256 and cfg.model.init_from:
            raise UserError(f"train.objective=grpo needs the tokenizer of model.init_from={cfg.model.init_from} (a "
                            f"vocabulary of {cfg.model.vocab_size}); set data.tokenizer to its tokenizer.json")
        b = _Bytes()

        def encode_bytes(rec, where):
            if not isinstance(rec["prompt"], str):
                raise UserError(f"{where}: a conversational prompt needs a chat template beside the run's tokenizer, "
                                "and this run decodes bytes; give text prompts or a tokenizer with a template")
            return b.encode(rec["prompt"])
        return encode_bytes, (lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace")), (), 0
    t = _Tokens(replace(cfg, data={"tokenizer": path}), chat=False)
    return ((lambda rec, where: prompt_ids.encode(t.tok, t.start, t.template, rec, where)),
            (lambda ids: t.tok.decode(list(ids), skip_special_tokens=True)), tuple(sorted(t.eos())), t.eot)


def _tokens_seen(run_dir: Path, step: int) -> int:
    """num_tokens at `step` as metrics.jsonl recorded it (0 at step 0, or where no record says)."""
    path = run_dir / "metrics.jsonl"
    if step == 0 or not path.exists():
        return 0
    seen = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return next((int(r["num_tokens"]) for r in seen if r.get("step") == step and "num_tokens" in r), 0)


def _clip_extremes(s, params: dict, host: dict, iteration: int, microbatches: int) -> dict:
    """TRL's clip_ratio/low_min and high_max of the step about to run (per microbatch, the smallest / largest
    completion's share of clipped tokens, averaged): 0 at a generation's first iteration (every ratio is 1), else
    from one forward of the parameters the step starts from (the train step returns no per-completion values)."""
    if iteration == 0:
        return {"clip_ratio/low_min": 0.0, "clip_ratio/high_max": 0.0}
    from models.objectives.grpo import clip_extremes, sums
    from trainer.rl.rollout import logps
    got = sums(s.model.grpo, logps(s.model, params, host, microbatches), host["old_logp"], host["ref_logp"],
               host["advantage"], {"loss": host["loss_weight"], "metric": host["metric_weight"]}, host["completion"])
    return clip_extremes(np.asarray(got["row_low"]), np.asarray(got["row_high"]), microbatches)


def prompts(cfg: Config, encode, context: int) -> list[dict]:
    """Every record of data.source with its prompt's ids: the training split of a `meshtrain prepare` of prompts, or
    a local JSONL or Parquet file's records encoded here; one line for another source, a record without a prompt
    (text or a list of messages), one its chat template fails on, or one whose prompt plus
    grpo.max_completion_length exceeds the model's context."""
    from trainer.data.checks import check_data
    from trainer.data.prompts import check, prepared
    src = Path(cfg.data.source)
    out = prepared(cfg.data.source)
    if out is not None:  # their tokenizer against model.init_from's, as a run on prepared data checks it
        check_data(cfg)
    wheres = [f"{cfg.data.source} prompt {i + 1}" for i in range(len(out or []))]
    if out is None:
        if src.suffix not in (".jsonl", ".parquet") or not src.is_file():
            raise UserError(f"train.objective=grpo reads its prompts from data.source, and {cfg.data.source} is "
                            "neither a `meshtrain prepare` of prompts nor a local .jsonl or .parquet file; give a "
                            "file of records with a 'prompt'")
        out, wheres = [], []
        for where, rec, _ in read(src):
            check(rec, where)
            out.append({**rec, "prompt_ids": encode(rec, where)})
            wheres.append(where)
    for where, rec in zip(wheres, out):
        if len(rec["prompt_ids"]) + cfg.grpo.max_completion_length > context:
            raise UserError(f"{where}: its prompt's {len(rec['prompt_ids'])} tokens plus grpo.max_completion_length="
                            f"{cfg.grpo.max_completion_length} exceed the model's context of {context} "
                            "(model.seq_len); shorten the prompt, lower grpo.max_completion_length or raise "
                            "model.seq_len")
    if not out:
        raise UserError(f"data.source {cfg.data.source} holds no prompt; give records with a 'prompt'")
    return out


def train(cfg: Config, devices=None, console: Console | None = None) -> Result:
    """Train with GRPO according to cfg; the final state and the logged metrics."""
    console = console or Console(stderr=True, soft_wrap=True)
    cfg = resolve(cfg, tensors=False)
    g, t = cfg.grpo, cfg.train
    if not g.rewards:
        raise UserError("train.objective=grpo needs reward functions: set grpo.rewards (exact_match:FIELD, "
                        "regex:PATTERN, numeric:FIELD or module:function)")
    functions = reward_fns.load_all(g.rewards)
    encode, decode, ends, pad = _codec(cfg)
    s = make_setup(cfg, devices)
    if s.mesh.shape[STAGE] > 1:
        raise UserError(f"train.objective=grpo with mesh.stage={s.mesh.shape[STAGE]}: sampling through a pipeline's "
                        "stages is not built (its learning step is); use mesh.stage=1 (data, model and context axes "
                        "sample and learn)")
    records = prompts(cfg, encode, s.model.seq_len)
    run_dir = check_run_dir(cfg.run.dir)
    ckpt = Checkpointer(s, cfg.run.dir, log=console.print)
    try:
        restored = ckpt.restore()
        state, start = restored or (initial_state(s, console.print), 0)
        reference = init_params(s, g.reference or cfg.model.init_from) if g.beta else None
        st = Settings(G=g.num_generations, max_new=g.max_completion_length, temperature=g.temperature,
                      loss_type=g.loss_type, scale_rewards=g.scale_rewards, mask_truncated=g.mask_truncated_completions,
                      microbatches=t.microbatches, end_ids=ends, pad=pad, decode=decode, dtype=s.dtype)
        if jax.process_index() == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(to_yaml(cfg))
        writer, history = MetricsWriter(run_dir, enabled=jax.process_index() == 0, resume_step=start), []
        step_fn, key, batch, gen = jit_train_step(s), jax.random.key(t.seed), None, {}
        tokens = _tokens_seen(run_dir, start)
        t0 = time.perf_counter()
        with jax.set_mesh(s.mesh):
            for step in range(start, t.steps):
                if batch is None or step % g.num_iterations == 0:
                    n = step // g.num_iterations
                    B = t.batch_size // g.num_generations  # prompts per generation
                    pick = np.random.default_rng([t.seed, n]).choice(len(records), B, replace=B > len(records))
                    host, gen = generation(s.model, state["params"], [records[i] for i in pick], functions,
                                           list(g.reward_weights), st, jax.random.fold_in(key, n), reference)
                    tokens += gen.pop("tokens")
                    batch = jax.device_put(host, s.batch_sharding())
                extremes = _clip_extremes(s, state["params"], host, step % g.num_iterations, t.microbatches)
                state, m = step_fn(state, batch)
                record = {"step": step + 1, **{k.removeprefix("aux/"): float(v) for k, v in m.items()
                                               if np.ndim(v) == 0}, **extremes, **gen, "num_tokens": tokens}
                writer.write(record)
                history.append(record)
                if (step + 1) % cfg.run.log_every == 0 or step + 1 == t.steps:
                    console.print(f"step {step + 1}/{t.steps} | loss {record['loss']:.4f} | reward "
                                  f"{record['reward']:.4f} | kl {record.get('kl', 0.0):.4f} | "
                                  f"{time.perf_counter() - t0:.1f}s")
                # at generation boundaries (a resume samples what an uninterrupted run samples there), and the last
                # step whatever it is (a later run with more steps samples a new generation from it)
                if step + 1 == t.steps or ((step + 1) % g.num_iterations == 0 and ckpt.due(step + 1)):
                    ckpt.save(step + 1, state)
        writer.close()
    finally:
        ckpt.close()
    return Result(s, state, history, None, start)
