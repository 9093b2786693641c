"""LoRA adapters in peft's format, both directions (docs/lora.md): `adapter_model.safetensors` holding, for each
adapted projection of each layer, `base_model.model.<HF module>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r),
and `adapter_config.json`; and the merged model (`export --format hf --merge`). meshtrain's adapters (models/lora.py)
hold A as (the weight's input axes..., r) and B as (r, its output axes...), each in the parameter's axis order:
to peft's, the axes are put in the Hugging Face view's order and flattened."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.lora import A, B, EXPERTS, expert_targets, saved_modules, split_axes, targets
from models.spec import family
from trainer.ckpt import safetensors as st
from trainer.errors import UserError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
# adapter_config.json keys that change what the adapter computes, and what meshtrain computes for each
FUSED = r".*\.gate_up_proj"  # peft's pattern for a gate_up_proj fused from w1 and w3 adapters
COMPUTES = {"use_dora": False, "lora_bias": False, "layers_to_transform": None, "layers_pattern": None,
            "trainable_token_indices": None, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none",
            "fan_in_fan_out": False}


def _order(leaf, axes: list[int]) -> list[int]:
    """`axes` (parameter axes) sorted into the Hugging Face view's order (how peft's flat axis runs)."""
    return sorted(axes, key=lambda j: leaf.perm[j])


def to_peft(a, b, leaf) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (A, B) in meshtrain's layout -> peft's lora_A (r, in) and lora_B (out, r)."""
    ins, outs = split_axes(leaf)
    ia = [ins.index(j) for j in _order(leaf, ins)] + [len(ins)]
    ob = [0] + [1 + outs.index(j) for j in _order(leaf, outs)]
    r = a.shape[-1]
    return (np.transpose(a, ia).reshape(-1, r).T, np.transpose(b, ob).reshape(r, -1).T)


def from_peft(lora_a, lora_b, leaf, a_shape, b_shape) -> tuple[np.ndarray, np.ndarray]:
    """to_peft's inverse: peft's (r, in), (out, r) -> meshtrain's A (ins..., r), B (r, outs...)."""
    ins, outs = split_axes(leaf)
    vi, vo = _order(leaf, ins), _order(leaf, outs)
    a = np.asarray(lora_a).T.reshape([a_shape[ins.index(j)] for j in vi] + [a_shape[-1]])
    b = np.asarray(lora_b).T.reshape([b_shape[0]] + [b_shape[1 + outs.index(j)] for j in vo])
    return (np.transpose(a, [vi.index(j) for j in ins] + [len(ins)]),
            np.transpose(b, [0] + [1 + vo.index(j) for j in outs]))


def _names(leaf, i: int) -> tuple[str, str]:
    base = PREFIX + leaf.names[i][:-len(".weight")]
    return base + ".lora_A.weight", base + ".lora_B.weight"


def _expert_names(mc, i: int) -> dict:
    """{meshtrain's expert adapter: (peft's lora_A name, lora_B name)} of layer i: peft nests one ParamWrapper per
    target parameter, gate_up's inside (its tensors under base_layer) where down_proj is adapted too."""
    chosen = [EXPERTS[t] for t in expert_targets(mc)]
    out, pre = {}, f"{PREFIX}model.layers.{i}.mlp.experts."
    for k in chosen:
        inner = "base_layer." if k == "experts_gate_up" and len(chosen) == 2 else ""
        out[k] = (pre + inner + "lora_A.weight", pre + inner + "lora_B.weight")
    return out


def experts_to_peft(k: str, a, b) -> tuple[np.ndarray, np.ndarray]:
    """One layer's expert adapter -> peft's lora_A (E r, in), lora_B (out, r E) (ParamWrapper: A read as (E, r, in),
    B as (out, r, E); gate_up's out the gate's F rows, then the up's)."""
    X, r = a.shape[0], a.shape[-1]
    lora_a = np.transpose(a, (0, 2, 1)).reshape(X * r, -1)
    if k == "experts_gate_up":  # b (X, r, 2, F)
        return lora_a, np.transpose(b, (2, 3, 1, 0)).reshape(-1, r * X)
    return lora_a, np.transpose(b, (2, 1, 0)).reshape(-1, r * X)  # b (X, r, D)


