"""`meshtrain export --format hf`: a checkpoint's parameters as a Hugging Face folder of its family
(config.json, generation_config.json, safetensors), gathered one tensor at a time."""
from __future__ import annotations

import dataclasses

import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np

from trainer.ckpt import safetensors as st
from models.spec import leaf_shape, leading
from trainer.ckpt.hf import (INDEX, MAX_SHARD_BYTES, ORIGIN_FILES, _get, adapter, kept_tensors, leaves, model_keys,
                             origin_of, text_config)
from trainer.config.paths import check
from trainer.data import remote
from trainer.data.sidecars import data_sidecar, local_tokenizer, read_beside
from trainer.errors import UserError


def check_expressible(mc, params: dict, where: str):
    """A one-line error unless the family's HF form holds exactly these parameters."""
    try:
        adapter(mc).expressible(mc)
    except ValueError as e:
        raise UserError(f"{where}: {e}; export it with --format orbax") from None
    for leaf in leaves(mc):
        try:
            got = tuple(_get(params, leaf.path).shape)
        except (KeyError, TypeError):
            got = None
        if got != leaf_shape(leaf):
            raise UserError(f"{where}: parameter {'.'.join(leaf.path)} has shape {got}, not the "
                            f"{leaf_shape(leaf)} of a {adapter(mc).architecture}; export it with --format orbax")


def _host(x: jax.Array, i: tuple = ()) -> np.ndarray:
    """x (or its entry at leading indices i: a layer's, or a layer's expert's) as one numpy array on this host,
    from the shards (never whole on one device)."""
    k = len(i)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x[i] if k else x, tiled=True))
    out, seen = np.empty(x.shape[k:], x.dtype), set()
    for sh in x.addressable_shards:
        idx = sh.index
        if not k:
            key, data, where = idx, sh.data, idx
        else:
            rows = [range(n)[s] for n, s in zip(x.shape, idx[:k])]
            if any(j not in r for j, r in zip(i, rows)):
                continue
            at = tuple(j - r.start for j, r in zip(i, rows))
            # on CPU the shard is host memory already (no copy); elsewhere copy only the one entry
            data = np.asarray(sh.data)[at] if sh.device.platform == "cpu" else sh.data[at]
            key, where = idx[k:], idx[k:]
        key = tuple((s.start, s.stop) for s in key)
        if key not in seen:  # replicas hold the same values
            seen.add(key)
            out[where] = np.asarray(data)
    return out


def _plan(mc, dtype: np.dtype, max_bytes: int, kept: dict):
    """[(file, [(name, shape, dtype)])] in order, a new file whenever the next tensor would pass max_bytes; the
    model's tensors, then those kept as the origin folder had them (their own dtype)."""
    files, cur, size = [], [], 0
    named = [(n, leaf.hf_shape, dtype) for leaf in leaves(mc) for n in leaf.names]
    for name, shape, dt in named + [(n, t.shape, t.dtype) for n, t in kept.items()]:
        n = math.prod(shape) * dt.itemsize
        if cur and size + n > max_bytes:
            files.append(cur)
            cur, size = [], 0
        cur.append((name, shape, dt))
        size += n
    files.append(cur)
    if len(files) == 1:
        return [("model.safetensors", files[0])]
    return [(f"model-{k + 1:05d}-of-{len(files):05d}.safetensors", f) for k, f in enumerate(files)]


def params_mesh(params):
    """The mesh the (sharded) parameters lie on."""
    return jax.tree.leaves(params)[0].sharding.mesh


