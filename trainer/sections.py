"""The config schema: every key once, with its default, allowed values and meaning (`key`, trainer/schema.py).
A new key is one line here; `load_config` checks it, `meshtrain train --help` and docs/config.md list it."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from trainer.hardware import ALIASES as DEVICE_ALIASES, DEVICES
from trainer.model_section import ModelSection
from trainer.schema import Form, key, step_range

GRAD_SYNC = ("auto", "psum", "ring", "ring_bf16")
SYNC_MODES = ("every_step", "local_sgd", "diloco")
OPTIMIZERS = ("adamw", "sgd")
DTYPES = ("float32", "bfloat16")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # train.pipeline_schedule (tables: trainer/parallel/schedules.py)
ON_NAN = ("skip", "rollback", "stop")  # train.on_nan (trainer/guard.py)
ON_UNREADABLE = ("stop", "fresh")  # checkpoint.on_unreadable (trainer/ckpt/checkpoint.py)
BIN_DTYPES = ("uint16", "uint32")
CLUSTERS = ("auto", "none", "slurm", "ompi", "gcetpu", "gketpu", "mpi4py")  # trainer/run/distributed.py
STRAGGLERS = ("none", "lognormal", "slow")  # trainer/plan/simulate.py
HARDWARE = (*DEVICES, "cpu", *DEVICE_ALIASES)  # trainer/hardware.py's rows and their short names
SEED = ">= 0 and <= 4294967295"
AXIS = "-1 (the rest) or >= 1"
STEPS = Form("A:B (1 <= A <= B), or '' (none)", step_range)
STEP_OR_STEPS = Form("STEP or A:B, or '' (none)", lambda v, k: step_range(v, k, single=True))


@dataclasses.dataclass(frozen=True)
class MeshSection:
    preset: Optional[str] = key(None, None, "a file of meshes/presets/, applied before every other file and key")
    data: int = key(-1, AXIS, "devices the batch (and ZeRO's state) is split over; -1: the devices left")
    stage: int = key(1, AXIS, "pipeline stages, each holding n_layers / stage layers")
    model: int = key(1, AXIS, "tensor-parallel ranks splitting heads, MLP units and vocabulary")
    dcn_data: int = key(1, ">= 1", "hosts/slices `data` is split over (hybrid mesh: `model` stays inside a host)")
    dcn_stage: int = key(1, ">= 1", "hosts/slices `stage` is split over")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    steps: int = key(200, ">= 1", "optimizer steps of the run (resuming runs up to this step)")
    batch_size: int = key(32, "> 0", "global sequences per step, over every device and microbatch")
    microbatches: int = key(1, ">= 1", "gradient accumulation / pipeline microbatches per step")
    zero_stage: int = key(0, ">= 0 and <= 3", "ZeRO: 1 shards optimizer state, 2 also gradients, 3 also parameters")
    grad_sync: str = key("auto", GRAD_SYNC, "gradient reduction: compiler-inserted, psum, or a ring of ppermutes")
    pipeline_repeats: int = key(1, ">= 1", "V: circular pipeline schedule when > 1 (needs mesh.stage > 1)")
    pipeline_schedule: str = key("gpipe", SCHEDULES, "pipeline schedule (trainer/parallel/schedules.py)")
    seed: int = key(0, SEED, "parameter initialisation and the data order")
    # The small model's 200-step default run, batch 32, eval loss by lr / warmup (scripts/labs/local_sgd.py --modes
    # every_step): 1.5e-3/60 1.5465, 1e-3/60 1.5659, 3e-3/60 1.5778, 6e-3/60 1.7517, 3e-3/100 1.5654, 1.5e-3/20
    # 1.5799, 3e-3/20 1.7504.
    lr: float = key(1.5e-3, "> 0", "peak learning rate: linear warmup to it, cosine decay to lr x min_lr_ratio")
    warmup_steps: int = key(60, ">= 0", "steps of linear warmup from 0 (at most steps - 1)")
    min_lr_ratio: float = key(0.1, ">= 0 and <= 1", "the learning rate at the end, as a fraction of lr")
    weight_decay: float = key(0.1, ">= 0", "decoupled weight decay of the parameters that declare it")
    b1: float = key(0.9, ">= 0 and < 1", "AdamW's first-moment decay; sgd: the momentum (0: none)")
    b2: float = key(0.95, ">= 0 and < 1", "AdamW's second-moment decay")
    grad_clip: float = key(1.0, ">= 0", "clip the gradients' global norm to this; 0: off")
    optimizer: str = key("adamw", OPTIMIZERS, "adamw, or sgd (momentum b1; linear in the gradient)")
    sync: str = key("every_step", SYNC_MODES, "replicas synced every step, or local SGD / DiLoCo (docs/local_sgd.md)")
    sync_every: int = key(1, ">= 1", "H: optimizer steps each replica takes on its own between syncs")
    sync_warmup: int = key(0, ">= 0", "local_sgd/diloco: average the replicas after every step up to this step")
    outer_lr: float = key(0.7, "> 0", "diloco: the Nesterov outer step on the replicas' mean parameter change")
    outer_momentum: float = key(0.9, ">= 0 and < 1", "diloco: the outer step's momentum")
    dtype: Optional[str] = key(None, DTYPES, "compute dtype; null: bfloat16 on GPU/TPU, float32 on CPU")
    eval_every: int = key(50, ">= 0", "steps between held-out evaluations (and after the last); 0: none")
    eval_batches: int = key(8, ">= 1", "held-out batches per evaluation")
    profile_steps: str = key("", STEPS, "a jax.profiler trace of steps A..B (as numbered in the log)")
    on_nan: str = key("skip", ON_NAN, "what a streak of max_bad_steps bad steps gets (trainer/guard.py)")
    max_bad_steps: int = key(5, ">= 1", "consecutive bad steps (non-finite loss or gradient norm, a spike) "
                             "before on_nan acts")
    spike_factor: float = key(0.0, "0 (off) or > 1", "skip a step whose loss > factor x the running median")
    spike_window: int = key(32, ">= 1", "losses in that running median")
    inject_nan_at: str = key("", STEP_OR_STEPS, "NaN loss at those data positions (drills and tests)")
    step_timeout_s: float = key(300.0, ">= 0", "a step running past max(this, 20 x the median) exits 4 "
                                "(trainer/run/watchdog.py); 0: off")
    memory_check: bool = key(True, None, "stop before compiling when the plan does not fit the device's memory")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = key(0, ">= 0", "steps between checkpoints; 0: only at the end (and on preemption)")
    keep: int = key(3, ">= 0", "newest checkpoints kept; 0: all")
    keep_every: int = key(0, ">= 0", "also keep for good every checkpoint whose step is a multiple of this; 0: none")
    on_unreadable: str = key("stop", ON_UNREADABLE, "when run.dir has checkpoints and none restores: stop, or "
                             "fresh (move them aside, start at step 0)")


@dataclasses.dataclass(frozen=True)
class RunSection:
    dir: str = key("runs/default", None, "where the run writes everything (resumes from its checkpoints)")
    log_every: int = key(10, "> 0", "steps between metrics lines (1: every step)")
    progress: bool = key(True, None, "a progress bar on the console")
    plugins: List[str] = key([], None, "extra loop plug-ins, module:Class (trainer/run/plugin.py)")


@dataclasses.dataclass(frozen=True)
class DataSection:
    source: str = key("builtin", None, "builtin | synthetic | a text file, folder, or token .bin (docs/data.md)")
    heldout_fraction: float = key(0.05, ">= 0 and < 1", "share of the tokens held out for evaluation where the "
                                  "source has no held-out part")
    bin_dtype: str = key("uint16", BIN_DTYPES, "a token .bin's element type (a prepared .bin's sidecar sets it)")
    tokenizer: Optional[str] = key(None, None, "tokenizer.json of a .bin's tokens; filled from its sidecar")
    # unset: false, or true where the data has a loss mask (conversations), which only trains with it
    document_mask: Optional[bool] = key(None, None, "attention inside each document, positions per document; "
                                        "null: true where the data has a loss mask")


@dataclasses.dataclass(frozen=True)
class DistSection:
    """Joining a multi-process run (trainer/run/distributed.py); one process needs none of it."""
    coordinator: Optional[str] = key(None, None, "HOST:PORT of process 0; with num_processes and process_id")
    num_processes: Optional[int] = key(None, ">= 1", "processes of the run")
    process_id: Optional[int] = key(None, ">= 0", "this process's index, 0..num_processes-1")
    cluster: str = key("auto", CLUSTERS, "how to find the other processes (auto: SLURM, Open MPI, TPU pods)")
    timeout_s: int = key(300, "> 0", "seconds to wait for every process to join")
    heartbeat_s: int = key(100, "> 0", "seconds of silence after which a process counts as dead")


@dataclasses.dataclass(frozen=True)
class SimSection:
    """The machine `meshtrain simulate` models (trainer/plan/simulate.py); training ignores it."""
    hardware: str = key("h100", HARDWARE, "a device of trainer/hardware.py: peak, links, latencies")
    devices: Optional[int] = key(None, ">= 1", "cluster size when a mesh axis is -1")
    devices_per_node: Optional[int] = key(None, ">= 1", "override; on TPU the chips of one ICI slice")
    intra_bw: Optional[float] = key(None, "> 0", "override: GB/s a device sends inside a node")
    inter_bw: Optional[float] = key(None, "> 0", "override: GB/s a device sends between nodes")
    efficiency: float = key(0.75, "> 0 and <= 1", "fraction of peak the kernels reach with no communication")
    overlap: float = key(0.0, ">= 0 and <= 1", "fraction of compute time that hides data-axis communication")
    straggler: str = key("lognormal", STRAGGLERS, "the distribution of per-device slowdowns")
    sigma: float = key(0.02, ">= 0", "lognormal: compute time x exp(sigma z) per device and step")
    slow_fraction: float = key(0.001, ">= 0 and <= 1", "slow: share of (device, step) pairs slow_factor x slower")
    slow_factor: float = key(2.0, ">= 1", "slow: how much slower")
    steps: int = key(64, ">= 1", "simulated steps per cluster size")
    max_devices: int = key(16384, ">= 1", "the largest cluster simulated")
    seed: int = key(0, SEED, "the stragglers' random draws")
    plot: Optional[str] = key(None, None, "the plot's path; null: run.dir/simulate.png")


@dataclasses.dataclass(frozen=True)
class PlanSection:
    """The device `meshtrain plan` plans for (trainer/hardware.py); training ignores it."""
    device: str = key("auto", ("auto", *HARDWARE), "the device planned for; auto: this machine's")
    hbm_gb: Optional[float] = key(None, "> 0", "override the device's memory, in GB")


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


# The names other trainers (MaxText, torchtitan, Hugging Face, nanoGPT) give these keys, for "did you mean".
ALIASES = {
    "learning_rate": "train.lr", "lr_warmup_steps": "train.warmup_steps", "warmup": "train.warmup_steps",
    "warmup_iters": "train.warmup_steps", "max_steps": "train.steps", "max_iters": "train.steps",
    "training_steps": "train.steps", "global_batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.microbatches", "max_grad_norm": "train.grad_clip",
    "gradient_clipping_threshold": "train.grad_clip", "adam_b1": "train.b1", "adam_b2": "train.b2",
    "adam_beta1": "train.b1", "adam_beta2": "train.b2", "max_target_length": "model.seq_len",
    "seq_length": "model.seq_len", "max_seq_len": "model.seq_len", "block_size": "model.seq_len",
    "hidden_size": "model.d_model", "emb_dim": "model.d_model", "n_embd": "model.d_model",
    "num_hidden_layers": "model.n_layers", "num_decoder_layers": "model.n_layers", "n_layer": "model.n_layers",
    "num_attention_heads": "model.n_heads", "num_query_heads": "model.n_heads", "n_head": "model.n_heads",
    "num_key_value_heads": "model.n_kv_heads", "num_kv_heads": "model.n_kv_heads",
    "intermediate_size": "model.d_ff", "mlp_dim": "model.d_ff", "remat_policy": "model.remat",
    "output_dir": "run.dir", "base_output_directory": "run.dir", "checkpoint_period": "checkpoint.every",
    "save_steps": "checkpoint.every", "log_period": "run.log_every", "logging_steps": "run.log_every",
    "eval_interval": "train.eval_every", "eval_iters": "train.eval_batches", "tokenizer_path": "data.tokenizer",
    "ici_data_parallelism": "mesh.data", "ici_tensor_parallelism": "mesh.model",
    "ici_pipeline_parallelism": "mesh.stage", "tensor_parallel_degree": "mesh.model",
    "pipeline_parallel_degree": "mesh.stage",
}
