"""EleutherAI's lm-evaluation-harness on meshtrain's model (`meshtrain eval`): a `TemplateLM` whose three request
kinds run on the run's mesh, computed as lm-eval's own Hugging Face backend (`lm_eval.models.huggingface.HFLM`)
computes them, so that the same model scores the same:

  loglikelihood          context + continuation encoded whole and split where the context's own ids end (lm-eval's
                         `_encode_pair`); the input is (context + continuation)[-(max_length + 1):][:-1], the
                         continuation's log-probabilities summed and `is_greedy` whether each is the argmax
  loglikelihood_rolling  the document's ids in lm-eval's rolling windows of max_length (prefix token first,
                         `get_rolling_token_windows` + `make_disjoint_window`), each window a loglikelihood request
  generate_until         the context encoded as the tokenizer encodes it (BOS first where it adds one), its last
                         max_length - max_gen_toks ids kept, greedy unless the task's gen_kwargs sample, stopped at
                         EOS, cut at the first `until` string (lm-eval's `postprocess_generated_text`)

Requests are padded to length buckets (`models/sampler.py bucket`: a few per octave) and rows to a multiple of the
data ranks, so a task compiles a bounded number of programs. `lm_eval` is an optional extra (`pip install
'meshtrain[eval]'`, no torch)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.sampler import bucket
from trainer.errors import UserError

ROWS = 8  # requests scored per forward (rounded up to the data ranks)


def need_lm_eval():
    """lm_eval's model base, or one line saying how to install it."""
    try:
        from lm_eval.api.model import TemplateLM
    except ImportError:
        raise UserError("meshtrain eval runs lm-evaluation-harness, which is not installed; pip install "
                        "'meshtrain[eval]' (lm_eval 0.4, no torch)") from None
    return TemplateLM


