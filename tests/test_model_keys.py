"""Each `model.*` key is declared once: a field of models/config.py's ModelConfig (the keys every family shares), of a
family's own config (models/families/gemma.py's Gemma2Config and Gemma3Config), or one of the two keys the trainer alone reads
(trainer/config/model_section.py, which writes the config section from the others' declarations). A family's own field is
read only in its family's modules: the shared layers take its value as an argument or through the family's hooks. The
mesh facts (platform, kv heads' repeat) reach the model as arguments, and nothing but a family subclasses its config.
A checkpoint's config written before all this (every family's key in it) still makes the same model."""
import ast
import collections
import shutil
import sys
from pathlib import Path

import pytest

from models import FAMILIES, ModelConfig, from_preset
from models.config import is_key, own_keys
from trainer.config import all_keys, load_config, model_config
from trainer.errors import UserError
from trainer.config.schema import specs
from trainer.config.sections import Config

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "trainer")
DECLARE = ("key", "setting")  # models/config.py's and trainer/config/schema.py's field makers


def _trees(root: Path):
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            yield str(f.relative_to(root)), ast.parse(f.read_text(), str(f))


def _declares(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DECLARE


def declarations(root: Path = ROOT) -> dict[str, list[str]]:
    """{name: ['file:line', ...]} of every config key declared under models/ and trainer/: a class field whose default
    is key(...) or setting(...), or a (name, type, setting(...)) entry of a section made by make_dataclass."""
    out = collections.defaultdict(list)
    for rel, tree in _trees(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and _declares(s.value)]
                for s in fields:
                    out[s.target.id].append(f"{rel}:{s.lineno}")
            elif isinstance(node, ast.Tuple) and len(node.elts) == 3 and _declares(node.elts[2]) and \
                    isinstance(node.elts[0], ast.Constant):
                out[node.elts[0].value].append(f"{rel}:{node.lineno}")
    return out


def _module_file(fn) -> str | None:
    fn = getattr(fn, "func", fn)  # a functools.partial
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = Path(getattr(mod, "__file__", "") or "/")
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else None


def owners() -> dict[str, set[str]]:
    """{family-only field: the files of the families that declare it}: the module of each such family's config and
    those of its Hugging Face adapter's functions."""
    out = collections.defaultdict(set)
    for spec in FAMILIES.values():
        files = {_module_file(spec.config)} | {_module_file(f) for f in (spec.hf or ()) if callable(f)}
        for k in own_keys(spec.name):
            out[k] |= files - {None, "models/spec.py", "models/hf/types.py"}
    return out


def family_reads(root: Path, allowed: dict[str, set[str]]) -> list[str]:
    """'file:line name' of each read of a family-only field (an attribute, or getattr with the name) in a file that
    is not one of its families'."""
    bad = []
    for rel, tree in _trees(root):
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                name = node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and \
                    len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
            if name in allowed and rel not in allowed[name]:
                bad.append(f"{rel}:{node.lineno} {name}")
    return bad


def _declared_by(name: str) -> list[type]:
    """The model config classes whose own body declares `name` (a subclass inherits, it does not declare), and the
    mixins of keys several families share (a family config's base that is not a ModelConfig: YaRN's, local_layers)."""
    configs = {s.config for s in FAMILIES.values() if s.config is not None}
    mixins = {b for c in configs for b in c.__mro__ if b is not object and not issubclass(b, ModelConfig)}
    classes = {ModelConfig} | configs | mixins
    return [c for c in classes if name in c.__dict__.get("__annotations__", {})]


def test_each_model_key_is_declared_once_and_the_section_is_written_from_it():
    keys = [k.split(".", 1)[1] for k in all_keys("model.")]
    same_name = collections.Counter(k.split(".")[-1] for k in all_keys())  # mesh.preset is a key of its own
    found = declarations()
    assert {k: found.get(k, []) for k in keys if len(found.get(k, [])) != same_name[k]} == {}
    trainer_only = {"preset", "init_from"} | {k for k in keys if k.startswith("lora.")}  # model.lora: the trainer's
    shared = [f.name for f in ModelConfig.__dataclass_fields__.values() if is_key(f)]
    families = {k for name in FAMILIES for k in own_keys(name)}
    assert sorted(keys) == sorted(trainer_only | set(shared) | families) and not set(shared) & families
    assert {"embed_scale", "norm_plus_one", "final_softcap", "attn_softcap", "query_scale", "local_layers",
            "rope_local_theta", "rope_linear", "n_experts", "n_experts_per_token", "expert_d_ff", "capacity_factor",
            "router_aux_loss", "router_z_loss", "router", "norm_topk_prob", "shared_expert_d_ff",
            "dispatch_factor", "first_dense", "shared_experts", "n_groups", "groups_kept", "routed_scale", "bias_rate",
            "seq_balance_loss", "q_rank", "kv_rank", "nope_dim", "rope_dim", "v_dim", "rope_interleave", "yarn_factor",
            "yarn_original", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
            "yarn_truncate", "swiglu_limit", "swiglu_alpha"} == families
    assert {k: _declared_by(k) for k in keys if len(_declared_by(k)) != (k not in trainer_only)} == {}
    # the section's meaning of each key is the declaring field's, and null stands for the model's default
    rows = {s.key.split(".", 1)[1]: s for s in specs(Config) if s.key.startswith("model.")}
    for k in sorted(set(keys) - trainer_only):
        f = _declared_by(k)[0].__dataclass_fields__[k]
        assert rows[k].doc == f.metadata["doc"] and rows[k].optional == f.metadata["null"], k
        assert rows[k].default == (None if f.metadata["null"] else f.default), k


@pytest.mark.parametrize("target,added", [
    ("trainer/config/model_section.py", "\n\nclass Again:\n    d_model: int = setting(1, None, 'again')\n"),
    ("trainer/config/sections.py", "\n\nEXTRA = [('d_model', int, setting(1, None, 'again'))]\n"),
], ids=["a-field", "a-generated-section-entry"])
def test_the_check_sees_a_key_declared_twice(tmp_path, target, added):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert len(declarations(tmp_path)["d_model"]) == 1
    with open(tmp_path / target, "a") as f:
        f.write(added)
    assert [p.split(":")[0] for p in declarations(tmp_path)["d_model"]] == ["models/config.py", target]


def test_a_family_field_is_read_only_in_its_family_modules(tmp_path):
    """Gemma's fields are read in models/families/gemma.py and its adapter models/hf/gemma.py only; the shared embedding,
    norm, head, loss, RoPE, FLOP count and KV cache take them as arguments or through the family's hooks. A read
    added to models/objectives/objective.py is seen."""
    allowed = owners()
    assert allowed["final_softcap"] == {"models/families/gemma.py", "models/hf/gemma.py"}
    assert family_reads(ROOT, allowed) == []
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "models" / "objectives" / "objective.py", "a") as f:
        f.write("\n\ndef _capped(c):\n    return c.final_softcap, getattr(c, 'local_layers')\n")
    assert [b.split(":", 1)[0] + " " + b.split()[-1] for b in family_reads(tmp_path, allowed)] == \
        ["models/objectives/objective.py final_softcap", "models/objectives/objective.py local_layers"]


