"""A LoRA run's checkpoints hold its frozen base by reference: the adapters, the trained modules and their optimizer
state are saved; the base (model.lora, Param.trainable False) is the Hugging Face folder `model.init_from` named when
the run began, recorded in the checkpoint's meta with each leaf's shape, dtype and checksum (the same checksum every
saved leaf has, trainer/ckpt/store.py). Reading the checkpoint back (a resume, `meshtrain export`, `generate`, a
run's parameters as another's model.init_from) reads the base from that folder again and checks it leaf by leaf: a
base that moved or changed stops in one line, the checkpoint left as it is.

Only a Hugging Face folder is referenced (the base of every LoRA run: trainer/ckpt/params.py); a run without
model.init_from (a random base) saves its base whole."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from models.frozen import joined
from models.transformer import inventory
from trainer.ckpt.objects import path_of
from trainer.ckpt.store import describe_leaves, kind_of
from trainer.errors import UserError

KEY = "base"  # the meta entry: {"init_from": folder, "leaves": {"params.layers.wq": {shape, dtype, checksum}}}


def by_reference(cfg, mc) -> bool:
    """Whether a run's checkpoints hold its base by reference (LoRA over an HF model.init_from)."""
    return mc.lora is not None and bool(cfg.model.init_from) and kind_of(path_of(cfg.model.init_from)) == "hf"


def _is_base(mc):
    """(stack or None, name) -> whether that parameter is the base LoRA froze (not state the step sets itself,
    DeepSeek's router bias, which is saved)."""
    inv, whole = inventory(mc), inventory(dataclasses.replace(mc, lora=None))

    def base(k, n=None):
        p, q = (inv[k], whole.get(k)) if n is None else (inv[k][n], whole.get(k, {}).get(n))
        return not p.trainable and q is not None and q.trainable
    return base


def split(mc, params: dict, base: bool) -> dict:
    """The parameters (or their abstract target) of the base alone (`base`), or without it."""
    is_base = _is_base(mc)
    out = {k: ({n: w for n, w in v.items() if is_base(k, n) == base} if isinstance(v, dict) else v)
           for k, v in params.items() if isinstance(v, dict) or is_base(k) == base}
    return {k: v for k, v in out.items() if not isinstance(v, dict) or v}


def without_base(mc, state: dict) -> dict:
    """The train state (or its abstract target) without the frozen base's leaves."""
    return {**state, "params": split(mc, state["params"], base=False)}


def record(cfg, mc, params: dict) -> dict:
    """The meta entry of the base: its folder and its leaves' descriptions (checksums included)."""
    leaves = describe_leaves({"params": split(mc, params, base=True)})
    return {"init_from": absolute(cfg.model.init_from), "leaves": leaves}


def absolute(folder) -> str:
    """A local folder's absolute path (a resume may start elsewhere), a URL as it is."""
    p = path_of(folder)
    return str(p.absolute()) if isinstance(p, Path) else str(folder)


def there(recorded: dict, folder: str | None, where: str) -> tuple[str, str]:
    """(the base's folder: `folder`, else the recorded one; what to do where it is not the base), after a one-line
    UserError where that folder is not a Hugging Face model folder (moved or deleted)."""
    folder = folder or recorded["init_from"]
    fix = (f"put the base it was trained on back at {folder} (a resume may instead set model.init_from to where it "
           f"is now; export and generate read the recorded {recorded['init_from']})")
    if kind_of(path_of(folder)) != "hf":
        raise UserError(f"{where} holds LoRA adapters whose base is read from model.init_from, but {folder} is no "
                        f"Hugging Face model folder (moved or deleted?); {fix}")
    return folder, fix


def attach(mc, params: dict, recorded: dict, target: dict, shardings: dict, folder: str | None, where: str) -> dict:
    """`params` (without the base) with the base read from `folder` (default: the recorded one) into the whole
    parameter tree's `target` (shapes and dtypes) and `shardings`, each leaf checked against the recorded one."""
    from trainer.ckpt.hf import load as load_hf
    from trainer.ckpt.store import checksums
    folder, fix = there(recorded, folder, where)
    base = split(mc, load_hf(path_of(folder), mc, target, shardings), base=True)
    got, leaves = checksums({"params": base}), recorded["leaves"]
    for name in sorted(leaves.keys() | got.keys()):
        if name not in leaves or got.get(name) != leaves[name]["checksum"]:
            raise UserError(f"{where}: its base {folder} is not the one its adapters were trained on ('{name}' "
                            f"differs from the checksum recorded at save time); {fix}")
    return joined(params, base)


def resumed(s, state: dict, recorded: dict, where: str) -> tuple[dict, dict]:
    """(a restored train state of Setup s with its base attached from s's model.init_from, else the recorded
    folder; the record its next checkpoints carry: the folder it was read from)."""
    folder = s.cfg.model.init_from or recorded["init_from"]
    params = attach(s.model, state["params"], recorded, s.shapes["params"], s.shardings["params"], folder, where)
    return {**state, "params": params}, {**recorded, "init_from": absolute(folder)}