class Tokenizer:
    """The run's tokenizer.json as transformers' fast tokenizer encodes with it (its post-processor's specials by
    default), with the BOS and EOS its tokenizer_config.json names (else meshtrain's end-of-text token as EOS)."""

    def __init__(self, path: Path):
        from trainer.data.tokenizer import load_tokenizer
        self.tok, _, eot = load_tokenizer(str(path))
        conf = path.parent / "tokenizer_config.json"
        named = json.loads(conf.read_text()) if conf.is_file() else {}

        def token(key):
            t = named.get(key)
            t = t.get("content") if isinstance(t, dict) else t
            return self.tok.token_to_id(t) if isinstance(t, str) else None
        self.bos, eos = token("bos_token"), token("eos_token")
        self.eos = eos if eos is not None else eot
        self.bos_text = self.tok.id_to_token(self.bos) if self.bos is not None else None
        self.name = str(path.parent).replace("/", "__")  # lm-eval's cache fingerprint, as HFLM's name_or_path
        from trainer.data.chat import load_template, parse_date
        self.template = load_template(path, None, parse_date(None))

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The messages rendered as HFLM's apply_chat_template renders them (transformers' apply_chat_template with
        continue_final_message where no generation prompt is added: the text ends where the last message does;
        without the system message where the template fails with it); one line without a template."""
        from trainer.data.chat import TemplateFailed
        if self.template is None:
            raise UserError("--apply-chat-template needs a chat template beside the run's tokenizer "
                            "(chat_template.jinja or tokenizer_config.json's chat_template)")
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        msgs = [dict(m) for m in messages]
        if not add_generation_prompt and msgs:
            msgs[-1]["content"] = msgs[-1]["content"] + tag
        try:
            text = self.template.render(msgs, add_generation_prompt=add_generation_prompt)
        except TemplateFailed:
            text = self.template.render([m for m in msgs if m.get("role") != "system"],
                                        add_generation_prompt=add_generation_prompt)
        if add_generation_prompt or not msgs:
            return text
        at = text.rindex(tag.strip())
        return text[:at] if text[at:at + len(tag)] == tag else text[:at].rstrip()

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        specials = True if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and self.bos_text and text.startswith(self.bos_text):
            specials = False  # lm-eval's has_bos_prefix: the text brings its own BOS
        return self.tok.encode(text, add_special_tokens=specials).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


@functools.lru_cache(maxsize=8)
def _scores_fn(c):
    """(each target's log-probability, whether it is the argmax) of a batch of rows, jitted once per model."""
    from models.objectives.objective import hidden
    from models.transformer import head

    def fn(p, fields, targets):
        logits = head(c, p, hidden(c, p, fields)[0], lambda x, _: x).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return picked, jnp.argmax(logits, axis=-1) == targets
    return jax.jit(fn)


def score_rows(c, params, rows: list[tuple[list[int], list[int]]], data_ranks: int = 1) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether every continuation token is the argmax) of each
    (input ids, continuation ids) row: the continuation's targets are the row's last len(continuation) positions
    (the input ends with all of it but its last token), as lm-eval's HF backend reads them."""
    out = [None] * len(rows)
    n = -(-ROWS // data_ranks) * data_ranks
    order = sorted(range(len(rows)), key=lambda k: -len(rows[k][0]))  # similar lengths share a bucket (as HFLM sorts)
    for i in range(0, len(rows), n):
        chunk = [rows[k] for k in order[i:i + n]]
        T = bucket(max(len(inp) for inp, _ in chunk))
        tokens = np.zeros((n, T), np.int32)
        targets = np.zeros((n, T), np.int32)
        segs = np.zeros((n, T), np.int32)
        for r, (inp, cont) in enumerate(chunk):
            tokens[r, :len(inp)] = inp
            targets[r, :len(inp)] = list(inp[1:]) + [cont[-1]]
            segs[r, :len(inp)] = 1
        fields = {"tokens": tokens, "segment_ids": segs, "positions": np.broadcast_to(np.arange(T, dtype=np.int32),
                                                                                      (n, T)).copy()}
        logp, greedy = (np.asarray(x) for x in _scores_fn(c)(params, fields, targets))
        for r, (k, (inp, cont)) in enumerate(zip(order[i:i + n], chunk)):
            span = slice(len(inp) - len(cont), len(inp))
            out[k] = (float(logp[r, span].sum()), bool(greedy[r, span].all()))
    return out


def make_lm(c, params, tok: Tokenizer, max_length: int, data_ranks: int = 1):
    """The TemplateLM of a model `c` with `params` (on the run's mesh), its tokenizer and context."""
    lm = _lm_class()()
    lm.c, lm.params, lm.tok, lm.length, lm.ranks = c, params, tok, max_length, data_ranks
    return lm


@functools.lru_cache(maxsize=1)
def _lm_class():
    """MeshtrainLM, defined once lm_eval is known to be there."""
    TemplateLM = need_lm_eval()

    class MeshtrainLM(TemplateLM):
        eot_token_id = property(lambda self: self.tok.eos)
        prefix_token_id = property(lambda self: self.tok.bos if self.tok.bos is not None else self.tok.eos)
        max_length = property(lambda self: self.length)
        max_gen_toks = property(lambda self: 256)

        tokenizer_name = property(lambda self: self.tok.name)

        def chat_template(self, chat_template: bool | str = False) -> str | None:
            return self.tok.template.text if chat_template and self.tok.template else None

        def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
            return self.tok.chat(chat_history, add_generation_prompt)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
            return self.tok.encode(string, add_special_tokens)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
            rows = []
            for _, ctx, cont in requests:  # HFLM's input: the last max_length + 1 ids less the last
                whole = (list(ctx) + list(cont))[-(self.length + 1):]
                rows.append((whole[:-1], list(cont)))
            return _call(self, {"op": "rows", "rows": rows})

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            from lm_eval import utils as lm_utils
            out = []
            for (string,) in [r.args for r in requests]:
                windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.length,
                    context_len=1)]
                out.append(sum(ll for ll, _ in self._loglikelihood_tokens([(None, a, b) for a, b in windows])))
            return out

        def generate_until(self, requests, disable_tqdm: bool = False):
            args = [r.args for r in requests]
            groups: dict = {}  # requests of the same gen_kwargs drawn together, ROWS at a time
            for k, (_, kw) in enumerate(args):
                groups.setdefault(json.dumps(kw, sort_keys=True, default=str), []).append(k)
            out = [None] * len(args)
            for ks in groups.values():
                for i in range(0, len(ks), ROWS):
                    part = ks[i:i + ROWS]
                    cmd = {"op": "gen", "contexts": [args[k][0] for k in part], "kwargs": args[part[0]][1]}
                    for k, text in zip(part, _call(self, cmd)):
                        out[k] = text
            return out

    return MeshtrainLM