def export_hf(run_dir, out, step: int | None = None, dtype: str | None = None,
              max_shard_bytes: int = MAX_SHARD_BYTES, merge: bool = False) -> Path | str:
    """Write a checkpoint's parameters (newest by default) to `out` (a new folder, or a URL) as an HF folder; a
    failure (a tokenizer that cannot be read, ...) writes nothing. A LoRA run's with `merge`: its adapters merged
    into their weights (trainer/ckpt/peft.py)."""
    from trainer.ckpt.params import load_params_at
    from trainer.ckpt.tools import _unused_out, staged
    from trainer.config import model_config
    _unused_out(str(out))  # before the parameters are read
    params, cfg, step = load_params_at(check(run_dir, "--run"), step)  # split over the local devices, never whole on one
    mc = model_config(cfg)
    if mc.lora is not None:  # a plain model of the family: each adapted weight with its adapter merged in
        if not merge:
            raise UserError(f"--run {run_dir} trained adapters (model.lora): export them with --format peft, or the "
                            "merged model with --format hf --merge")
        from trainer.ckpt.peft import merged_params
        with jax.set_mesh(params_mesh(params)):
            params = jax.jit(lambda p: merged_params(p, mc))(params)
        mc = dataclasses.replace(mc, lora=None)
    origin = origin_of(cfg, run_dir)
    with staged(out, last=("config.json",)) as stage:
        write_hf(params, mc, stage, dtype, max_shard_bytes, f"run '{run_dir}'", step, kept_tensors(origin))
        if origin is not None and jax.process_index() == 0:  # started from an HF folder: what it said of the model
            _keep(origin, stage)
        if cfg.data.tokenizer and jax.process_index() == 0:  # trained on `meshtrain prepare` data
            turn = _write_chat_template(cfg.data.source, stage)
            _write_tokenizer(cfg.data.tokenizer, stage, mc, turn)
    return out if remote.is_url(str(out)) else Path(out)


def _write_chat_template(source: str, out: Path) -> str | None:
    """The chat template the run's conversations were rendered with, as chat_template.jinja (which transformers
    reads before tokenizer_config.json's): the export chats as its training data did. Returns its text."""
    meta = data_sidecar(source)
    if not (meta and meta.get("chat_template")):
        return None
    (out / "chat_template.jinja").write_text(read_beside(source, meta["chat_template"]["path"]))
    return (out / "chat_template.jinja").read_text()


CONTEXT_KEYS = ("max_position_embeddings", "rope_scaling", "rope_parameters")  # a run's context and RoPE scaling


def _keep(origin: Path, out: Path):
    """The origin folder's config fields over the written ones, but for the dtype (the run cannot have changed
    the model's shape: importing checked every shape key against that config.json): its context length,
    special ids, rope scaling and whatever else it holds, unless the run extended its context with RoPE scaling
    (trainer/ckpt/hf.py: then the run's context and scaling); then its generation config and tokenizer files."""
    ours, theirs = (text_config(json.loads((d / "config.json").read_text()), d) for d in (out, origin))
    scaling = [model_keys(c, d).get("rope_scaling", (None,))[0] for c, d in ((ours, out), (theirs, origin))]
    extended = scaling[0] is not None and scaling[1] is None
    mine = ("torch_dtype", "dtype") + (CONTEXT_KEYS if extended else ())
    merged = {**ours, **{k: v for k, v in theirs.items() if k not in mine}}
    (out / "config.json").write_text(json.dumps(merged, indent=2) + "\n")
    for name in ORIGIN_FILES[1:]:
        if (origin / name).is_file():
            shutil.copyfile(origin / name, out / name)


