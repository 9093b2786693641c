"""Hugging Face folders (config.json + safetensors) of any family with an HF adapter (models/spec.py): model
shape keys, parameters read straight into a run's shardings (each process reads only the slices its devices hold,
one device's at a time), and the folder's context that `export --format hf` and `generate` keep."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path

import jax
import numpy as np

from models.spec import HFAdapter, Leaf, ModelSpec, family, hf_family, hf_wrapper, leading
from trainer.ckpt import mxfp4, quantized, safetensors as st
from trainer.ckpt.store import kind_of
from trainer.config import model_config, replace
from trainer.errors import UserError

INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size for save_pretrained
IGNORED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry: RoPE is recomputed from config.json
log = logging.getLogger(__name__)


def _user(where, fn, *args):
    """fn(*args), an adapter's ValueError as a one-line user error naming `where`."""
    try:
        return fn(*args)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None


def spec_of(hc: dict, where) -> ModelSpec:
    """The family whose adapter reads this config.json (by its architectures)."""
    arch = hc.get("architectures") or [hc.get("model_type", "unknown")]
    if not isinstance(arch, list) or len(arch) != 1:
        raise UserError(f"{where} names architectures {arch}; meshtrain imports one architecture per folder")
    return _user(where, hf_family, str(arch[0]))