def _generate(lm, contexts: list[str], gen_kwargs: dict) -> list[str]:
    """generate_until requests of the same gen_kwargs drawn together (rows and KV cache over the mesh's data
    ranks, trainer/rl/rollout.py `placement`), each as HFLM answers it: greedy unless the kwargs sample, a row
    stopped at EOS or once its text holds an `until` string, cut at the first one."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from models.sampler import sample_completions
    from trainer.rl.rollout import placement
    tok = lm.tok
    kwargs = normalize_gen_kwargs(dict(gen_kwargs), lm.max_gen_toks)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=tok.decode([tok.eos], skip_special_tokens=False))
    new = kwargs.pop("max_gen_toks")
    ids = [tok.encode(context)[-(lm.length - new):] for context in contexts]
    sample = bool(kwargs.get("do_sample")) or float(kwargs.get("temperature", 0.0) or 0.0) > 0
    terms = [u for u in until if u]
    got = sample_completions(lm.c, lm.params, ids, new, jax.random.key(int(kwargs.get("seed", 0) or 0)),
                             temperature=float(kwargs.get("temperature", 1.0) or 1.0) if sample else 1.0,
                             top_k=0 if sample else 1, top_p=float(kwargs.get("top_p", 1.0) or 1.0),
                             end_ids={tok.eos}, pad=tok.eos, placement=placement(lm.c, lm.params, len(ids)),
                             stop=lambda _, drawn: any(u in tok.decode(drawn) for u in terms))
    return [postprocess_generated_text(generation=tok.decode(got["tokens"][r, :got["lengths"][r]]), stop=until,
                                       think_end_token=None) for r in range(len(ids))]


def _share(obj=None):
    """Process 0's `obj` (JSON) on every process (as it comes back from JSON on process 0 too)."""
    from jax.experimental import multihost_utils
    data = json.dumps(obj, default=str).encode() if jax.process_index() == 0 else b""
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buf = np.zeros(n, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))))


def _call(lm, cmd: dict):
    """One batch of requests on the mesh, every process computing it together: process 0 (which drives lm-eval)
    sends it to the others (`serve`) first."""
    return _compute(lm, _share(cmd) if jax.process_count() > 1 else cmd)


def _compute(lm, cmd: dict):
    if cmd["op"] == "rows":
        return score_rows(lm.c, lm.params, [(a, b) for a, b in cmd["rows"]], lm.ranks)
    return _generate(lm, cmd["contexts"], cmd["kwargs"])


def serve(lm) -> dict:
    """The other processes' part of process 0's lm-eval pass: each batch it sends computed with it, until it sends
    its results ({"results": lm-eval's per-task scores}); one line where its pass failed."""
    while True:
        cmd = _share()
        if cmd["op"] == "done":
            return {"results": cmd["results"]}
        if cmd["op"] == "failed":
            raise UserError(f"lm-eval's pass on process 0 failed ({cmd['why']}); its output says why")
        _compute(lm, cmd)


TASKS = Path(__file__).resolve().parent.parent / "eval_tasks"  # the shipped tasks (YAML over local JSONL)


