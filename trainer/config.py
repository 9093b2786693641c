"""Typed config: dataclass schema (OmegaConf structured), YAML files and key=value overrides; later files and
overrides win. Unknown keys, wrong types and impossible layouts are UserErrors with one line naming the fix."""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
from pathlib import Path
from typing import List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from meshes import load_preset, resolve_shape, MeshError
from models import FAMILIES, PRESETS, REMAT_POLICIES, ModelConfig, from_preset
from models.config import ATTENTION_IMPLS, KERNELS
from trainer.errors import UserError
from trainer.model_section import ModelSection

GRAD_SYNC = ("auto", "psum", "ring", "ring_bf16")
SYNC_MODES = ("every_step", "local_sgd", "diloco")
OPTIMIZERS = ("adamw", "sgd")
DTYPES = ("float32", "bfloat16")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # train.pipeline_schedule (tables: trainer/parallel/schedules.py)
ON_NAN = ("skip", "rollback", "stop")  # train.on_nan (trainer/guard.py)


@dataclasses.dataclass(frozen=True)
class MeshSection:
    preset: Optional[str] = None  # a file in meshes/presets/, applied before everything else
    data: int = -1
    stage: int = 1
    model: int = 1
    dcn_data: int = 1  # split data over this many hosts/slices (hybrid mesh: model stays inside a host)
    dcn_stage: int = 1  # split stage over this many hosts/slices


@dataclasses.dataclass(frozen=True)
class TrainSection:
    steps: int = 200
    batch_size: int = 32  # global sequences per step
    microbatches: int = 1
    zero_stage: int = 0
    grad_sync: str = "auto"  # auto | psum | ring | ring_bf16
    pipeline_repeats: int = 1  # V: circular pipeline schedule when > 1 (needs mesh.stage > 1)
    pipeline_schedule: str = "gpipe"  # gpipe | 1f1b | interleaved_1f1b (trainer/parallel/schedules.py)
    seed: int = 0
    # The small model's 200-step default run, batch 32, eval loss by lr / warmup (scripts/labs/local_sgd.py --modes
    # every_step): 1.5e-3/60 1.5465, 1e-3/60 1.5659, 3e-3/60 1.5778, 6e-3/60 1.7517, 3e-3/100 1.5654, 1.5e-3/20
    # 1.5799, 3e-3/20 1.7504.
    lr: float = 1.5e-3
    warmup_steps: int = 60
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 = off
    optimizer: str = "adamw"  # adamw | sgd (momentum b1, linear in the gradient)
    sync: str = "every_step"  # every_step | local_sgd | diloco (trainer/parallel/localsgd.py)
    sync_every: int = 1  # H: optimizer steps each replica takes on its own between syncs
    sync_warmup: int = 0  # local_sgd/diloco: average the replicas after every step up to this step first
    outer_lr: float = 0.7  # diloco: Nesterov step on the replicas' mean parameter delta
    outer_momentum: float = 0.9
    dtype: Optional[str] = None  # float32 | bfloat16; default: bfloat16 on GPU/TPU, float32 on CPU
    eval_every: int = 50
    eval_batches: int = 8
    profile_steps: str = ""  # A:B: a jax.profiler trace of steps A..B (as numbered in the log)
    on_nan: str = "skip"  # skip | rollback | stop: what a streak of max_bad_steps bad steps gets (trainer/guard.py)
    max_bad_steps: int = 5  # consecutive bad steps (non-finite loss/grad norm, or a spike) before on_nan acts
    spike_factor: float = 0.0  # skip a step whose loss > factor x the running median; 0 = off
    spike_window: int = 32  # losses in that running median
    inject_nan_at: str = ""  # STEP or A:B: NaN loss at those data positions (drills and tests)
    step_timeout_s: float = 300.0  # a step running past max(this, 20 x median) exits 4 (trainer/run/watchdog.py); 0: off
    memory_check: bool = True  # stop before compiling when the plan does not fit (trainer/run/memory_check.py)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = 0  # steps; 0 = only at the end (and on preemption)
    keep: int = 3  # newest checkpoints kept; 0 = all
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this for good; 0 = none
    on_unreadable: str = "stop"  # stop | fresh: when run.dir has checkpoints and none can be restored