def _write_tokenizer(path: str, out: Path, mc, template: str | None = None):
    """The run's tokenizer.json beside the weights, a tokenizer_config.json naming its end-of-text token (so
    that transformers' AutoTokenizer loads the folder), and generation's eos: that token, and the end-of-turn
    token the chat template writes after an assistant's reply (so that transformers' generate stops there too)."""
    from trainer.data.chat import ChatTemplate, DEFAULT_DATE, parse_date, specials_of
    from trainer.data.prepare import load_tokenizer
    tok, src, eot = load_tokenizer(local_tokenizer(path))  # a bucket's copied first
    eos = [eot]
    if template is not None:
        added = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
        turn = ChatTemplate("chat_template.jinja", template, specials_of(src.parent), parse_date(DEFAULT_DATE)) \
            .end_of_turn(added)
        eos += [turn] if turn is not None and turn != eot else []
    shutil.copyfile(src, out / "tokenizer.json")
    if (src.parent / "tokenizer_config.json").is_file():
        shutil.copyfile(src.parent / "tokenizer_config.json", out / "tokenizer_config.json")
    else:
        conf = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.id_to_token(eot),
                "model_max_length": mc.seq_len}
        (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    gen = json.loads((out / "generation_config.json").read_text())
    had = gen.get("eos_token_id")  # an origin folder's own stop tokens (Llama 3 Instruct lists three) are kept
    eos = list(dict.fromkeys(eos + (had if isinstance(had, list) else [had] if had is not None else [])))
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def write_hf(params: dict, mc, out, dtype: str | None = None, max_shard_bytes: int = MAX_SHARD_BYTES,
             where: str = "parameters", step: int | None = None, kept: dict | None = None) -> Path:
    """Write (sharded) parameters of the model mc to `out` as an HF folder, with the `kept` tensors (trainer/ckpt/
    hf.py kept_tensors: those the model left out of its origin folder) as they were."""
    kept = kept or {}
    out = Path(out)
    check_expressible(mc, params, where)
    np_dtype = st.DTYPES["BF16" if dtype == "bfloat16" else "F32"] if dtype else np.dtype(
        jax.tree.leaves(params)[0].dtype)
    if np_dtype not in st.CODES:
        raise UserError(f"{where} are {np_dtype}; export them with --dtype float32")
    by_name = {n: (leaf, tuple(int(j) for j in np.unravel_index(i, leading(leaf))) if leaf.stacked else ())
               for leaf in leaves(mc) for i, n in enumerate(leaf.names)}

    def fill(name):
        if name in kept:
            return kept[name].array()
        leaf, i = by_name[name]
        a = _host(_get(params, leaf.path), i)
        inv = tuple(int(k) for k in np.argsort(leaf.perm))  # meshtrain layout -> the HF view, then (out, in)
        return a.transpose(inv).reshape(leaf.hf_shape).astype(np_dtype, copy=False)

    files = _plan(mc, np_dtype, max_shard_bytes, kept)
    write = jax.process_index() == 0
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out} cannot be created ({e.strerror}); choose another directory") from None
    for fname, entries in files:
        if write:
            st.write(out / fname, entries, fill, {"format": "pt"})
        else:  # take part in the gathers process 0 needs
            for name, _, _ in entries:
                fill(name)
    if write:
        dname = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[st.CODES[np_dtype]]
        (out / "config.json").write_text(json.dumps(adapter(mc).config(mc, dname), indent=2) + "\n")
        gen = {"_from_model_config": True, "bos_token_id": None, "eos_token_id": None, "max_length": mc.seq_len}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if len(files) > 1:
            total = sum(math.prod(s) * d.itemsize for _, e in files for _, s, d in e)
            index = {"metadata": {"total_size": total, "meshtrain_step": step},
                     "weight_map": {n: f for f, e in files for n, _, _ in e}}
            (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return out


def export_peft(run_dir, out, step: int | None = None) -> Path:
    """`meshtrain export --format peft`: a LoRA run's adapters (newest checkpoint by default) as a peft folder."""
    from trainer.ckpt.params import load_params_at
    from trainer.ckpt.tools import _unused_out
    from trainer.config import model_config
    _unused_out(str(out))
    params, cfg, step = load_params_at(run_dir, step)
    mc = model_config(cfg)
    if mc.lora is None:
        raise UserError(f"--run {run_dir} trained no adapters (model.lora.rank is 0); export it with --format hf")
    if jax.process_index() == 0:
        from trainer.ckpt.peft import write_peft
        write_peft(params, mc, Path(out), cfg.model.init_from)
    return Path(out)
