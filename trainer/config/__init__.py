"""Typed config: the schema's defaults (trainer/config/sections.py), YAML files and key=value overrides; later files and
overrides win. Unknown keys, wrong types, values out of range and impossible layouts are UserErrors with one line
naming the fix: per key in `load_config` (trainer/config/schema.py's `check_ranges`), across keys and devices in
`validate`."""
from __future__ import annotations

import dataclasses
import functools
import logging
import re
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from meshes import CONTEXT, DATA, EXPERT, MODEL, STAGE, MeshError, MeshShape, load_preset, shape_of
from models import FAMILIES, ModelConfig, family, from_preset
from models.spec import nothing_after, stacks
from models.config import own_keys
from trainer.errors import UserError
from trainer.config.schema import check_ranges, closest, help_text, markdown, specs, step_range, text_lists
from trainer.config.dpo import ignored_dpo, objective_checks, objectives_of
from trainer.config.lora import lora_checks, lora_of
from trainer.config.experts import axis_of
from trainer.config.mixture_entries import ignored_source
from trainer.config.paths import check_layer
from trainer.config.sections import ALIASES, Config
from trainer.config.widths import not_divisible, split_widths

__all__ = ["Config", "all_keys", "compute_dtype", "keys_help", "keys_markdown", "load_config", "model_config",
           "replace", "step_range", "to_yaml", "validate"]
SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}
# A pipeline's schedule table (mesh.stage x train.microbatches x train.pipeline_repeats ops) is built in Python at
# start, about 3 s for this many (trainer/parallel/schedules.py); Megatron-sized pipelines hold a few thousand.
PIPELINE_OPS = 2 ** 18
# What a pipeline stage body honours of model.remat: trainer/parallel/pipeline.py recomputes each stage body whole
# for its backward, so that none, dots and full run the same program there (trainer/plan/types.py `executed`)
PIPELINE_REMATS = ("none", "sublayer")
log = logging.getLogger(__name__)


def all_keys(prefix: str = "") -> list[str]:
    """Every dotted key of the schema (those starting with `prefix`), in declaration order."""
    return [s.key for s in specs(Config) if s.key.startswith(prefix)]


def keys_help(prefix: str = "") -> str:
    """The keys for `--help`, each with its type, default, allowed values and meaning."""
    return help_text(Config, prefix)


def keys_markdown() -> str:
    """docs/config.md's table of every key (scripts/config_docs.py writes it there)."""
    return markdown(Config)


def _closest(name: str) -> str:
    """'did you mean ...?' for an unknown key; where several sections have its name, train's first."""
    return closest(name, all_keys(), ALIASES, first="train")


def _unknown(node, where: str) -> None:
    """A UserError naming every key of one layer that the schema lacks, each with the closest known key."""
    bad = []
    for name, body in (OmegaConf.to_container(node, resolve=False) or {}).items():
        if name not in SECTIONS:  # the whole dotted keys: 'modle.preset' is nearest 'model.preset'
            bad += [f"{name}.{k}" for k in body] if isinstance(body, dict) and body else [str(name)]
        elif isinstance(body, dict):
            fields = {f.name for f in dataclasses.fields(SECTIONS[name])}
            bad += [f"{name}.{k}" for k in body if k not in fields]
        elif body is not None:
            raise UserError(f"'{name}' is a section of keys, not a value ({where}); give its keys, e.g. "
                            f"{all_keys(name + '.')[0]}=...")
    hints = [(k, _closest(k)) for k in bad]
    if len(hints) == 1:
        raise UserError(f"unknown config key '{bad[0]}' ({where}); {hints[0][1]}")
    if hints:
        raise UserError(f"unknown config keys ({where}): " + ", ".join(f"'{k}' ({h})" for k, h in hints))


@functools.lru_cache(maxsize=None)
def _schema(name: str | None):
    """The structured (typed) OmegaConf node of one section (None: the whole config), made once (a merge copies it)."""
    return OmegaConf.structured(SECTIONS[name] if name else Config)