def _raw_config(path) -> dict:
    f = Path(path) / "config.json"
    try:
        hc = json.loads(f.read_text())
    except OSError as e:
        raise UserError(f"{f} cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise UserError(f"{f} is not valid JSON ({str(e)[:80]})") from None
    if not isinstance(hc, dict):
        raise UserError(f"{f} is not a JSON object; save the model again")
    return hc


def _wrapped(hc: dict):
    """(family, HFWrapper) when config.json describes a larger model whose text tower a family reads, else None."""
    arch = hc.get("architectures")
    return hf_wrapper(str(arch[0])) if isinstance(arch, list) and len(arch) == 1 else None


def text_config(hc: dict, where) -> dict:
    """The config.json a family reads: a wrapped model's text config (models/spec.py HFWrapper) under the family's
    own architecture, its tie_word_embeddings the outer config's where that says; any other config as it is."""
    found = _wrapped(hc)
    if found is None:
        return hc
    spec, w = found
    text = hc.get(w.config_key)
    if not isinstance(text, dict):
        raise UserError(f"{where} describes {hc['architectures'][0]} without a '{w.config_key}' object; "
                        "save the model again")
    tie = {"tie_word_embeddings": hc["tie_word_embeddings"]} if "tie_word_embeddings" in hc else {}
    return {**text, **tie, "architectures": [spec.hf.architecture]}


def read_config(path) -> dict:
    """config.json of an HF folder (a wrapped model's text config), checked by its family's adapter for what
    meshtrain's model computes."""
    f = Path(path) / "config.json"
    hc = text_config(_raw_config(path), f)
    _user(f, spec_of(hc, f).hf.check, hc)
    return hc


def model_keys(hc: dict, where) -> dict:
    """meshtrain model.* keys (and the config.json key each comes from) of an HF config, the family's among them."""
    spec = spec_of(hc, where)
    return {"family": (spec.name, "architectures"), **_user(where, spec.hf.model_keys, hc)}


def adapter(mc) -> HFAdapter:
    """The HF adapter of mc's family; a one-line error for a family that has none."""
    spec = _user("model.family", family, mc.family)
    if spec.hf is None:
        raise UserError(f"model.family='{mc.family}' has no Hugging Face form; use --format orbax")
    return spec.hf


def leaves(mc) -> list[Leaf]:
    """Every parameter of the model mc and the HF tensors that hold it."""
    return adapter(mc).leaves(mc)


def _same(a, b) -> bool:
    return [float(x) for x in a] == [float(x) for x in b] if isinstance(a, (list, tuple)) else a == b


def with_hf_shapes(cfg, tensors: bool = True):
    """cfg with the model shape keys of its `model.init_from` when that is an HF folder, whose tensors
    are checked now (`tensors`; else when they are read), before anything is written; an explicit key that
    contradicts config.json is an error."""
    p = Path(cfg.model.init_from)
    kind = kind_of(p)
    if not p.is_dir() or kind in ("export", "run"):
        return cfg  # a path that does not exist is reported when the parameters are read
    if kind != "hf":
        raise UserError(f"model.init_from='{p}' is neither an export (meshtrain export --out) nor a run.dir with "
                        "checkpoints, and has no config.json of a Hugging Face model folder; give one of those")
    where = p / "config.json"
    hc = read_config(p)
    keys = model_keys(hc, where)
    # a family that reads llama3 RoPE scaling from config.json, on a folder with plain RoPE: a model.rope_scaling
    # extends the folder's context (as Llama 3.1 extended Llama 3's) rather than contradicting it
    extendable = keys.get("rope_scaling") == (None, "rope_scaling")
    given = dataclasses.asdict(cfg.model)
    for k, (v, hk) in keys.items():
        mine = given[k]
        if mine is not None and v is not None and not _same(mine, v):
            raise UserError(f"model.{k}={mine} contradicts {where} ({hk}={v}); drop model.{k} or make them equal")
        if mine is not None and v is None and k in ("rope_scaling", "window") and not (k == "rope_scaling"
                                                                                         and extendable):
            raise UserError(f"model.{k}={mine} contradicts {where} ({hk} is null); drop it")
    extended = extendable and cfg.model.rope_scaling is not None
    cfg = replace(cfg, model={k: v for k, (v, _) in keys.items() if not (k == "rope_scaling" and extended)})
    _check_context(model_config(cfg), hc.get("max_position_embeddings"), where, extendable)
    if tensors:
        check_tensors(p, model_config(cfg))
    return cfg


def _check_context(mc, positions, where, extendable: bool):
    """model.seq_len within the folder's context (max_position_embeddings), or past it with RoPE scaling set for
    it: a model.rope_scaling over the folder's plain RoPE whose original context (4th number) is at most the
    folder's and whose factor x original context reaches seq_len (a folder's own scaling is in its context)."""
    if not positions:
        return
    T, M, sc = mc.seq_len, int(positions), mc.rope_scaling if extendable else None
    if sc is not None and sc[3] > M:
        raise UserError(f"model.rope_scaling's original context {sc[3]} (its 4th number) exceeds the {M} positions "
                        f"of {where} (max_position_embeddings), the context the model was trained at; set it to {M}")
    if T <= M or (sc is not None and sc[0] * sc[3] >= T):
        return
    if sc is not None:
        raise UserError(f"model.rope_scaling={list(sc)} extends the context of {where} to factor x original = "
                        f"{sc[0] * sc[3]:g} positions, fewer than model.seq_len={T}; raise its factor to "
                        f"{math.ceil(T / sc[3])} or use model.seq_len<={int(sc[0] * sc[3])}")
    scale = "" if not extendable else (
        f", or extend its context with llama3 RoPE scaling: model.rope_scaling=[{math.ceil(T / M)},1,4,{M}] "
        f"(factor, low_freq_factor, high_freq_factor, original context; factor x {M} >= {T})")
    raise UserError(f"model.seq_len={T} exceeds the {M} positions of {where} (max_position_embeddings); use "
                    f"model.seq_len<={M}{scale}")


# ----------------------------------------------------------------------------- tensor layout

def index(path) -> dict[str, st.Tensor]:
    """Every tensor of an HF folder: model.safetensors, or the files model.safetensors.index.json names; a block-FP8
    weight and its factors as one float32 tensor (trainer/ckpt/quantized.py)."""
    p = Path(path)
    if (p / INDEX).is_file():
        try:
            wmap = json.loads((p / INDEX).read_text())["weight_map"]
            files = sorted(set(wmap.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise UserError(f"{p / INDEX} is unreadable or has no weight_map; save the model again") from None
    elif (p / "model.safetensors").is_file():
        wmap, files = None, ["model.safetensors"]
    else:
        raise UserError(f"{p} has neither model.safetensors nor {INDEX}; save the model with safetensors")
    out = {}
    for f in files:
        if not (p / f).is_file():
            raise UserError(f"{p / INDEX} names {f}, which is missing; download it")
        out.update(st.read_header(p / f))
    for name, f in (wmap or {}).items():
        if name not in out:
            raise UserError(f"{p / INDEX} places tensor '{name}' in {f}, which does not hold it; save the model again")
    config = _raw_config(p)
    out = quantized.dequantized(out, quantized.block_of(config, p / "config.json"), p)
    return mxfp4.packed(out, p) if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4" else out


def text_tensors(path, have: dict) -> tuple[dict, int]:
    """The tensors of a wrapped model's text tower under the family's names, and how many of the other towers'
    were left out; any other folder's tensors as they are (and 0)."""
    found = _wrapped(_raw_config(path))
    if found is None:
        return have, 0
    w = found[1]
    out, dropped = {}, 0
    for n, t in have.items():
        if n.startswith(w.dropped):
            dropped += 1
            continue
        prefix = next(((a, b) for a, b in w.renames if n.startswith(a)), None)
        out[n if prefix is None else prefix[1] + n[len(prefix[0]):]] = t
    return out, dropped


def check_tensors(path, mc, say: bool = False) -> dict[str, st.Tensor]:
    """The folder's tensors, checked against the model that mc describes (names and shapes); with `say`, one
    log line for a wrapped model's towers left out."""
    have, dropped = text_tensors(path, index(path))
    if mc.mtp_depth and (held := _mtp_depth(have, mc)) < mc.mtp_depth:
        declared = text_config(_raw_config(path), path).get("num_nextn_predict_layers", 0)
        raise UserError(f"model.mtp_depth={mc.mtp_depth}: {path} holds {held} multi-token-prediction layers (by its "
                        f"tensors; its config.json declares {declared}); set model.mtp_depth={held} or less")
    if dropped and say:
        log.info("%s: the text model of a %s read; its other towers (%d tensors) are left out", path,
                 _raw_config(path)["architectures"][0], dropped)
    want = {n: lf.hf_shape for lf in leaves(mc) for n in lf.names}
    copies = {n for lf in leaves(mc) if lf.copy for n in lf.names}
    for n, shape in want.items():
        if n not in have and n in copies:
            continue
        if n not in have:
            raise UserError(f"{path} lacks tensor '{n}' (shape {list(shape)}); the folder is incomplete")
        if have[n].shape != shape:
            raise UserError(f"{path}: tensor '{n}' has shape {list(have[n].shape)}, config.json implies "
                            f"{list(shape)}")
    tied_head = {"lm_head.weight"} if mc.tie_embeddings else set()  # a tied head may be saved too: unused
    extra = [n for n in have if n not in want and n not in tied_head and not n.endswith(IGNORED)]
    if left := left_out(have, mc):
        if say:
            log.info("%s: %s left out (%d tensors: %s...); kept as they are for the export", path,
                     adapter(mc).skipped(mc)[1], len(left), left[0])
        extra = [n for n in extra if n not in left]
    if extra:
        raise UserError(f"{path} has tensor '{extra[0]}' that a {adapter(mc).architecture} with its config.json "
                        "does not have"
                        + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return have


def mtp_layers(path, mc) -> int:
    """How many multi-token-prediction layers the folder holds, by its tensors (not its config.json: a folder saved
    by transformers declares one and holds none)."""
    return _mtp_depth(text_tensors(path, index(path))[0], mc)


def _mtp_depth(have: dict, mc) -> int:
    """The largest D whose modules' tensors (those the adapter reads for model.mtp_depth=D) are all in `have`."""
    depth = 0
    while depth < 16:
        names = [n for lf in leaves(dataclasses.replace(mc, mtp_depth=depth + 1)) if lf.path[0] == "mtp"
                 for n in lf.names]
        if not names or any(n not in have for n in names):
            break
        depth += 1
    return depth


def left_out(have: dict, mc) -> list[str]:
    """The folder's tensors the model leaves out as its adapter says it may (HFAdapter.skipped: DeepSeek's
    multi-token-prediction layers past model.mtp_depth), in the folder's order."""
    prefixes = adapter(mc).skipped(mc)[0]
    want = {n for lf in leaves(mc) for n in lf.names}
    return [n for n in have if n.startswith(prefixes) and n not in want] if prefixes else []


def _read(t: st.Tensor, leaf: Leaf, idx: tuple) -> np.ndarray:
    """meshtrain's slice idx of one HF tensor, reading only those bytes."""
    hf_idx = [slice(None)] * len(leaf.view)
    for j, p in enumerate(leaf.perm):
        hf_idx[p] = idx[j]
    return np.ascontiguousarray(t.read(leaf.view, tuple(hf_idx)).transpose(leaf.perm))


def load(path, mc, shapes: dict, shardings: dict) -> dict:
    """Parameters of an HF folder as arrays with `shardings`, of `shapes`' dtypes, read slice by slice."""
    if mc.mtp_depth and not any(lf.path[0] == "mtp" for lf in leaves(mc)):
        raise UserError(f"model.mtp_depth={mc.mtp_depth} with a {adapter(mc).architecture} model.init_from is not "
                        "supported (its adapter reads no multi-token-prediction layer); set model.mtp_depth=0")
    have = check_tensors(path, mc, say=True)
    out: dict = {}
    for leaf in (lf for lf in leaves(mc) if not lf.copy):
        target, sh = _get(shapes, leaf.path), _get(shardings, leaf.path)

        def piece(idx, leaf=leaf, dtype=target.dtype):
            if not leaf.stacked:
                return _read(have[leaf.names[0]], leaf, idx).astype(dtype, copy=False)
            lead = leading(leaf)  # (layers,) or (layers, experts): the tensors in row-major order over them
            rows = [range(n)[s] for n, s in zip(lead, idx)]
            a = None
            for at in np.ndindex(*(len(r) for r in rows)):  # filled tensor by tensor: no list of pieces
                i = int(np.ravel_multi_index(tuple(r[j] for r, j in zip(rows, at)), lead))
                x = _read(have[leaf.names[i]], leaf, idx[len(lead):])
                a = np.empty(tuple(len(r) for r in rows) + x.shape, dtype) if a is None else a
                a[at] = x
            return a

        _set(out, leaf.path, _from_pieces(target.shape, sh, piece))
    return out


def _from_pieces(shape, sharding, piece) -> jax.Array:
    """jax.make_array_from_callback, but each device's piece is placed before the next is read, so that
    the host holds one piece at a time, not every local device's at once."""
    arrays = [jax.device_put(piece(idx), d).block_until_ready()
              for d, idx in sharding.addressable_devices_indices_map(shape).items()]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


# ----------------------------------------------------------------------------- the folder's context

ORIGIN = "hf_origin"  # in run.dir: the non-weight files of the HF folder the run started from
# what a folder says of the model besides its weights (config.json first)
ORIGIN_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                "chat_template.jinja", "chat_template.json")


KEPT = "kept.safetensors"  # in run_dir/ORIGIN: the folder's tensors the model left out, as they were


def keep_origin(folder, run_dir, mc=None):
    """Copy an HF folder's config, generation config and tokenizer files into run_dir/ORIGIN, with (given the model
    mc) the tensors the model leaves out (`left_out`: DeepSeek's MTP layer with model.mtp_depth=0) as KEPT, whole
    or not at all: what `export --format hf` and `generate` keep of the model whatever becomes of it."""
    src, dst = Path(folder), Path(run_dir) / ORIGIN
    if dst.is_dir():
        return dst
    tmp = dst.with_name(ORIGIN + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ORIGIN_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)
    have = text_tensors(src, index(src))[0] if mc is not None else {}
    if kept := left_out(have, mc) if have else []:
        st.write(tmp / KEPT, [(n, have[n].shape, have[n].dtype) for n in kept], lambda n: have[n].array())
    tmp.rename(dst)
    return dst


def kept_tensors(origin: Path | None) -> dict[str, st.Tensor]:
    """The tensors keep_origin kept (none where the model left none out)."""
    return st.read_header(origin / KEPT) if origin is not None and (origin / KEPT).is_file() else {}


def origin_of(cfg, run_dir=None) -> Path | None:
    """The HF folder a model came from: the copy a run kept (run_dir/ORIGIN), else its model.init_from when that
    is an HF folder; None for a model that did not come from one."""
    if run_dir is not None and (Path(run_dir) / ORIGIN / "config.json").is_file():
        return Path(run_dir) / ORIGIN
    init = cfg.model.init_from
    return Path(init) if init and kind_of(init) == "hf" else None


def context_of(origin: Path | None) -> int | None:
    """The HF model's context (config.json's max_position_embeddings), or None."""
    if origin is None:
        return None
    n = text_config(json.loads((origin / "config.json").read_text()), origin).get("max_position_embeddings")
    return int(n) if n else None