@dataclasses.dataclass(frozen=True)
class RunSection:
    dir: str = "runs/default"
    log_every: int = 10
    progress: bool = True
    plugins: List[str] = dataclasses.field(default_factory=list)  # extra loop plug-ins, module:Class (trainer/run/plugin.py)


@dataclasses.dataclass(frozen=True)
class DataSection:
    source: str = "builtin"  # builtin | synthetic | path to a text file, folder, or token .bin
    heldout_fraction: float = 0.05
    bin_dtype: str = "uint16"  # token .bin element type: uint16 | uint32
    tokenizer: Optional[str] = None  # tokenizer.json of a .bin's tokens; filled from its sidecar (docs/data.md)
    # attention inside each document, positions per document (docs/data.md); unset: false, or true where the data
    # has a loss mask (conversations), which only trains with it
    document_mask: Optional[bool] = None


@dataclasses.dataclass(frozen=True)
class DistSection:
    """Joining a multi-process run (trainer/run/distributed.py); one process needs none of it."""
    coordinator: Optional[str] = None  # HOST:PORT of process 0; with num_processes and process_id
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    cluster: str = "auto"  # auto (SLURM, Open MPI, TPU pods) | none | slurm | ompi | gcetpu | gketpu | mpi4py
    timeout_s: int = 300  # seconds to wait for every process to join
    heartbeat_s: int = 100  # a process silent this long counts as dead and the others stop


@dataclasses.dataclass(frozen=True)
class SimSection:
    """The machine `meshtrain simulate` models (trainer/plan/simulate.py); training ignores it."""
    hardware: str = "h100"  # a row of trainer/hardware.py (plan.device's names): peak, links, latencies
    devices: Optional[int] = None  # cluster size when a mesh axis is -1
    devices_per_node: Optional[int] = None  # override; on TPU the chips of one ICI slice
    intra_bw: Optional[float] = None  # override: GB/s a device sends inside a node
    inter_bw: Optional[float] = None  # override: GB/s a device sends between nodes
    efficiency: float = 0.75  # fraction of peak the kernels reach with no communication or waiting
    overlap: float = 0.0  # fraction of compute time that hides data-axis communication
    straggler: str = "lognormal"  # none | lognormal | slow
    sigma: float = 0.02  # lognormal: compute time x exp(sigma z) per device and step
    slow_fraction: float = 0.001  # slow: share of (device, step) pairs that are slow_factor x slower
    slow_factor: float = 2.0
    steps: int = 64  # simulated steps per cluster size
    max_devices: int = 16384
    seed: int = 0
    plot: Optional[str] = None  # default: run.dir/simulate.png