def experts_from_peft(k: str, lora_a, lora_b, a_shape, b_shape) -> tuple[np.ndarray, np.ndarray]:
    X, r = a_shape[0], a_shape[-1]
    a = np.asarray(lora_a).reshape(X, r, -1).transpose(0, 2, 1)
    if k == "experts_gate_up":
        F = b_shape[-1]
        return a, np.asarray(lora_b).reshape(2, F, r, X).transpose(3, 2, 0, 1)
    return a, np.asarray(lora_b).reshape(-1, r, X).transpose(2, 1, 0)


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def write_peft(params: dict, mc, out: Path, base: str | None):
    """Write the adapters of `params` (a LoRA run's) as a peft adapter folder at `out`."""
    chosen = targets(mc, family(mc.family).hf.leaves(mc))
    tensors = {}
    for k, (_, leaf) in chosen.items():
        a_all, b_all = _host(params["layers"][k + A]), _host(params["layers"][k + B])
        for i in range(a_all.shape[0]):
            na, nb = _names(leaf, i)
            tensors[na], tensors[nb] = to_peft(a_all[i], b_all[i], leaf)
    for k in (EXPERTS[t] for t in expert_targets(mc)):
        a_all, b_all = _host(params["layers"][k + A]), _host(params["layers"][k + B])
        for i in range(a_all.shape[0]):
            na, nb = _expert_names(mc, i)[k]
            tensors[na], tensors[nb] = experts_to_peft(k, a_all[i], b_all[i])
    for k, leaf in saved_modules(mc, family(mc.family).hf.leaves(mc)).items():  # peft's modules_to_save, whole
        w = _host(params[k])
        tensors[PREFIX + leaf.names[0]] = w.transpose(tuple(np.argsort(leaf.perm))).reshape(leaf.hf_shape)
        if k == "embed" and mc.tie_embeddings:  # the head is the trained embedding too: peft's ensure_weight_tying
            tensors[PREFIX + "lm_head.weight"] = tensors[PREFIX + leaf.names[0]]
    out.mkdir(parents=True, exist_ok=True)
    st.write(out / WEIGHTS, [(n, t.shape, np.float32) for n, t in tensors.items()], lambda n: tensors[n],
             {"format": "pt"})
    lora = mc.lora
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "use_rslora": lora.rslora, "bias": "none",
              "target_modules": sorted(t for t, _ in chosen.values()),
              "target_parameters": list(expert_targets(mc)) or None,
              "modules_to_save": list(lora.modules) or None, "base_model_name_or_path": base,
              "inference_mode": True, **({"ensure_weight_tying": True} if _tied_embedding(mc) else {}),
              **_fused_patterns(lora)}
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _fused_patterns(lora) -> dict:
    """The rank_pattern and alpha_pattern of the experts' fused gate_up adapter (model.lora.fused_gate_up) as peft
    writes them, else none."""
    if not lora.fused_gate_up:
        return {}
    return {"rank_pattern": {FUSED: 2 * lora.rank}, "alpha_pattern": {FUSED: 2 * lora.alpha}}


def _tied_embedding(mc) -> bool:
    """Whether model.lora trains the embedding of a model whose head is that embedding."""
    return mc.tie_embeddings and "embed_tokens" in mc.lora.modules