def _built(layers: list) -> Config:
    """The config the layers make, section by section (a section no layer names costs nothing); where a value
    interpolates (`${train.b1}`, which may name any key), over the whole typed config."""
    try:
        if "${" in str([OmegaConf.to_container(layer, resolve=False) for layer, _ in layers]):
            node = _schema(None)
            for layer, where in layers:
                node = _merge(node, layer, where, None)
            return OmegaConf.to_object(node)
        sections = {}
        for name, kind in SECTIONS.items():
            node = None
            for layer, where in layers:
                if layer.get(name) is not None:
                    node = _merge(_schema(name) if node is None else node, layer[name], where, name)
            sections[name] = kind() if node is None else OmegaConf.to_object(node)
        return Config(**sections)
    except OmegaConfBaseException as e:  # an interpolation of a key that is not there, or of another type
        where = f"config key '{e.full_key}'" if getattr(e, "full_key", None) else "bad config"
        raise UserError(f"{where}: {str(e).splitlines()[0]}; fix the interpolation") from None


def _merge(base, other, where: str, section: str | None):
    prefix = f"{section}." if section else ""
    try:
        return OmegaConf.merge(base, other)
    except ConfigKeyError as e:  # _unknown has named every unknown key; a deeper one lands here
        name = f"{prefix}{e.full_key or e}"
        raise UserError(f"unknown config key '{name}' ({where}); {_closest(name)}") from None
    except ValidationError as e:
        name = f"{prefix}{e.full_key}"
        kind = next((s.type_text for s in specs(Config) if s.key == re.sub(r"\[.*", "", name)), "its type")
        if kind.startswith("list") and "is not a ListConfig" in str(e):  # one value where a list goes
            raise UserError(f"config key '{name}' ({where}) is a list: write {name}=[A,B] (brackets, quoted in a "
                            "shell)") from None
        raise UserError(f"config key '{name}' ({where}): {str(e).splitlines()[0]}; give a value of type {kind}") \
            from None
    except OmegaConfBaseException as e:
        raise UserError(f"bad config ({where}): {str(e).splitlines()[0]}") from None


@functools.lru_cache(maxsize=None)
def _yaml_loader():
    """OmegaConf's YAML loader (a SafeLoader refusing duplicate keys) that reads a base-60 number such as 5:8 as
    the text it is (YAML 1.2's reading), not as YAML 1.1's integer 308: a step range in a file stays a range."""
    try:
        from omegaconf.omegaconf import get_yaml_loader  # omegaconf 2.4
    except ImportError:
        from omegaconf._utils import get_yaml_loader  # 2.3
    base = get_yaml_loader()
    no_colon = {ch: [(tag, re.compile(r"(?=[^:]*$)" + rx.pattern, rx.flags) if tag.endswith(("int", "float")) else rx)
                     for tag, rx in rules] for ch, rules in base.yaml_implicit_resolvers.items()}
    return type("Loader", (base,), {"yaml_implicit_resolvers": no_colon})