def _local(files, folder: Path, task: str):
    """`data_files` with each relative path resolved against the task's own folder (lm-eval would take the working
    directory's); one line for a file that is not there."""
    if isinstance(files, dict):
        return {k: _local(v, folder, task) for k, v in files.items()}
    if isinstance(files, (list, tuple)):
        return [_local(v, folder, task) for v in files]
    p = Path(str(files)).expanduser()
    p = p if p.is_absolute() else folder / p
    if not p.is_file():
        raise UserError(f"task {task}: its data file {p} is not there; put it there or fix data_files in its YAML")
    return str(p)


def _not_ours(name: str, ours: list[str]):
    """One line for a task name that neither meshtrain's tasks nor --include-path hold: one of lm-eval's own
    (indexing its built-in tasks, ~15 s), whose data downloads from the hub, or unknown."""
    from lm_eval.tasks import TaskManager
    entry = TaskManager(include_defaults=True).task_index.get(name)
    fix = ("copy its data locally and point a task YAML's data_files at it (--include-path; docs/eval.md)")
    if entry is not None:
        hub = (entry.cfg or {}).get("dataset_path")
        what = f"reads dataset_path '{hub}' from the Hugging Face hub" if hub else "is a group of tasks that do"
        raise UserError(f"task '{name}' is one of lm-eval's own and {what}, which nothing here reaches; {fix}")
    raise UserError(f"unknown task '{name}': not in meshtrain's tasks ({', '.join(ours)}), under --include-path, "
                    f"nor among lm-eval's; check the name, or for a task of your own {fix}")


def task_configs(names: list[str], include: list[str] = ()) -> list[dict]:
    """lm-eval task configs of `names`, found in the shipped tasks and the --include-path folders (YAML files with a
    `task:`), their data files made absolute; a name found nowhere, or a task whose data is not local files, is
    one line."""
    from lm_eval.tasks._yaml_loader import load_yaml
    found = {}
    for folder in [TASKS, *map(Path, include)]:
        if not folder.is_dir():
            raise UserError(f"--include-path {folder} is not a folder of task YAML files")
        for y in sorted(folder.rglob("*.yaml")):
            try:
                cfg = load_yaml(y)
            except Exception:  # noqa: BLE001 - another file's YAML (a group, a template): not a task of ours
                continue
            if isinstance(cfg.get("task"), str):
                found.setdefault(cfg["task"], (y, cfg))
    missing = [n for n in names if n not in found]
    if missing:
        _not_ours(missing[0], sorted(t for t, (y, _) in found.items() if y.is_relative_to(TASKS)))
    out = []
    for name in names:
        y, cfg = found[name]
        kw = dict(cfg.get("dataset_kwargs") or {})
        if cfg.get("dataset_path") not in ("json", "parquet", "csv", "text") or "data_files" not in kw:
            raise UserError(f"task {name} ({y}) reads dataset_path '{cfg.get('dataset_path')}', which is not local "
                            "files; give dataset_path json (or parquet, csv, text) with dataset_kwargs.data_files")
        kw["data_files"] = _local(kw["data_files"], y.parent, name)
        out.append({**cfg, "dataset_kwargs": kw})
    return out


def tokenizer_of(cfg) -> Path:
    """The run's tokenizer.json: data.tokenizer, else its model.init_from folder's; one line where it has none."""
    from trainer.data.sidecars import local_tokenizer
    if cfg.data.tokenizer:
        return Path(local_tokenizer(cfg.data.tokenizer))
    if cfg.model.init_from and (Path(cfg.model.init_from) / "tokenizer.json").is_file():
        return Path(cfg.model.init_from) / "tokenizer.json"
    raise UserError("lm-eval's tasks are text, and this model has no tokenizer recorded (trained on bytes or bare "
                    "token ids): evaluate a run trained on `meshtrain prepare` data or from a Hugging Face folder "
                    "with its tokenizer.json")