def check_config(folder: Path, mc) -> dict:
    """The folder's adapter_config.json, refused in one line where it asks for what meshtrain does not compute or
    differs from model.lora (rank, alpha, rsLoRA, targets)."""
    try:
        cfg = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError):
        raise UserError(f"model.lora.init_from={folder} has no readable {CONFIG}; give a peft adapter folder") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{folder / CONFIG}: peft_type={cfg.get('peft_type')!r} is not supported; meshtrain reads LORA")
    lora = mc.lora
    fused = _fused_patterns(dataclasses.replace(lora, fused_gate_up=True))
    if {k: cfg.get(k) or {} for k in fused} == fused and not lora.fused_gate_up:
        raise UserError(f"{folder / CONFIG}: rank_pattern and alpha_pattern give gate_up_proj twice the rank and alpha "
                        "(peft's fusion of w1 and w3 adapters); set model.lora.fused_gate_up=true")
    if lora.fused_gate_up and not (cfg.get("rank_pattern") and cfg.get("alpha_pattern")):
        raise UserError(f"{folder / CONFIG} has no rank_pattern (and alpha_pattern) of a fused gate_up_proj but "
                        "model.lora.fused_gate_up="
                        "true; set model.lora.fused_gate_up=false")
    for key, want in {**COMPUTES, **_fused_patterns(lora)}.items():
        got = cfg.get(key)
        if got is not None and got != want and not (want == {} and not got):
            raise UserError(f"{folder / CONFIG}: {key}={cfg[key]!r} is not supported (meshtrain computes {key}="
                            f"{want!r}); give an adapter without it")
    saved = sorted({m.rpartition(".")[2] for m in cfg.get("modules_to_save") or []})  # peft adds model.embed_tokens
    if "embed_tokens" in saved and _tied_embedding(mc) and not cfg.get("ensure_weight_tying"):
        raise UserError(f"{folder / CONFIG}: modules_to_save embed_tokens on a model with tied embeddings without "
                        "ensure_weight_tying: peft then trains the input embedding apart from the head, which a tied "
                        "model cannot hold; give an adapter saved with ensure_weight_tying=true")
    if saved != sorted(lora.modules):
        raise UserError(f"{folder / CONFIG}: modules_to_save={saved} but model.lora.modules={sorted(lora.modules)}; set "
                        f"model.lora.modules=[{','.join(saved)}]")
    theirs = {"r": (lora.rank, "model.lora.rank"), "lora_alpha": (lora.alpha, "model.lora.alpha"),
              "use_rslora": (lora.rslora, "model.lora.use_rslora")}
    for key, (mine, name) in theirs.items():
        if key in cfg and float(cfg[key]) != float(mine):
            raise UserError(f"{folder / CONFIG}: {key}={cfg[key]} but {name}={mine}; set {name}={cfg[key]}")
    have = cfg.get("target_modules") or []
    have = [have] if isinstance(have, str) else list(have)
    want = sorted(t for t, _ in targets(mc, family(mc.family).hf.leaves(mc)).values())
    if sorted(have) != want:
        raise UserError(f"{folder / CONFIG}: target_modules={sorted(have)} but model.lora.targets gives {want}; set "
                        f"model.lora.targets=[{','.join(sorted(have))}]")
    params = sorted(cfg.get("target_parameters") or [])
    if params != sorted(expert_targets(mc)):
        raise UserError(f"{folder / CONFIG}: target_parameters={params} but model.lora.targets gives "
                        f"{sorted(expert_targets(mc))}; name them in model.lora.targets")
    return cfg