def _subclasses(cls):
    return {s for c in cls.__subclasses__() for s in {c} | _subclasses(c)}


def test_mesh_facts_are_arguments_and_only_families_subclass_the_config():
    """The setup on (1,1,8) of a model with 4 kv heads: its placement repeats each twice on the host's platform,
    the model's config holds neither; the planner (imported) adds no subclass of ModelConfig."""
    import trainer.plan.core  # noqa: F401  (the planner's modules)
    import trainer.plan.memory  # noqa: F401
    from trainer.state import make_setup
    import jax
    s = make_setup(load_config(["model.preset=tiny", "mesh.data=1", "mesh.model=8"]), jax.devices()[:8])
    assert s.placement[:2] == (jax.devices()[0].platform, 2) and s.model == model_config(s.cfg)
    assert not {"kv_repeat", "platform"} & set(ModelConfig.__dataclass_fields__)
    assert _subclasses(ModelConfig) <= {spec.config for spec in FAMILIES.values()}


# the model sections of checkpoints written at 5cbc3bb (every family's key in each: a Llama's Gemma switches false)
OLD_LLAMA = {"preset": "tiny", "family": "llama", "d_model": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4,
             "head_dim": 8, "d_ff": 128, "vocab_size": 256, "seq_len": 32, "tie_embeddings": True,
             "rope_theta": 10000.0, "norm_eps": 1e-05, "rope_scaling": None, "window": None, "local_layers": None,
             "rope_local_theta": None, "rope_linear": None, "attn_softcap": None, "final_softcap": None,
             "query_scale": None, "embed_scale": False, "norm_plus_one": False, "remat": "none", "scan_layers": None,
             "attention": "auto", "attention_block": None, "kernels": "auto", "loss_chunk": None, "init_from": None}
OLD_GEMMA3 = {**OLD_LLAMA, "family": "gemma3", "window": 8, "local_layers": [True, False], "rope_local_theta": 10000.0,
              "rope_linear": 8.0, "embed_scale": True, "norm_plus_one": True}


def test_an_old_checkpoints_config_makes_the_same_model():
    llama = model_config(load_config(base={"model": OLD_LLAMA}))
    assert llama == from_preset("tiny") and type(llama) is ModelConfig
    gemma = model_config(load_config(base={"model": OLD_GEMMA3}))
    want = dict(window=8, local_layers=(True, False), rope_local_theta=1e4, rope_linear=8.0, embed_scale=True,
                norm_plus_one=True, attn_softcap=None, final_softcap=None, query_scale=None)
    assert gemma.family == "gemma3" and {k: getattr(gemma, k) for k in want} == want
    # a switch of another family's that asks for something is refused, as any of its keys
    with pytest.raises(UserError, match=r"^model.embed_scale is a key of gemma2, gemma3, not of "
                                        r"model.family='llama'; drop it or set model.family$"):
        model_config(load_config(base={"model": {**OLD_LLAMA, "embed_scale": True}}))
    with pytest.raises(UserError, match=r"^model.rope_linear is a key of gemma3, not of model.family='gemma2'"):
        model_config(load_config(["model.family=gemma2", "model.rope_linear=8"]))