def evaluate(run: str, tasks: list[str], overrides=(), include=(), num_fewshot: int | None = None,
             limit: float | None = None, log_samples: bool = False, gen_kwargs: str | None = None,
             apply_chat_template: bool = False, step: int | None = None, seed: int = 1234,
             max_length: int | None = None) -> dict:
    """lm-eval's results of `tasks` on a run's checkpoint (or an export, or a Hugging Face folder) on the mesh the
    overrides give (default: every local device over data); `max_length`: the context lm-eval truncates to
    (HFLM's max_length; default the model's: a Hugging Face folder's max_position_embeddings, else model.seq_len)."""
    need_lm_eval()
    from meshes import DATA, devices_named
    from trainer.ckpt.hf import context_of, origin_of
    from trainer.ckpt.objects import path_of
    from trainer.ckpt.params import load_params
    from trainer.ckpt.store import config_dict, kind_of
    from trainer.config import load_config, model_config, replace
    from trainer.state import make_setup
    configs = task_configs(list(tasks), list(include))  # before any weights are read: a bad name costs nothing
    params, cfg = load_params(run, step)
    if overrides:  # the mesh (and anything else) to evaluate on
        cfg = load_config(list(overrides), base=config_dict(cfg))
    context = context_of(origin_of(cfg, run)) if kind_of(path_of(run)) == "hf" else None
    if context and context != model_config(cfg).seq_len:
        cfg = replace(cfg, model={"seq_len": context})
    s = make_setup(cfg, jax.devices()[:devices_named(cfg.mesh) or jax.device_count()])
    if max_length is not None and not 1 < max_length <= s.model.seq_len:
        raise UserError(f"--max-length {max_length} must be between 2 and the model's context, {s.model.seq_len}")
    params = jax.device_put(params, s.shardings["params"])  # read FSDP-style over every device: the run's layout
    lm = make_lm(s.model, params, Tokenizer(tokenizer_of(cfg)),
                 max_length or s.model.seq_len, s.mesh.shape[DATA])
    with jax.set_mesh(s.mesh):
        return lm_results(lm, configs, num_fewshot, limit, log_samples, gen_kwargs, apply_chat_template, seed)


def lm_results(lm, configs: list[dict], num_fewshot: int | None = None, limit: float | None = None,
               log_samples: bool = False, gen_kwargs: str | None = None, apply_chat_template: bool = False,
               seed: int = 1234) -> dict:
    """lm-eval's simple_evaluate of the task configs on `lm`, every seed `seed` (lm-eval's default 1234), no
    bootstrap: the same requests and few-shot examples wherever it runs. With several processes, process 0 drives
    lm-eval and sends each batch of requests to the others (`serve`), which get its per-task scores at the end
    ({"results": ...}, all they return)."""
    import os
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files: never ask the hub
    from lm_eval import evaluator
    many = jax.process_count() > 1
    if many and jax.process_index() != 0:
        return serve(lm)
    try:
        got = evaluator.simple_evaluate(model=lm, tasks=configs, num_fewshot=num_fewshot, limit=limit,
                                        log_samples=log_samples, gen_kwargs=gen_kwargs,
                                        apply_chat_template=apply_chat_template, random_seed=seed,
                                        numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                                        bootstrap_iters=0, verbosity="WARNING")
    except BaseException as e:
        if many:
            _share({"op": "failed", "why": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        raise
    if many:
        _share({"op": "done", "results": got["results"]})
    return got


def write_results(results: dict, run: str, tasks: list[str], output: str | None = None) -> str:
    """Write lm-eval's results JSON (its own serialisation) to `output`, else RUN/eval/harness_<tasks>.json
    (atomically); return lm-eval's table of them and where they went."""
    from lm_eval.utils import handle_non_serializable, make_table
    out = Path(output) if output else Path(run) / "eval" / f"harness_{'_'.join(tasks)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    tmp.replace(out)
    return f"{make_table(results)}\nresults: {out}"