def _load_yaml(path: str):
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file '{path}' does not exist; give the path of a YAML file")
    try:
        with open(p, encoding="utf-8") as f:
            loader = _yaml_loader()(f)  # a SafeLoader: tags that would build Python objects are refused
            try:
                body = loader.get_single_data()
            finally:
                loader.dispose()
    except yaml.MarkedYAMLError as e:  # the problem and its line, not only the context it was found in
        mark = e.problem_mark or e.context_mark
        what = (e.problem or str(e).splitlines()[0]) + (f" (line {mark.line + 1}, column {mark.column + 1})"
                                                        if mark else "")
        if "could not determine a constructor" in what:
            raise UserError(f"config file '{path}': {what}; meshtrain reads plain YAML only (no Python tags), "
                            "remove the tag") from None
        raise UserError(f"config file '{path}' is not valid YAML: {what}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserError(f"config file '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(body, dict) and body is not None:
        raise UserError(f"config file '{path}' must hold a mapping of sections (model:, train:, ...)")
    return OmegaConf.create(body or {})


def load_config(args: list[str] = (), base: dict | None = None) -> Config:
    """Config from the schema defaults, YAML files and key=value overrides, in order. Pure: what the
    config points at (a data sidecar, a Hugging Face folder) is read by trainer/ckpt/sources.py."""
    files, pairs = [], []
    for a in args:
        if a.startswith("-"):
            raise UserError(f"unknown option '{a}'; give YAML files and key=value pairs, e.g. train.steps=100 "
                            "(--help lists the keys)")
        if "=" in a and not a.endswith((".yaml", ".yml")):
            pairs.append(a)
        else:
            files.append(a)
    for p in pairs:
        if not p.split("=", 1)[0]:
            raise UserError(f"override '{p}' has no key; write key=value, e.g. train.steps=100")
    layers = [(_load_yaml(f), f"file {f}") for f in files]
    if base:
        layers.insert(0, (OmegaConf.create(base), "base"))
    try:
        # YAML 1.1 reads 5:8 as the base-60 integer 308: keep such values (step ranges) as text, as files do
        dot = OmegaConf.from_dotlist([re.sub(r"=([-+]?[\d_]+(?::[\d_.]+)+)$", r"='\1'", p) for p in pairs])
    except Exception as e:
        raise UserError(f"cannot parse overrides {pairs}: {str(e).splitlines()[0]}; write key=value") from None
    layers.append((dot, "command line"))
    # A mesh preset goes first, so that explicit keys anywhere override it.
    preset = None
    for node, _ in layers:
        preset = OmegaConf.select(node, "mesh.preset", default=preset)
    if preset:
        try:
            layers.insert(0, (OmegaConf.load(load_preset(str(preset))), f"mesh preset {preset}"))
        except MeshError as e:
            raise UserError(f"mesh.preset={preset}: {e}") from None
    for node, where in layers:
        _unknown(node, where)
        text_lists(node, Config)
        check_layer(node, where)
    cfg = _built(layers)
    check_ranges(cfg)  # every key against its allowed values, before anything is touched
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def replace(cfg: Config, **sections) -> Config:
    """A copy of cfg with section fields replaced: replace(cfg, train=dict(steps=3))."""
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})


def model_config(cfg: Config) -> ModelConfig:
    """The model's config (its family's class): the preset, the family's defaults, and the explicit model.* keys
    over them. Another family's own key is an error naming the families it belongs to, unless it asks for nothing
    (null, or a switch set false: a checkpoint's config written before the families had configs of their own holds
    every family's keys so)."""
    m = cfg.model
    over = {k: v for k, v in dataclasses.asdict(m).items() if k not in ("preset", "init_from", "lora")}
    if m.rope_scaling is not None:  # hashable, the original context length an int
        f, lo, hi, n = m.rope_scaling
        over["rope_scaling"] = (float(f), float(lo), float(hi), int(n))
    name = m.family or "llama"
    theirs = _keys_of(tuple((f, spec.config) for f, spec in FAMILIES.items()))
    for k in sorted(set(theirs) - set(own_keys(name))):
        if over.get(k) is not None and over[k] is not False:
            raise UserError(f"model.{k} is a key of {', '.join(theirs[k])}, not of model.family='{name}'; drop it "
                            "or set model.family")
        over.pop(k, None)
    return from_preset(m.preset, **over, documents=bool(cfg.data.document_mask), **objectives_of(cfg),
                       lora=lora_of(m.lora))


@functools.lru_cache(maxsize=8)
def _keys_of(registered: tuple) -> dict[str, list[str]]:
    """{family's own key: the families that declare it} of the registered families ((name, config class) pairs: the
    key of the cache; model_config runs several times per setup)."""
    return {k: sorted(f for f, _ in registered if k in own_keys(f)) for f, _ in registered for k in own_keys(f)}


def compute_dtype(cfg: Config, platform: str) -> str:
    return cfg.train.dtype or ("float32" if platform == "cpu" else "bfloat16")


def experts_axis(cfg: Config, data: int, quiet: bool = False, expert: int = 1) -> str | None:
    """The mesh axis the run splits its experts over, or None (trainer/config/experts.py)."""
    return axis_of(cfg.train, model_config(cfg), data, expert, None if quiet else _warn_once)


def expert_parallel(cfg: Config, data: int, quiet: bool = False, expert: int = 1) -> bool:
    """Whether the run splits its experts (experts_axis is not None)."""
    return experts_axis(cfg, data, quiet, expert) is not None


