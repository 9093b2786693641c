"""Hugging Face Llama folders (config.json + safetensors): model shape keys, parameters read straight into
a run's shardings (each process reads only the slices its devices hold, one device's at a time), and `meshtrain export --format hf`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from trainer.ckpt import safetensors as st
from trainer.ckpt.store import kind_of
from trainer.config import model_config, replace
from trainer.errors import UserError

ARCH = "LlamaForCausalLM"
INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size for save_pretrained
IGNORED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry: RoPE is recomputed from config.json


def read_config(path) -> dict:
    """config.json of a Llama folder, checked for what meshtrain's model computes."""
    f = Path(path) / "config.json"
    try:
        hc = json.loads(f.read_text())
    except OSError as e:
        raise UserError(f"{f} cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise UserError(f"{f} is not valid JSON ({str(e)[:80]})") from None
    arch = hc.get("architectures") or [hc.get("model_type", "unknown")]
    if arch != [ARCH]:
        raise UserError(f"{f} describes {', '.join(map(str, arch))}; meshtrain imports {ARCH} only")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hc.get(key, want) != want:
            raise UserError(f"{f}: {key}={hc[key]!r} is not supported; meshtrain's Llama has {key}={want!r}")
    return hc


def _rope(hc: dict, where) -> tuple[float, list | None]:
    """(rope_theta, rope_scaling) from transformers 5's rope_parameters or the older rope_theta/rope_scaling."""
    rp = hc.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", hc.get("rope_theta", 10000.0)))
    sc = hc.get("rope_scaling") or rp
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UserError(f"{where}: rope scaling of type '{kind}' is not supported; meshtrain implements 'llama3'")
    try:
        return theta, [float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"]),
                       float(sc["original_max_position_embeddings"])]
    except KeyError as e:
        raise UserError(f"{where}: llama3 rope scaling lacks {e.args[0]}") from None


def model_keys(hc: dict, where) -> dict:
    """meshtrain model.* keys (and the config.json key each comes from) of an HF Llama config."""
    try:
        D, H = int(hc["hidden_size"]), int(hc["num_attention_heads"])
        keys = {"d_model": (D, "hidden_size"), "n_layers": (int(hc["num_hidden_layers"]), "num_hidden_layers"),
                "n_heads": (H, "num_attention_heads"),
                "n_kv_heads": (int(hc.get("num_key_value_heads") or H), "num_key_value_heads"),
                "d_ff": (int(hc["intermediate_size"]), "intermediate_size"),
                "vocab_size": (int(hc["vocab_size"]), "vocab_size"),
                "tie_embeddings": (bool(hc.get("tie_word_embeddings", False)), "tie_word_embeddings"),
                "norm_eps": (float(hc.get("rms_norm_eps", 1e-6)), "rms_norm_eps")}
    except KeyError as e:
        raise UserError(f"{where} lacks {e.args[0]}") from None
    keys["head_dim"] = (int(hc.get("head_dim") or D // H), "head_dim")
    theta, scaling = _rope(hc, where)
    keys["rope_theta"], keys["rope_scaling"] = (theta, "rope_theta"), (scaling, "rope_scaling")
    return keys


def _same(a, b) -> bool:
    return [float(x) for x in a] == [float(x) for x in b] if isinstance(a, (list, tuple)) else a == b


def with_hf_shapes(cfg):
    """cfg with the model shape keys of its `model.init_from` when that is an HF folder, whose tensors
    are checked now, before anything is written; an explicit key that contradicts config.json is an error."""
    p = Path(cfg.model.init_from)
    kind = kind_of(p)
    if not p.is_dir() or kind in ("export", "run"):
        return cfg  # a path that does not exist is reported when the parameters are read
    if kind != "hf":
        raise UserError(f"model.init_from='{p}' is neither an export (meshtrain export --out) nor a run.dir with "
                        "checkpoints, and has no config.json of a Hugging Face Llama folder; give one of those")
    where = p / "config.json"
    keys = model_keys(read_config(p), where)
    for k, (v, hk) in keys.items():
        mine = getattr(cfg.model, k)
        if mine is not None and v is not None and not _same(mine, v):
            raise UserError(f"model.{k}={mine} contradicts {where} ({hk}={v}); drop model.{k} or make them equal")
        if mine is not None and v is None and k == "rope_scaling":
            raise UserError(f"model.rope_scaling={mine} contradicts {where} (no rope scaling); drop it")
    cfg = replace(cfg, model={k: v for k, (v, _) in keys.items()})
    check_tensors(p, model_config(cfg))
    return cfg


# ----------------------------------------------------------------------------- tensor layout

class Leaf(NamedTuple):
    """One meshtrain parameter and its HF tensors: leaf = stack over layers of view.transpose(perm)."""
    path: tuple  # keys into the params dict
    names: list  # HF names: one per layer for stacked leaves, else one
    hf_shape: tuple  # each HF tensor's shape (out, in)
    view: tuple  # the HF tensor reshaped so that a transpose gives meshtrain's per-layer layout
    perm: tuple
    stacked: bool


def leaves(mc) -> list[Leaf]:
    """Every parameter of a meshtrain Llama and where HF keeps it (q/k need no permutation: both use
    rotate-half RoPE pairs)."""
    D, H, K, E, F, V, L = mc.d_model, mc.n_heads, mc.n_kv_heads, mc.head_dim, mc.d_ff, mc.vocab_size, mc.n_layers
    per_layer = {"attn_norm": ("input_layernorm", (D,), (D,), (0,)),
                 "wq": ("self_attn.q_proj", (H * E, D), (H, E, D), (2, 0, 1)),
                 "wk": ("self_attn.k_proj", (K * E, D), (K, E, D), (2, 0, 1)),
                 "wv": ("self_attn.v_proj", (K * E, D), (K, E, D), (2, 0, 1)),
                 "wo": ("self_attn.o_proj", (D, H * E), (D, H, E), (1, 2, 0)),
                 "mlp_norm": ("post_attention_layernorm", (D,), (D,), (0,)),
                 "w_gate": ("mlp.gate_proj", (F, D), (F, D), (1, 0)),
                 "w_up": ("mlp.up_proj", (F, D), (F, D), (1, 0)),
                 "w_down": ("mlp.down_proj", (D, F), (D, F), (1, 0))}
    out = [Leaf(("embed",), ["model.embed_tokens.weight"], (V, D), (V, D), (0, 1), False)]
    out += [Leaf(("layers", k), [f"model.layers.{i}.{n}.weight" for i in range(L)], s, v, pm, True)
            for k, (n, s, v, pm) in per_layer.items()]
    out.append(Leaf(("final_norm",), ["model.norm.weight"], (D,), (D,), (0,), False))
    if not mc.tie_embeddings:
        out.append(Leaf(("lm_head",), ["lm_head.weight"], (V, D), (V, D), (1, 0), False))
    return out


def leaf_shape(leaf: Leaf) -> tuple:
    one = tuple(leaf.view[p] for p in leaf.perm)
    return (len(leaf.names),) + one if leaf.stacked else one


def index(path) -> dict[str, st.Tensor]:
    """Every tensor of an HF folder: model.safetensors, or the files model.safetensors.index.json names."""
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
    return out


def check_tensors(path, mc) -> dict[str, st.Tensor]:
    """The folder's tensors, checked against the Llama that mc describes (names and shapes)."""
    have, want = index(path), {n: lf.hf_shape for lf in leaves(mc) for n in lf.names}
    for n, shape in want.items():
        if n not in have:
            raise UserError(f"{path} lacks tensor '{n}' (shape {list(shape)}); the folder is incomplete")
        if have[n].shape != shape:
            raise UserError(f"{path}: tensor '{n}' has shape {list(have[n].shape)}, config.json implies "
                            f"{list(shape)}")
    tied_head = {"lm_head.weight"} if mc.tie_embeddings else set()  # a tied head may be saved too: unused
    extra = [n for n in have if n not in want and n not in tied_head and not n.endswith(IGNORED)]
    if extra:
        raise UserError(f"{path} has tensor '{extra[0]}' that a {ARCH} with its config.json does not have"
                        + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return have


def _read(t: st.Tensor, leaf: Leaf, idx: tuple) -> np.ndarray:
    """meshtrain's slice idx of one HF tensor, reading only those bytes."""
    hf_idx = [slice(None)] * len(leaf.view)
    for j, p in enumerate(leaf.perm):
        hf_idx[p] = idx[j]
    return np.ascontiguousarray(t.array().reshape(leaf.view)[tuple(hf_idx)].transpose(leaf.perm))


def load(path, mc, shapes: dict, shardings: dict) -> dict:
    """Parameters of an HF folder as arrays with `shardings`, of `shapes`' dtypes, read slice by slice."""
    have = check_tensors(path, mc)
    out: dict = {}
    for leaf in leaves(mc):
        target, sh = _get(shapes, leaf.path), _get(shardings, leaf.path)

        def piece(idx, leaf=leaf, dtype=target.dtype):
            if not leaf.stacked:
                return _read(have[leaf.names[0]], leaf, idx).astype(dtype, copy=False)
            rows = range(len(leaf.names))[idx[0]]
            first = _read(have[leaf.names[rows[0]]], leaf, idx[1:])
            a = np.empty((len(rows),) + first.shape, dtype)  # filled layer by layer: no list of pieces
            a[0] = first
            for j, i in enumerate(rows[1:], 1):
                a[j] = _read(have[leaf.names[i]], leaf, idx[1:])
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


def keep_origin(folder, run_dir):
    """Copy an HF folder's config, generation config and tokenizer files (not its weights) into run_dir/ORIGIN,
    whole or not at all: what `export --format hf` and `generate` keep of the model whatever becomes of it."""
    src, dst = Path(folder), Path(run_dir) / ORIGIN
    if dst.is_dir():
        return dst
    tmp = dst.with_name(ORIGIN + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ORIGIN_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)
    tmp.rename(dst)
    return dst


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
    n = json.loads((origin / "config.json").read_text()).get("max_position_embeddings")
    return int(n) if n else None