def read_peft(folder, mc, shapes: dict) -> dict:
    """{adapter param: array (layers, ...)} of a peft adapter folder for the model mc (shapes: the run's params'
    shapes); a missing tensor or one of another shape is a one-line error."""
    folder = Path(folder)
    check_config(folder, mc)
    have = st.read_header(folder / WEIGHTS)
    out = {}
    for k, (_, leaf) in targets(mc, family(mc.family).hf.leaves(mc)).items():
        a_shape, b_shape = shapes["layers"][k + A].shape[1:], shapes["layers"][k + B].shape[1:]
        rows_a, rows_b = [], []
        for i in range(mc.n_layers):
            na, nb = _names(leaf, i)
            if na not in have or nb not in have:
                raise UserError(f"{folder / WEIGHTS} lacks '{na if na not in have else nb}'; give the adapter of "
                                "this model")
            try:
                a, b = from_peft(have[na].array(), have[nb].array(), leaf, a_shape, b_shape)
            except ValueError:
                raise UserError(f"{folder / WEIGHTS}: '{na}' {list(have[na].shape)} does not fit the model's "
                                f"{leaf.names[i]}; give the adapter of this model") from None
            rows_a.append(a)
            rows_b.append(b)
        out[k + A], out[k + B] = np.stack(rows_a), np.stack(rows_b)
    for k in (EXPERTS[t] for t in expert_targets(mc)):
        a_shape, b_shape = shapes["layers"][k + A].shape[1:], shapes["layers"][k + B].shape[1:]
        rows = []
        for i in range(mc.n_layers):
            na, nb = _expert_names(mc, i)[k]
            if na not in have or nb not in have:
                raise UserError(f"{folder / WEIGHTS} lacks '{na if na not in have else nb}'; give the adapter of "
                                "this model")
            rows.append(experts_from_peft(k, have[na].array(), have[nb].array(), a_shape, b_shape))
        out[k + A], out[k + B] = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    for k, leaf in saved_modules(mc, family(mc.family).hf.leaves(mc)).items():
        name = PREFIX + leaf.names[0]
        if name not in have or tuple(have[name].shape) != tuple(leaf.hf_shape):
            raise UserError(f"{folder / WEIGHTS} lacks '{name}' {list(leaf.hf_shape)} of modules_to_save; give the "
                            "adapter of this model")
        out[k] = have[name].array().reshape(leaf.view).transpose(leaf.perm)
    return out


def merged_params(params: dict, mc) -> dict:
    """The base with each adapted weight W + scale A B (the adapters dropped): what `export --format hf --merge`
    writes, a plain model of the family."""
    from models.lora import delta
    chosen = targets(mc, family(mc.family).hf.leaves(mc))
    layers = {k: v for k, v in params["layers"].items() if not k.endswith((A, B))}
    for k, (_, leaf) in chosen.items():
        ins, outs = split_axes(leaf)
        d = jax.vmap(lambda a, b: delta(a, b, ins, outs))(params["layers"][k + A], params["layers"][k + B])
        layers[k] = (params["layers"][k] + jnp.asarray(mc.lora.scale, jnp.float32) * d).astype(layers[k].dtype)
    if expert_targets(mc):
        from models.lora import merged_experts
        merged = jax.vmap(lambda lay: merged_experts(mc, lay, {}))(params["layers"])
        layers.update({k: v.astype(layers[k].dtype) for k, v in merged.items()})
    return {**params, "layers": layers}


def with_adapters(s, params: dict) -> dict:
    """A LoRA run's parameters from base parameters (an HF folder's): the adapters from model.lora.init_from (a peft
    folder), else peft's initialisation (A Kaiming-uniform from the run's seed, B zero), in their shardings."""
    from models.lora import kaiming_a
    mc, shapes, shardings = s.model, s.shapes["params"], s.shardings["params"]
    names = [k for k in shapes["layers"] if k.endswith((A, B))]
    folder = s.cfg.model.lora.init_from
    if folder:
        got = read_peft(folder, mc, shapes)
        fresh = {k: jax.device_put(got[k].astype(shapes["layers"][k].dtype), shardings["layers"][k]) for k in names}
        whole = {k: jax.device_put(v.astype(shapes[k].dtype), shardings[k]) for k, v in got.items() if k in shapes}
        return {**params, **whole, "layers": {**params["layers"], **fresh}}  # modules_to_save as the adapter holds them
    else:
        keys = jax.random.split(jax.random.key(s.cfg.train.seed + 7919), len(names))

        def one(k, key):
            sh = shapes["layers"][k]
            lead = 2 if k.startswith("experts_") else 1  # (layers, experts, in..., r)
            return kaiming_a(key, sh.shape, sh.dtype, lead) if k.endswith(A) else jnp.zeros(sh.shape, sh.dtype)
        with jax.set_mesh(s.mesh):
            fresh = {k: jax.jit(lambda key, k=k: one(k, key), out_shardings=shardings["layers"][k])(key)
                     for k, key in zip(names, keys)}
    return {**params, "layers": {**params["layers"], **fresh}}