@dataclasses.dataclass(frozen=True)
class PlanSection:
    """The device `meshtrain plan` plans for (trainer/hardware.py); training ignores it."""
    device: str = "auto"  # auto (this machine's) | h100-80g | h200 | a100-80g | tpu-v5p | tpu-v5e | tpu-v4 | cpu
    hbm_gb: Optional[float] = None  # override the device's memory, in GB


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    run: RunSection = dataclasses.field(default_factory=RunSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    sim: SimSection = dataclasses.field(default_factory=SimSection)
    plan: PlanSection = dataclasses.field(default_factory=PlanSection)
    dist: DistSection = dataclasses.field(default_factory=DistSection)


def all_keys(node=Config, prefix="") -> list[str]:
    out = []
    for f in dataclasses.fields(node):
        t = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if t is not None and dataclasses.is_dataclass(t):
            out += all_keys(t, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def _closest(key: str) -> str:
    keys = all_keys()
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not near:  # try the last component alone, e.g. 'zero_stage' -> 'train.zero_stage'
        leaf = key.split(".")[-1]
        near = [k for k in keys if k.split(".")[-1] == leaf] or \
            [k for k in keys if k.split(".")[-1] in difflib.get_close_matches(leaf, [x.split(".")[-1] for x in keys], 1)]
    return f"did you mean '{near[0]}'?" if near else "see the keys in `meshtrain train --help`"


def _merge(base, other, where: str):
    try:
        return OmegaConf.merge(base, other)
    except ConfigKeyError as e:
        key = e.full_key or str(e)
        raise UserError(f"unknown config key '{key}' ({where}); {_closest(key)}") from None
    except ValidationError as e:
        msg = str(e).splitlines()[0]
        raise UserError(f"config key '{e.full_key}' ({where}): {msg}; give a value of the key's type") from None
    except OmegaConfBaseException as e:
        raise UserError(f"bad config ({where}): {str(e).splitlines()[0]}") from None


def _load_yaml(path: str):
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file '{path}' does not exist; give the path of a YAML file")
    try:
        node = OmegaConf.load(p)  # a yaml.SafeLoader: tags that would build Python objects are refused
    except Exception as e:  # yaml.YAMLError and friends
        first = str(e).splitlines()[0]
        if "could not determine a constructor" in first:
            raise UserError(f"config file '{path}': {first}; meshtrain reads plain YAML only (no Python tags), "
                            "remove the tag") from None
        raise UserError(f"config file '{path}' is not valid YAML: {first}") from None
    if not OmegaConf.is_dict(node):
        raise UserError(f"config file '{path}' must hold a mapping of sections (model:, train:, ...)")
    return node


def load_config(args: list[str] = (), base: dict | None = None) -> Config:
    """Config from the schema defaults, YAML files and key=value overrides, in order. Pure: what the
    config points at (a data sidecar, a Hugging Face folder) is read by trainer/sources.py."""
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
        # YAML 1.1 reads 5:8 as the base-60 integer 308; keep A:B values (profile_steps) as text
        dot = OmegaConf.from_dotlist([re.sub(r"=(\d+:\d+)$", r"='\1'", p) for p in pairs])
    except Exception as e:
        raise UserError(f"cannot parse overrides {pairs}: {str(e).splitlines()[0]}; write key=value") from None
    layers.append((dot, "command line"))
    cfg = OmegaConf.structured(Config)
    # A mesh preset goes first, so that explicit keys anywhere override it.
    preset = None
    for node, _ in layers:
        preset = OmegaConf.select(node, "mesh.preset", default=preset)
    if preset:
        try:
            path = load_preset(str(preset))
        except MeshError as e:
            raise UserError(str(e)) from None
        cfg = _merge(cfg, OmegaConf.load(path), f"mesh preset {preset}")
    for node, where in layers:
        cfg = _merge(cfg, node, where)
    return OmegaConf.to_object(cfg)


def step_range(spec, key: str, single: bool = False) -> tuple[int, int] | None:
    """The one parser of step ranges: 'A:B' (or, with `single`, also 'A') -> (A, B) with 1 <= A <= B;
    '' -> None; anything else a UserError naming `key` and the fix."""
    if spec in ("", None):
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(spec))
    if not m or not (single or m.group(2)) or not 1 <= int(m.group(1)) <= int(m.group(2) or m.group(1)):
        form, eg = ("STEP or A:B", "7") if single else ("A:B", "5:8")
        raise UserError(f"{key}='{spec}' is not {form} with 1 <= A <= B; write e.g. {key}={eg} "
                        f"(in YAML quote a range: '{'7:9' if single else '5:8'}')")
    return int(m.group(1)), int(m.group(2) or m.group(1))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def replace(cfg: Config, **sections) -> Config:
    """A copy of cfg with section fields replaced: replace(cfg, train=dict(steps=3))."""
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})


def model_config(cfg: Config) -> ModelConfig:
    m = cfg.model
    for key, known in (("preset", PRESETS), ("family", FAMILIES), ("remat", REMAT_POLICIES),
                       ("attention", ATTENTION_IMPLS), ("kernels", KERNELS)):
        if getattr(m, key) not in known and not (key == "family" and m.family is None):
            raise UserError(f"model.{key}='{getattr(m, key)}' is unknown; choose one of {', '.join(known)}")
    if m.loss_chunk is not None and m.loss_chunk < 0:
        raise UserError(f"model.loss_chunk={m.loss_chunk} must be >= 0 (tokens per chunk; 0 = whole logits) or null")
    over = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name not in ("preset", "init_from")}
    if m.rope_scaling is not None:  # hashable, the original context length an int
        if len(m.rope_scaling) != 4:
            raise UserError(f"model.rope_scaling={list(m.rope_scaling)} needs 4 numbers: factor, low_freq_factor, "
                            "high_freq_factor, original_max_position_embeddings")
        f, lo, hi, n = m.rope_scaling
        over["rope_scaling"] = (float(f), float(lo), float(hi), int(n))
    spec = FAMILIES[m.family or "llama"]
    neutral = {f.name: f.default for f in dataclasses.fields(ModelConfig)}  # a saved config holds every key
    for k in sorted({k for f in FAMILIES.values() for k in f.keys} - set(spec.keys)):
        if over.get(k) not in (None, neutral[k]):
            owners = ", ".join(sorted(f.name for f in FAMILIES.values() if k in f.keys))
            raise UserError(f"model.{k} is a key of {owners}, not of model.family='{spec.name}'; drop it or set "
                            "model.family")
    for k, v in spec.defaults.items():
        over[k] = v if over.get(k) is None else over[k]
    return from_preset(m.preset, **over, documents=bool(cfg.data.document_mask))