def validate(cfg: Config, n_devices: int) -> MeshShape:
    """Check the config against the device count, key against key; return the resolved mesh shape (meshes/axes.py).
    (Each key's own range is load_config's; checked again here for a config that replace() or an HF folder
    changed.)"""
    check_ranges(cfg)
    t, mc = cfg.train, model_config(cfg)
    try:
        shape = shape_of(cfg.mesh, n_devices)  # the DCN split of each axis checked too
    except MeshError as e:
        raise UserError(str(e)) from None
    data, stage, model = shape[DATA] * shape[EXPERT], shape[STAGE], shape[MODEL]  # the batch over data x expert
    rows = "mesh.data" if shape[EXPERT] == 1 else "mesh.data x mesh.expert"
    checks = _model_checks(cfg, mc, model) + [
        (t.batch_size % (data * t.microbatches) == 0,
         f"train.batch_size={t.batch_size} is not divisible by {rows} x train.microbatches = "
         f"{data} x {t.microbatches} (each microbatch of batch_size/microbatches rows is split over "
         f"{rows}); use a multiple of {data * t.microbatches}"),
        *_pipeline_checks(t, mc, stage), (t.sync == "every_step" or (t.zero_stage == 0 and stage == 1),
         f"train.sync={t.sync} keeps a whole replica on every data shard; set train.zero_stage=0 and mesh.stage=1"),
        (t.sync == "every_step" or family(mc.family).after_step is nothing_after,
         f"train.sync={t.sync} with model.family={mc.family} is not supported: the family sets state after each step "
         "from the whole batch's statistics (its router bias from the experts' loads), which local SGD's replicas "
         "would each set apart; use train.sync=every_step"),
        *_context_checks(t, mc, shape[CONTEXT], model, stage), *lora_checks(mc, t, cfg.model),
        *[(t.microbatches == 1 and stage == 1 and t.sync == "every_step", f"{why} needs the step's whole batch in one "
           f"objective: set train.microbatches=1, mesh.stage=1, train.sync=every_step (now {t.microbatches}, {stage}, "
           f"{t.sync}), or the weight to 0") for why in [family(mc.family).whole_batch(mc)] if why],
        *objective_checks(cfg, mc, shape[CONTEXT]),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    experts_axis(cfg, shape[DATA], expert=shape[EXPERT])
    if ignored := ignored_source(cfg.data):
        _warn_once(ignored)
    if ignored := ignored_dpo(cfg):
        _warn_once(ignored)
    if stage > 1 and cfg.model.remat not in PIPELINE_REMATS:
        _warn_once(f"model.remat={cfg.model.remat} does nothing under a pipeline (mesh.stage={stage}): each stage "
                   f"recomputes its layers whole for its backward anyway; set model.remat to "
                   f"{' or '.join(PIPELINE_REMATS)} (what a stage runs)")
    return shape


def _context_checks(t, mc: ModelConfig, context: int, model: int = 1, stage: int = 1) -> list[tuple[bool, str]]:
    """(ok, message) of context parallelism (mesh.context > 1) against the model and the other keys."""
    if context == 1:
        return [(t.context_attention == "all_gather", f"train.context_attention={t.context_attention} needs "
                 "mesh.context > 1 (each row split over context ranks); set mesh.context or leave the key out")]
    chunks = 2 * context if t.context_load_balance else context
    why = (f" (load balancing gives each rank 2 of {chunks} chunks; or set train.context_load_balance=false)"
           if t.context_load_balance else "")
    return [
        (mc.seq_len % chunks == 0, f"model.seq_len={mc.seq_len} is not divisible by "
         f"{'2 x ' if t.context_load_balance else ''}mesh.context = {chunks}{why}; use a multiple of {chunks}"),
        (t.context_attention != "all_to_all" or mc.n_heads % (model * context) == 0,
         f"train.context_attention=all_to_all splits each rank's heads over the context ranks: model.n_heads="
         f"{mc.n_heads} is not divisible by mesh.model x mesh.context = {model} x {context}; use all_gather or "
         "a mesh.context that divides the heads"),
        (t.context_attention != "ring" or stage == 1 or context % 2 == 0,
         f"train.context_attention=ring with mesh.stage={stage} needs an even mesh.context (got {context}): inside a "
         "pipeline the ring's step is two all-gathers within pairs of neighbours; use an even mesh.context, or "
         "all_gather or all_to_all"),
        (t.sync == "every_step", f"train.sync={t.sync} with mesh.context={context} is not supported: local SGD keeps "
         "a replica per data rank; use train.sync=every_step or mesh.context=1"),
        *[(False, f"{why}; use mesh.context=1") for why in [family(mc.family).context_refusal(mc, context)] if why],
    ]


def _pipeline_checks(t, mc: ModelConfig, stage: int) -> list[tuple[bool, str]]:
    """(ok, message) of the pipeline's keys against one another and against mesh.stage."""
    ops = stage * t.microbatches * t.pipeline_repeats
    L, first = stacks(mc)["layers"], family(mc.family).first_layers(mc)
    split = (f"model.n_layers={mc.n_layers} less its {first} first layers (they run on the first stage with the "
             f"embedding) = {L}" if first else f"model.n_layers={mc.n_layers}")
    return [
        (L % stage == 0, f"{split} is not divisible by mesh.stage={stage} (remainder {L % stage}); use a mesh.stage "
                         f"that divides {L}"),
        (t.pipeline_schedule != "interleaved_1f1b" or t.pipeline_repeats > 1,
         "train.pipeline_schedule=interleaved_1f1b needs train.pipeline_repeats > 1; set it or use 1f1b"),
        (t.pipeline_schedule != "1f1b" or t.pipeline_repeats == 1,
         "train.pipeline_schedule=1f1b runs one repeat; use interleaved_1f1b with train.pipeline_repeats > 1"),
        (t.pipeline_schedule != "interleaved_1f1b" or t.microbatches % max(stage, 1) == 0,
         f"train.pipeline_schedule=interleaved_1f1b needs train.microbatches divisible by mesh.stage={stage}"),
        (L % (stage * t.pipeline_repeats) == 0,
         f"{split} is not divisible by mesh.stage x train.pipeline_repeats = {stage} x {t.pipeline_repeats} "
         f"(remainder {L % (stage * t.pipeline_repeats)}); choose them so that their product divides {L}"),
        (stage == 1 or t.microbatches >= stage,
         f"train.microbatches={t.microbatches} is less than mesh.stage={stage}: the pipeline needs at least "
         f"one microbatch per stage; set train.microbatches >= {stage}"),
        (stage > 1 or t.pipeline_repeats == 1,
         f"train.pipeline_repeats={t.pipeline_repeats} repeats pipeline stages, but mesh.stage=1; set mesh.stage > 1 "
         "or train.pipeline_repeats=1"),
        (stage == 1 or ops <= PIPELINE_OPS,
         f"mesh.stage x train.microbatches x train.pipeline_repeats = {stage} x {t.microbatches} x "
         f"{t.pipeline_repeats} = {ops} pipeline ops, more than the {PIPELINE_OPS} a schedule table holds (built on "
         "the host at start); use fewer microbatches or repeats"),
    ]


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    """A warning logged once per process (validate runs more than once per start: the setup, the memory check)."""
    log.warning(message)


def _model_checks(cfg: Config, mc: ModelConfig, model: int) -> list[tuple[bool, str]]:
    """(ok, message) of the model's shapes against one another and against mesh.model."""
    kv = mc.n_kv_heads
    return [
        (cfg.model.head_dim is not None or mc.d_model % mc.n_heads == 0, f"model.d_model={mc.d_model} is not a "
         f"multiple of model.n_heads={mc.n_heads}; change one or set model.head_dim"),
        (mc.head_dim > 0 and mc.head_dim % 2 == 0, f"model.head_dim={mc.head_dim} must be even and > 0 (RoPE rotates "
         "pairs); change it (or d_model, n_heads)"),
        (mc.n_heads % kv == 0,
         f"model.n_heads={mc.n_heads} is not divisible by model.n_kv_heads={kv}; pick n_kv_heads dividing n_heads"),
        *family(mc.family).checks(mc),
        *[(v % model == 0, not_divisible(name, v, model, not cfg.model.init_from)) for name, v in split_widths(mc)],
        # fewer kv heads than model ranks: each kv head is replicated over the ranks that share it
        (kv % model == 0 or model % kv == 0,
         f"model.n_kv_heads={kv} and mesh.model={model} must divide one another (kv heads are split over "
         f"model, or each replicated over model/n_kv_heads ranks); use a mesh.model that divides {kv} or "
         f"is a multiple of it, or change model.n_kv_heads"),
    ]
