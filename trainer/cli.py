"""`meshtrain` command line: a thin layer over the Python API."""
from __future__ import annotations

import argparse
import os
import sys

from trainer.errors import UserError
from trainer.logs import configure as configure_logging

USAGE = """meshtrain train [CONFIG.yaml ...] [key=value ...]

Train a transformer on the (data, stage, model) mesh. Later YAML files and key=value
pairs override earlier ones; `mesh.preset=NAME` loads meshes/presets/NAME.yaml first.
With no arguments: the `small` model on the built-in corpus on all local devices.
If run.dir holds checkpoints, training resumes from the newest complete one; SIGTERM or
Ctrl-C stops after a step every process agrees on and saves (a second Ctrl-C aborts), and the exit status is then 75:
stopped before train.steps, the same command resumes (scripts/slurm/train.sbatch requeues the job on it).
"""
STOPPED_EARLY = 75  # sysexits' EX_TEMPFAIL: a checkpoint was saved before train.steps; run the same command again
KEYS_HEADER = "\nkeys: key, type = default, allowed values; under it the meaning (docs/config.md: the same table)\n"


class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are one-line UserErrors (not usage text and exit 2 from inside argparse)."""

    def error(self, message):
        sub = self.prog.removeprefix("meshtrain").strip()
        raise UserError(f"{sub + ': ' if sub else ''}{message}; see {self.prog} --help")


def launcher_defaults() -> dict | None:
    """Keys a launcher sets as defaults (scripts/slurm/train.sbatch): $MESHTRAIN_DEFAULTS, key=value pairs in
    shell quoting, below every YAML file and key=value of the command line."""
    import shlex
    text = os.environ.get("MESHTRAIN_DEFAULTS", "").strip()
    if not text:
        return None
    from omegaconf import OmegaConf
    pairs = shlex.split(text)
    bad = [p for p in pairs if "=" not in p or p.startswith("=")]
    if bad:
        raise UserError(f"MESHTRAIN_DEFAULTS holds '{bad[0]}', not key=value; write key=value pairs, e.g. "
                        "MESHTRAIN_DEFAULTS='run.dir=runs/x run.progress=false'")
    return OmegaConf.to_container(OmegaConf.from_dotlist(pairs))


def _train(args: list[str]) -> int:
    from trainer.config import keys_help, load_config
    if args and args[0] in ("-h", "--help"):
        print(USAGE + KEYS_HEADER + keys_help())
        return 0
    cfg = load_config(args, base=launcher_defaults())  # every key's range checked before anything is touched
    from trainer.run.distributed import initialize, leave_stopped
    from trainer.run.loop import train
    initialize(cfg.dist)  # before jax touches a device
    if train(cfg).preempted:
        leave_stopped()
        return STOPPED_EARLY
    return 0


def _simulate(args: list[str]) -> int:
    from trainer.config import keys_help, load_config
    from trainer.plan.simulate import plot, simulate
    from trainer.ckpt.sources import resolve
    if args and args[0] in ("-h", "--help"):
        print("meshtrain simulate [CONFIG.yaml ...] [key=value ...]\n\nModel the config's training on K "
              "accelerators (sim.* keys: the machine) as K grows; print MFU per mode and write a plot. It takes "
              "every key of `meshtrain train --help`; its own:\n" + KEYS_HEADER + keys_help("sim."))
        return 0
    cfg = resolve(load_config(args))
    rows = simulate(cfg)
    path = plot(rows, cfg.sim.plot or os.path.join(cfg.run.dir, "simulate.png"), " ".join(args) or "default")
    print(f"plot: {path}" if path else "plot skipped: install the plot extra (pip install -e '.[plot]')")
    return 0


def _inspect(args: list[str]) -> int:
    p = ArgParser(prog="meshtrain inspect", description="List a run's checkpoints (step, size, "
                                "time, mesh, ZeRO stage) and the parameters' shapes and shardings.")
    p.add_argument("--run", required=True, help="the run.dir (or an export)")
    ns = p.parse_args(args)
    from trainer.ckpt.tools import inspect_run
    print(inspect_run(ns.run))
    return 0


def _export(args: list[str]) -> int:
    from trainer.ckpt.tools import EXPORT_DTYPES, export
    p = ArgParser(prog="meshtrain export", description="Write a checkpoint's parameters only "
                                "(start a new run from them with model.init_from=OUT).")
    p.add_argument("--run", required=True, help="the run.dir (or an export)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--out", required=True, help="new directory to write")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, help="cast the parameters (default: as saved)")
    p.add_argument("--format", choices=("orbax", "hf", "peft"), default="orbax",
                   help="orbax (default; meshtrain reads it), hf: a Hugging Face folder of the family (safetensors), "
                        "peft: a LoRA run's adapters as peft writes them")
    p.add_argument("--merge", action="store_true", help="hf of a LoRA run: the adapters merged into the weights")
    ns = p.parse_args(args)
    if ns.format == "hf":
        from trainer.ckpt.hf_export import export_hf
        out = export_hf(ns.run, ns.out, ns.step, ns.dtype, merge=ns.merge)
    elif ns.format == "peft":
        from trainer.ckpt.hf_export import export_peft
        out = export_peft(ns.run, ns.out, ns.step)
    else:
        out = export(ns.run, ns.out, ns.step, ns.dtype)
    print(f"exported parameters to {out}" + {"hf": " (Hugging Face)", "peft": " (peft adapters)"}.get(ns.format, ""))
    return 0


def _plot(args: list[str]) -> int:
    p = ArgParser(prog="meshtrain plot", description="Plot loss, eval loss, eval bits/byte, tokens/s and MFU "
                                "of one or more runs, overlaid.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run.dir of each run (holds metrics.jsonl)")
    p.add_argument("--out", default="plot.png", help="image to write (default: plot.png)")
    ns = p.parse_args(args)
    from trainer.observe.plot import plot_runs
    plot_runs(ns.runs, ns.out)
    print(f"plot: {ns.out}")
    return 0


def _generate(args: list[str]) -> int:
    p = ArgParser(prog="meshtrain generate", description="Sample text from a run's newest "
                                "checkpoint (KV-cache decoding), streamed to stdout, up to the model's end-of-text "
                                "or end-of-turn token (not printed).")
    p.add_argument("--run", required=True, help="the run.dir, an export, or a Hugging Face model folder")
    p.add_argument("--prompt", default="", help="text to continue (default: none: a new document, or a new line "
                   "for a byte-level run); with --chat the user's message")
    p.add_argument("--chat", action="store_true", help="render the prompt with the run's chat template as a user "
                   "message awaiting the assistant's reply, and print only the reply")
    p.add_argument("--system", help="with --chat: a system message before the user's")
    p.add_argument("--stop", action="append", default=[], metavar="TOKEN_OR_TEXT", help="also stop at this added "
                   "token of the tokenizer (e.g. '<|im_end|>'), or before this text (repeatable)")
    p.add_argument("--tokens", type=int, default=256,
                   help="how many tokens to sample: of the run's tokenizer, or bytes where it has none (default: 256)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: 0.8; with --speculative 0)")
    p.add_argument("--top_k", type=int, default=40, help="sample from the k likeliest; 0 = all (default: 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--speculative", action="store_true", help="greedy, drafting with the model's multi-token-"
                   "prediction modules and verifying with the main model (its greedy output exactly); logs the "
                   "acceptance rate and the tokens per forward")
    ns = p.parse_args(args)
    from trainer.run.generate import completion
    temperature = ns.temperature if ns.temperature is not None else 0.0 if ns.speculative else 0.8
    done = completion(ns.run, ns.prompt, ns.tokens, temperature, ns.top_k, ns.seed, ns.step, chat=ns.chat,
                      system=ns.system, stops=tuple(ns.stop), speculative=ns.speculative)
    if done.stats is not None:  # what the drafts did, on stderr: stdout is the text
        print(done.stats.summary(), file=sys.stderr)
    return 0


def _prepare(args: list[str]) -> int:
    p = ArgParser(prog="meshtrain prepare", description="Tokenize text files, JSONL and Parquet records (texts, "
                  "conversations, prompt/completion), folders or builtin into a token .bin (train documents, then "
                  "held-out ones), its loss mask where records have an assistant, and its JSON sidecar; train with "
                  "data.source=OUT.")
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="text, .jsonl or .parquet file, folder, or builtin")
    p.add_argument("--out", required=True, help="the .bin to write (its sidecar: OUT.json), or a folder: shards and "
                   "their manifest.json (train with data.source=FOLDER)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", help="a Hugging Face tokenizer.json, or a folder holding one")
    how.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE",
                     help="train a byte-level BPE of this many tokens on the train documents first")
    p.add_argument("--heldout", type=float, default=0.05, help="share of documents held out (default: 0.05)")
    p.add_argument("--field", default="text", help="the column of a text record (default: text)")
    p.add_argument("--chat-template", metavar="FILE", help="a jinja chat template to render conversations with "
                   "(default: the tokenizer folder's)")
    p.add_argument("--date", help="the date a template's strftime_now gives, YYYY-MM-DD (default: 2026-01-01)")
    p.add_argument("--loss-on", default="assistant", choices=("assistant", "all"),
                   help="the tokens of a conversation the loss counts (default: assistant)")
    p.add_argument("--require-counted", action="store_true", help="a record without a token the loss counts is "
                   "an error (default: kept, and counted in the summary and the sidecar)")
    p.add_argument("--max-length", type=int, default=1024, help="preference pairs: each sequence (prompt + answer) "
                   "keeps its first N tokens; a pair whose prompt alone has N is dropped (TRL's; default: 1024)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--workers", type=int, help="with --out FOLDER: local worker processes (default: the cores)")
    p.add_argument("--ray", metavar="ADDRESS", help="with --out FOLDER: the shards as tasks on the Ray cluster at "
                   "ADDRESS (or auto)")
    p.add_argument("--shard-mb", type=float, default=256.0, help="with --out FOLDER: input megabytes of text files "
                   "per shard (a record file is a shard of its own; default: 256)")
    ns = p.parse_args(args)
    from trainer.config.paths import check
    for src in ns.sources:
        check(src, "SOURCE")
    check(ns.out, "--out")
    common = dict(show_progress=not ns.no_progress, field=ns.field, chat_template=ns.chat_template, date=ns.date,
                  loss_on=ns.loss_on, require_counted=ns.require_counted)
    if ns.out.endswith(".bin"):
        if ns.workers is not None or ns.ray:
            raise UserError(f"--workers and --ray write shards into a folder; give --out a folder instead of "
                            f"'{ns.out}'")
        from trainer.data.prepare import prepare
        prepare(ns.sources, ns.out, ns.tokenizer, ns.train_tokenizer, ns.heldout, max_length=ns.max_length, **common)
        return 0
    from trainer.data.shards import prepare_folder
    prepare_folder(ns.sources, ns.out, ns.tokenizer, ns.train_tokenizer, ns.heldout, workers=ns.workers,
                   ray=ns.ray, shard_mb=ns.shard_mb, **common)
    return 0


def _eval(args: list[str]) -> int:
    p = ArgParser(prog="meshtrain eval", description="Score a run's checkpoint (or an export, or a Hugging Face "
                  "folder) on lm-evaluation-harness tasks, on the mesh the key=value overrides give; lm-eval's results "
                  "JSON goes to OUT (default: RUN/eval/harness_<tasks>.json) and a table to stdout. Needs "
                  "pip install 'meshtrain[eval]'.")
    p.add_argument("--run", required=True, help="the run.dir, an export, or a Hugging Face model folder")
    p.add_argument("--tasks", required=True, help="task names, comma-separated: meshtrain's own (meshtrain_mc, "
                   "meshtrain_rolling, meshtrain_gen) or tasks under --include-path")
    for flag, kw in (("--include-path", dict(action="append", default=[], help="a folder of task YAML files "
                                             "(repeatable); their relative data_files are read beside them")),
                     ("--num-fewshot", dict(type=int, help="few-shot examples (lm-eval's seed picks them)")),
                     ("--limit", dict(type=float, help="at most this many documents per task (or a share, < 1)")),
                     ("--gen-kwargs", dict(help="generation arguments over the tasks', e.g. temperature=0")),
                     ("--output", dict(help="where the results JSON goes")),
                     ("--max-length", dict(type=int, help="the context requests are truncated to (lm-eval's "
                                                          "max_length; default: the model's)"))):
        p.add_argument(flag, "--" + flag[2:].replace("-", "_"), **kw)  # lm-eval spells them with underscores
    p.add_argument("--log-samples", "--log_samples", action="store_true", help="keep each request and response "
                   "in the results")
    p.add_argument("--apply-chat-template", "--apply_chat_template", action="store_true",
                   help="render each request with the tokenizer's chat template")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--seed", type=int, default=1234, help="lm-eval's seeds, few-shot sampling's included")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the run's config (e.g. mesh.data=2 "
                   "mesh.model=4)")
    ns = p.parse_args(args)
    from trainer.config import load_config
    from trainer.run.distributed import initialize
    from trainer.run.harness import evaluate, write_results
    initialize(load_config([o for o in ns.overrides if o.startswith("dist.")]).dist)  # before jax touches a device
    tasks = [t for t in ns.tasks.split(",") if t]
    results = evaluate(ns.run, tasks, ns.overrides, ns.include_path, ns.num_fewshot, ns.limit, ns.log_samples,
                       ns.gen_kwargs, ns.apply_chat_template, ns.step, ns.seed, max_length=ns.max_length)
    import jax
    if jax.process_index() == 0:  # the process that drove lm-eval holds its whole results
        print(write_results(results, ns.run, tasks, ns.output))
    return 0


def _plan(args: list[str]) -> int:
    from trainer.plan.command import main as plan
    return plan(args)


COMMANDS = {"train": _train, "plan": _plan,
            "inspect": _inspect, "export": _export, "simulate": _simulate, "plot": _plot,
            "generate": _generate, "prepare": _prepare, "eval": _eval}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging()  # library warnings on stderr; the library itself configures no logging
    parser = ArgParser(prog="meshtrain", description="Train transformers on a device mesh.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to do")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="configs and key=value overrides")
    if not argv:
        argv = ["train"]
    try:
        return COMMANDS[parser.parse_args(argv[:1]).command](argv[1:])
    except UserError as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("meshtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