def compute_dtype(cfg: Config, platform: str) -> str:
    return cfg.train.dtype or ("float32" if platform == "cpu" else "bfloat16")


def validate(cfg: Config, n_devices: int) -> tuple[int, int, int]:
    """Check the config against the device count; return the resolved mesh shape."""
    t, mc = cfg.train, model_config(cfg)
    try:
        shape = resolve_shape(cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model, n_devices)
    except MeshError as e:
        raise UserError(str(e)) from None
    data, stage, model = shape
    checks = [
        (t.zero_stage in (0, 1, 2, 3), f"train.zero_stage={t.zero_stage} is outside 0..3; use 0, 1, 2 or 3"),
        (t.grad_sync in GRAD_SYNC, f"train.grad_sync='{t.grad_sync}' is unknown; choose one of {', '.join(GRAD_SYNC)}"),
        (t.dtype in (None,) + DTYPES, f"train.dtype='{t.dtype}' is unknown; choose float32 or bfloat16"),
        (t.steps >= 0 and t.batch_size > 0 and t.microbatches > 0,
         "train.steps must be >= 0 and train.batch_size, train.microbatches > 0; fix the value"),
        (cfg.run.log_every > 0, f"run.log_every={cfg.run.log_every} must be > 0; use 1 or more"),
        (mc.window is None or mc.window > 0, f"model.window={mc.window} must be > 0 (positions) or null (no window)"),
        (cfg.model.head_dim is not None or mc.d_model % mc.n_heads == 0, f"model.d_model={mc.d_model} is not a "
         f"multiple of model.n_heads={mc.n_heads}; change one or set model.head_dim"),
        (mc.head_dim > 0 and mc.head_dim % 2 == 0, f"model.head_dim={mc.head_dim} must be even and > 0 (RoPE rotates "
         "pairs); change it (or d_model, n_heads)"),
        (mc.n_heads % mc.n_kv_heads == 0,
         f"model.n_heads={mc.n_heads} is not divisible by model.n_kv_heads={mc.n_kv_heads}; pick n_kv_heads dividing n_heads"),
    ]
    checks += [(v % model == 0, f"model.{name}={v} is not divisible by mesh.model={model}; pick a mesh.model that "
                f"divides {v} or change model.{name}") for name, v in (("n_heads", mc.n_heads), ("d_ff", mc.d_ff),
                                                                     ("vocab_size", mc.vocab_size))]
    # fewer kv heads than model ranks: each kv head is replicated over the ranks that share it
    kv = mc.n_kv_heads
    checks.append((kv % model == 0 or model % kv == 0,
                   f"model.n_kv_heads={kv} and mesh.model={model} must divide one another (kv heads are split over "
                   f"model, or each replicated over model/n_kv_heads ranks); use a mesh.model that divides {kv} or "
                   f"is a multiple of it, or change model.n_kv_heads"))
    checks += [
        (t.batch_size % (data * t.microbatches) == 0,
         f"train.batch_size={t.batch_size} is not divisible by mesh.data x train.microbatches = "
         f"{data} x {t.microbatches} (each microbatch of batch_size/microbatches rows is split over "
         f"mesh.data); use a multiple of {data * t.microbatches}"),
        (mc.n_layers % stage == 0, f"model.n_layers={mc.n_layers} is not divisible by mesh.stage={stage}; "
                                   f"use a mesh.stage that divides {mc.n_layers}"),
        (t.pipeline_repeats >= 1, f"train.pipeline_repeats={t.pipeline_repeats} must be >= 1"),
        (t.pipeline_schedule in SCHEDULES, f"train.pipeline_schedule='{t.pipeline_schedule}' is "
                                           f"unknown; choose one of {', '.join(SCHEDULES)}"),
        (t.pipeline_schedule != "interleaved_1f1b" or t.pipeline_repeats > 1,
         "train.pipeline_schedule=interleaved_1f1b needs train.pipeline_repeats > 1; set it or use 1f1b"),
        (t.pipeline_schedule != "1f1b" or t.pipeline_repeats == 1,
         "train.pipeline_schedule=1f1b runs one repeat; use interleaved_1f1b with train.pipeline_repeats > 1"),
        (t.pipeline_schedule != "interleaved_1f1b" or t.microbatches % max(stage, 1) == 0,
         f"train.pipeline_schedule=interleaved_1f1b needs train.microbatches divisible by mesh.stage={stage}"),
        (cfg.mesh.dcn_data >= 1 and data % cfg.mesh.dcn_data == 0,
         f"mesh.dcn_data={cfg.mesh.dcn_data} does not divide mesh.data={data}; use a divisor of {data} (hosts per replica group)"),
        (cfg.mesh.dcn_stage >= 1 and stage % cfg.mesh.dcn_stage == 0,
         f"mesh.dcn_stage={cfg.mesh.dcn_stage} does not divide mesh.stage={stage}; use a divisor of {stage}"),
        (mc.n_layers % (stage * t.pipeline_repeats) == 0,
         f"model.n_layers={mc.n_layers} is not divisible by mesh.stage x train.pipeline_repeats = "
         f"{stage} x {t.pipeline_repeats}; choose them so that their product divides n_layers"),
        (stage == 1 or t.microbatches >= stage,
         f"train.microbatches={t.microbatches} is less than mesh.stage={stage}: the pipeline needs at least "
         f"one microbatch per stage; set train.microbatches >= {stage}"),
        (t.optimizer in OPTIMIZERS, f"train.optimizer='{t.optimizer}' is unknown; choose adamw or sgd"),
        (t.sync in SYNC_MODES, f"train.sync='{t.sync}' is unknown; choose one of {', '.join(SYNC_MODES)}"),
        (t.step_timeout_s >= 0, f"train.step_timeout_s={t.step_timeout_s} must be >= 0 (seconds; 0 = no step watchdog)"),
        (t.sync_every >= 1, f"train.sync_every={t.sync_every} must be >= 1 (optimizer steps between syncs)"),
        (t.sync_warmup >= 0, f"train.sync_warmup={t.sync_warmup} must be >= 0 (steps synced every step first)"),
        (t.sync == "every_step" or (t.zero_stage == 0 and stage == 1),
         f"train.sync={t.sync} keeps a whole replica on every data shard; set train.zero_stage=0 and mesh.stage=1"),
        (math.prod(shape) == n_devices, "mesh size mismatch"),
    ]
    step_range(t.profile_steps, "train.profile_steps")  # a UserError naming the fix if it is not A:B
    _validate_guard(t)
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    return shape


def _validate_guard(t):
    """UserError naming the key and the fix for a bad NaN/spike guard setting (trainer/guard.py)."""
    for ok, msg in (
            (t.on_nan in ON_NAN, f"train.on_nan='{t.on_nan}' is unknown; choose one of {', '.join(ON_NAN)}"),
            (t.max_bad_steps >= 1, f"train.max_bad_steps={t.max_bad_steps} must be >= 1 (consecutive bad steps "
                                   "before train.on_nan acts)"),
            (t.spike_factor == 0 or t.spike_factor > 1, f"train.spike_factor={t.spike_factor} must be 0 (off) or "
             "> 1 (skip a loss above factor x the running median); e.g. train.spike_factor=2"),
            (t.spike_window >= 1, f"train.spike_window={t.spike_window} must be >= 1 (losses in the running median)")):
        if not ok:
            raise UserError(msg)
    step_range(t.inject_nan_at, "train.inject_nan_at", single=True)
