"""The config schema: every key once, with its default, allowed values and meaning (`setting`, trainer/config/schema.py).
A new key is one line here; `load_config` checks it, `meshtrain train --help` and docs/config.md list it."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from meshes import AXES, Axis
from trainer.hardware import ALIASES as DEVICE_ALIASES, DEVICES
from trainer.config.model_section import ModelSection
from trainer.config.schema import FLOAT32, INT32, INT64, POSITIVE, Form, setting, step_range
from trainer.config.mixture_entries import parse_entries, parse_schedule

GRAD_SYNC = ("auto", "psum", "ring", "ring_bf16")
SYNC_MODES = ("every_step", "local_sgd", "diloco")
OPTIMIZERS = ("adamw", "sgd")
DTYPES = ("float32", "bfloat16")
CONTEXT_ATTENTION = ("all_gather", "all_to_all", "ring")  # train.context_attention (models/context_parallel/gather.py STRATEGIES)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # train.pipeline_schedule (tables: trainer/parallel/schedules.py)
ON_NAN = ("skip", "rollback", "stop")  # train.on_nan (trainer/guard.py)
ON_UNREADABLE = ("stop", "fresh")  # checkpoint.on_unreadable (trainer/ckpt/checkpoint.py)
BIN_DTYPES = ("uint16", "uint32")
OBJECTIVES = ("lm", "dpo", "grpo")
GRPO_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo")  # models/objectives/grpo.py LOSS_TYPES
GRPO_SCALES = ("group", "batch", "none")
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")  # models/objectives/dpo.py LOSSES
REFERENCE_MODES = ("precompute", "online")
# dist.cluster: auto, none, or one of jax.distributed's cluster_detection_method names; trainer/run/distributed.py
# takes its names from here (detect() returns one of them)
CLUSTERS = ("auto", "none", "slurm", "ompi", "gcetpu", "gketpu", "mpi4py")
STRAGGLERS = ("none", "lognormal", "slow")  # trainer/plan/simulate.py
HARDWARE = (*DEVICES, "cpu", *DEVICE_ALIASES)  # trainer/hardware.py's rows and their short names
SEED = ">= 0 and <= 2**32-1"
AXIS = f"-1 (the rest) or >= 1 and <= {INT32}"
SIZE = f">= 1 and <= {INT32}"  # a count of devices, rows, processes, batches
STEP = f">= 1 and <= {INT64}"  # a number of steps
EVERY = f">= 0 and <= {INT64}"  # steps between events (0: none)
NON_NEGATIVE = f">= 0 and <= {FLOAT32}"  # a float a step computes with
STEPS = Form("A:B (1 <= A <= B), or '' (none)", step_range)
MIXTURE = Form("[NAME:]SOURCE=WEIGHT entries, weights >= 0 and not all 0, names unique",
               lambda v, k: parse_entries(v, k))
MIXTURE_SCHEDULE = Form("STEP:NAME=WEIGHT entries", lambda v, k: parse_schedule(v, None, k))
STEP_OR_STEPS = Form("STEP or A:B, or '' (none)", lambda v, k: step_range(v, k, single=True))


def mesh_section(axes: tuple[Axis, ...] = AXES) -> type:
    """The mesh section of a list of mesh axes (meshes/axes.py), in mesh order: `mesh.NAME` per axis, then
    `mesh.dcn_NAME` per axis that may span hosts; the class keeps `axes` for meshes.shape_of."""
    keys = [("preset", Optional[str], setting(None, None, "a file of meshes/presets/, applied before every other "
                                                        "file and key"))]
    keys += [(a.name, int, setting(a.default, AXIS, a.doc)) for a in axes]
    keys += [(a.dcn_key, int, setting(1, SIZE, a.dcn)) for a in axes if a.dcn]
    return dataclasses.make_dataclass("MeshSection", keys, frozen=True,
                                      namespace={"axes": axes, "__module__": __name__})


MeshSection = mesh_section()


@dataclasses.dataclass(frozen=True)
class TrainSection:
    steps: int = setting(200, STEP, "optimizer steps of the run (resuming runs up to this step)")
    batch_size: int = setting(32, SIZE, "global sequences per step, over every device and microbatch")
    microbatches: int = setting(1, SIZE, "gradient accumulation / pipeline microbatches per step")
    zero_stage: int = setting(0, ">= 0 and <= 3", "ZeRO: 1 shards optimizer state, 2 also gradients, 3 also "
                              "parameters")
    grad_sync: str = setting("auto", GRAD_SYNC, "gradient reduction: compiler-inserted, psum, or a ring of ppermutes")
    expert_parallel: Optional[bool] = setting(None, None, "an MoE's experts split over mesh.data, tokens sent to them "
                                              "(docs/parallelism.md); null: on when n_experts > 1 is divisible by "
                                              "mesh.data > 1 and train.sync=every_step")
    sequence_parallel: bool = setting(False, None, "under tensor parallelism (mesh.model > 1): the residual stream "
                                      "(each layer's input and output, its norms) split over `model` along the "
                                      "sequence, each layer's all-reduces a reduce-scatter + all-gather, the "
                                      "gathered input recomputed in the backward (docs/parallelism.md)")
    context_attention: str = setting("all_gather", CONTEXT_ATTENTION, "under context parallelism (mesh.context > 1): "
                                     "how attention sees the keys of other ranks (all_gather: each layer's K/V "
                                     "gathered over context; all_to_all: whole rows of a group of heads per rank, "
                                     "Ulysses; ring: K/V blocks passed rank to rank; docs/parallelism.md)")
    context_load_balance: bool = setting(True, None, "under context parallelism: rank i holds chunks i and 2C-1-i of "
                                         "each sequence (every rank attends as many keys); needs seq_len divisible "
                                         "by 2 x mesh.context")
    pipeline_repeats: int = setting(1, SIZE, "V: circular pipeline schedule when > 1 (needs mesh.stage > 1)")
    pipeline_schedule: str = setting("gpipe", SCHEDULES, "pipeline schedule (trainer/parallel/schedules.py)")
    seed: int = setting(0, SEED, "parameter initialisation and the data order")
    # The small model's 200-step default run, batch 32, eval loss by lr / warmup (scripts/labs/local_sgd.py --modes
    # every_step): 1.5e-3/60 1.5465, 1e-3/60 1.5659, 3e-3/60 1.5778, 6e-3/60 1.7517, 3e-3/100 1.5654, 1.5e-3/20
    # 1.5799, 3e-3/20 1.7504.
    lr: float = setting(1.5e-3, NON_NEGATIVE, "peak learning rate: linear warmup to it, cosine decay to lr x "
                        "min_lr_ratio; 0: the weights stay as they are (an evaluation or a data check)")
    warmup_steps: int = setting(60, EVERY, "steps of linear warmup from 0 (at most steps - 1)")
    min_lr_ratio: float = setting(0.1, ">= 0 and <= 1", "the learning rate at the end, as a fraction of lr")
    weight_decay: float = setting(0.1, NON_NEGATIVE, "decoupled weight decay of the parameters that declare it")
    b1: float = setting(0.9, ">= 0 and < 1", "AdamW's first-moment decay; sgd: the momentum (0: none)")
    b2: float = setting(0.95, ">= 0 and < 1", "AdamW's second-moment decay")
    grad_clip: float = setting(1.0, NON_NEGATIVE, "clip the gradients' global norm to this; 0: off")
    optimizer: str = setting("adamw", OPTIMIZERS, "adamw, or sgd (momentum b1; linear in the gradient)")
    objective: str = setting("lm", OBJECTIVES, "lm: the next-token loss; dpo: preference pairs (dpo.*, docs/dpo.md); grpo: "
                        "rewards of sampled completions (grpo.*)")
    sync: str = setting("every_step", SYNC_MODES, "replicas synced every step, or local SGD / DiLoCo "
                        "(docs/local_sgd.md)")
    sync_every: int = setting(1, STEP, "H: optimizer steps each replica takes on its own between syncs")
    sync_warmup: int = setting(0, EVERY, "local_sgd/diloco: average the replicas after every step up to this step")
    outer_lr: float = setting(0.7, POSITIVE, "diloco: the Nesterov outer step on the replicas' mean parameter change")
    outer_momentum: float = setting(0.9, ">= 0 and < 1", "diloco: the outer step's momentum")
    dtype: Optional[str] = setting(None, DTYPES, "compute dtype; null: bfloat16 on GPU/TPU, float32 on CPU")
    eval_every: int = setting(50, EVERY, "steps between held-out evaluations (and after the last); 0: none")
    eval_batches: int = setting(8, SIZE, "held-out batches per evaluation")
    profile_steps: str = setting("", STEPS, "a jax.profiler trace of steps A..B (as numbered in the log)")
    on_nan: str = setting("skip", ON_NAN, "what a streak of max_bad_steps bad steps gets (trainer/guard.py)")
    max_bad_steps: int = setting(5, SIZE, "consecutive bad steps (non-finite loss or gradient norm, a spike) "
                                 "before on_nan acts")
    spike_factor: float = setting(0.0, f"0 (off) or > 1 and <= {FLOAT32}", "skip a step whose loss > factor x the "
                                  "running median")
    spike_window: int = setting(32, ">= 1 and <= 2**20", "losses in that running median (a device array)")
    inject_nan_at: str = setting("", STEP_OR_STEPS, "NaN loss at those data positions (drills and tests)")
    step_timeout_s: float = setting(300.0, ">= 0 and <= 1e9", "a step running past max(this, 20 x the median) exits "
                                    "4 (trainer/run/watchdog.py); 0: off; at most 1e9 (time.sleep's range)")
    memory_check: bool = setting(True, None, "stop, before any token, weight or checkpoint is read, when the plan or "
                                 "the compiled step does not fit the device's memory")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = setting(0, EVERY, "steps between checkpoints; 0: only at the end (and on preemption)")
    keep: int = setting(3, f">= 0 and <= {INT32}", "newest checkpoints kept; 0: all")
    keep_every: int = setting(0, EVERY, "also keep for good every checkpoint whose step is a multiple of this; "
                              "0: none")
    on_unreadable: str = setting("stop", ON_UNREADABLE, "when run.dir has checkpoints and none restores: stop, or "
                                 "fresh (move them aside, start at step 0)")


@dataclasses.dataclass(frozen=True)
class RunSection:
    dir: str = setting("runs/default", None, "where the run writes everything (resumes from its checkpoints)")
    log_every: int = setting(10, f"> 0 and <= {INT64}", "steps between metrics lines (1: every step)")
    progress: bool = setting(True, None, "a progress bar on the console")
    plugins: List[str] = setting([], None, "extra loop plug-ins, module:Class (trainer/run/plugin.py)")


@dataclasses.dataclass(frozen=True)
class DataSection:
    source: str = setting("builtin", None, "builtin | synthetic | a text file, folder, or token .bin (docs/data.md)")
    heldout_fraction: float = setting(0.05, ">= 0 and < 1", "share of the tokens held out for evaluation where the "
                                      "source has no held-out part")
    bin_dtype: str = setting("uint16", BIN_DTYPES, "a token .bin's element type (a prepared .bin's sidecar sets it)")
    tokenizer: Optional[str] = setting(None, None, "tokenizer.json of a .bin's tokens; filled from its sidecar")
    tokenizer_check: bool = setting(True, None, "stop, before anything compiles, when the data's tokenizer is not "
                                    "model.init_from's (another vocabulary, or bytes for a model with a tokenizer); "
                                    "false: train on it anyway")
    # unset: false, or true where the data has a loss mask (conversations), which only trains with it
    document_mask: Optional[bool] = setting(None, None, "attention inside each document, positions per document; "
                                            "null: true where the data has a loss mask")
    mixture: List[str] = setting([], MIXTURE, "sources mixed by weight instead of data.source, each row of a step "
                                 "drawn from one (docs/data.md); NAME (default: the file or folder name) in "
                                 "eval_loss/NAME and data.mixture_schedule")
    mixture_schedule: List[str] = setting([], MIXTURE_SCHEDULE, "weight changes: from step STEP on, source NAME's "
                                          "weight is WEIGHT")


@dataclasses.dataclass(frozen=True)
class DpoSection:
    """train.objective=dpo: Direct Preference Optimization and its variants, as TRL 1.16 defines them (models/objectives/dpo.py)."""
    beta: float = setting(0.1, f"> 0 and <= {FLOAT32}", "how far the policy may move from the reference (IPO: tau)")
    loss: str = setting("sigmoid", DPO_LOSSES, "sigmoid (DPO), ipo, hinge (SLiC) or robust (label noise)")
    label_smoothing: float = setting(0.0, ">= 0 and < 0.5", "robust: the assumed share of flipped labels")
    sft_weight: float = setting(0.0, NON_NEGATIVE, "weight of the chosen answers' mean token loss (TRL's sft term)")
    reference: Optional[str] = setting(None, None, "the frozen reference: an export, run or HF folder; null: "
                                       "model.init_from")
    reference_mode: str = setting("precompute", REFERENCE_MODES, "precompute: its log-probabilities once, stored "
                                  "beside the data; online: a forward of the reference every step")


@dataclasses.dataclass(frozen=True)
class GrpoSection:
    """train.objective=grpo: Group Relative Policy Optimization and its variants, as TRL 1.16 defines them
    (models/objectives/grpo.py)."""
    num_generations: int = setting(8, ">= 2 and <= 65536", "G: completions sampled per prompt (a group)")
    max_completion_length: int = setting(256, ">= 1 and <= 2**20", "the most tokens a completion has")
    temperature: float = setting(1.0, f"> 0 and <= {FLOAT32}", "sampling temperature; log-probabilities are taken "
                                 "at it")
    num_iterations: int = setting(1, ">= 1 and <= 1024", "optimizer steps on each batch of completions")
    loss_type: str = setting("dapo", GRPO_LOSSES, "grpo, dr_grpo, dapo (one mean over the step's tokens) or bnpo")
    beta: float = setting(0.0, f">= 0 and <= {FLOAT32}", "weight of the KL penalty to the reference (0: none)")
    epsilon: float = setting(0.2, "> 0 and < 1", "the ratio clipped below at 1 - epsilon")
    epsilon_high: Optional[float] = setting(None, f"> 0 and <= {FLOAT32}", "the ratio clipped above at 1 + this; "
                                            "null: epsilon")
    scale_rewards: str = setting("group", GRPO_SCALES, "advantages divided by the group's, the batch's or no "
                                 "reward standard deviation")
    mask_truncated_completions: bool = setting(False, None, "completions cut at max_completion_length count no token")
    reference: Optional[str] = setting(None, None, "beta > 0: the frozen reference (an export, run or HF folder); "
                                       "null: model.init_from")
    rewards: List[str] = setting([], None, "reward functions: exact_match:FIELD, regex:PATTERN, numeric:FIELD or an "
                                 "import path module:function (trainer/rl/rewards.py)")
    reward_weights: List[float] = setting([], None, "one weight per reward function (TRL's reward_weights); []: 1 "
                                          "each")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """lm-evaluation-harness tasks scored during training (trainer/run/benchmarks.py), as `meshtrain eval` scores a
    checkpoint (trainer/run/harness.py)."""
    harness_tasks: List[str] = setting([], None, "task names scored during training: meshtrain's own "
                                       "(meshtrain_mc, meshtrain_rolling, meshtrain_gen) or under eval.include_path")
    harness_every: int = setting(0, EVERY, "steps between harness evaluations (and after the last); 0: "
                                 "train.eval_every")
    include_path: List[str] = setting([], None, "folders of task YAML files (their data_files read beside them)")
    limit: Optional[float] = setting(None, f"> 0 and <= {FLOAT32}", "at most this many documents per task (a share "
                                     "if below 1); null: all")
    num_fewshot: Optional[int] = setting(None, f">= 0 and <= {INT32}", "few-shot examples; null: each task's own")


@dataclasses.dataclass(frozen=True)
class DistSection:
    """Joining a multi-process run (trainer/run/distributed.py); one process needs none of it."""
    coordinator: Optional[str] = setting(None, None, "HOST:PORT of process 0; with num_processes and process_id")
    num_processes: Optional[int] = setting(None, SIZE, "processes of the run")
    process_id: Optional[int] = setting(None, f">= 0 and <= {INT32}", "this process's index, 0..num_processes-1")
    cluster: str = setting("auto", CLUSTERS, "how to find the other processes (auto: SLURM, Open MPI, TPU pods)")
    timeout_s: int = setting(300, "> 0 and <= 2**30", "seconds to wait for every process to join (jax takes an "
                             "int32, this + 30)")
    heartbeat_s: int = setting(100, "> 0 and <= 2**30", "seconds of silence after which a process counts as dead")


@dataclasses.dataclass(frozen=True)
class SimSection:
    """The machine `meshtrain simulate` models (trainer/plan/simulate.py); training ignores it."""
    hardware: str = setting("h100", HARDWARE, "a device of trainer/hardware.py: peak, links, latencies")
    devices: Optional[int] = setting(None, SIZE, "cluster size when a mesh axis is -1")
    devices_per_node: Optional[int] = setting(None, SIZE, "override; on TPU the chips of one ICI slice")
    intra_bw: Optional[float] = setting(None, POSITIVE, "override: GB/s a device sends inside a node")
    inter_bw: Optional[float] = setting(None, POSITIVE, "override: GB/s a device sends between nodes")
    efficiency: float = setting(0.75, "> 0 and <= 1", "fraction of peak the kernels reach with no communication")
    overlap: float = setting(0.0, ">= 0 and <= 1", "fraction of compute time that hides data-axis communication")
    straggler: str = setting("lognormal", STRAGGLERS, "the distribution of per-device slowdowns")
    sigma: float = setting(0.02, ">= 0 and <= 100", "lognormal: compute time x exp(sigma z) per device and step "
                           "(exp(100 z) stays a float64)")
    slow_fraction: float = setting(0.001, ">= 0 and <= 1", "slow: share of (device, step) pairs slow_factor x slower")
    slow_factor: float = setting(2.0, f">= 1 and <= {FLOAT32}", "slow: how much slower")
    steps: int = setting(64, ">= 1 and <= 2**25", "simulated steps per cluster size (their straggler draws: "
                         "steps x devices, at most 2**25)")
    max_devices: int = setting(16384, ">= 1 and <= 2**25", "the largest cluster simulated")
    seed: int = setting(0, SEED, "the stragglers' random draws")
    plot: Optional[str] = setting(None, None, "the plot's path; null: run.dir/simulate.png")


@dataclasses.dataclass(frozen=True)
class PlanSection:
    """The device `meshtrain plan` plans for (trainer/hardware.py); training ignores it."""
    device: str = setting("auto", ("auto", *HARDWARE), "the device planned for; auto: this machine's")
    hbm_gb: Optional[float] = setting(None, POSITIVE, "override the device's memory, in GB")


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
    dpo: DpoSection = dataclasses.field(default_factory=DpoSection)
    grpo: GrpoSection = dataclasses.field(default_factory=GrpoSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)


# The names other trainers (MaxText, torchtitan, Megatron-LM, Hugging Face, nanoGPT) give these keys, for "did you
# mean"; only where the meaning is the same (Megatron's micro_batch_size is rows, not train.microbatches: absent).
ALIASES = {
    "dp": "mesh.data", "tp": "mesh.model", "pp": "mesh.stage", "wd": "train.weight_decay",
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
    # Megatron-LM
    "train_iters": "train.steps", "lr_warmup_iters": "train.warmup_steps", "clip_grad": "train.grad_clip",
    "num_layers": "model.n_layers", "ffn_hidden_size": "model.d_ff", "num_query_groups": "model.n_kv_heads",
    "tensor_model_parallel_size": "mesh.model", "pipeline_model_parallel_size": "mesh.stage",
    "save_interval": "checkpoint.every",
    "log_interval": "run.log_every", "rotary_base": "model.rope_theta", "norm_epsilon": "model.norm_eps",
    "recompute_granularity": "model.remat", "save": "run.dir",
    # MaxText
    "base_emb_dim": "model.d_model", "base_num_decoder_layers": "model.n_layers",
    "base_num_query_heads": "model.n_heads", "base_num_kv_heads": "model.n_kv_heads", "base_mlp_dim": "model.d_ff",
    "adam_weight_decay": "train.weight_decay", "dcn_data_parallelism": "mesh.dcn_data",
    "dcn_pipeline_parallelism": "mesh.dcn_stage", "num_pipeline_repeats": "train.pipeline_repeats",
    "num_pipeline_microbatches": "train.microbatches", "rope_max_timescale": "model.rope_theta",
    "normalization_layer_epsilon": "model.norm_eps", "logits_via_embedding": "model.tie_embeddings",
    "sliding_window_size": "model.window", "attn_logits_soft_cap": "model.attn_softcap",
    "final_logits_soft_cap": "model.final_softcap", "load_parameters_path": "model.init_from",
    "opt_type": "train.optimizer",
    # torchtitan
    "data_parallel_shard_degree": "mesh.data", "pipeline_parallel_schedule": "train.pipeline_schedule",
    "max_norm": "train.grad_clip", "interval": "checkpoint.every", "keep_latest_k": "checkpoint.keep",
    "log_freq": "run.log_every", "dump_folder": "run.dir", "dim": "model.d_model",
    # Hugging Face (transformers' config.json and Trainer) and nanoGPT
    "rms_norm_eps": "model.norm_eps", "tie_word_embeddings": "model.tie_embeddings", "sliding_window": "model.window",
    "attn_logit_softcapping": "model.attn_softcap", "final_logit_softcapping": "model.final_softcap",
    "query_pre_attn_scalar": "model.query_scale", "rope_local_base_freq": "model.rope_local_theta",
    "gradient_checkpointing": "model.remat", "save_total_limit": "checkpoint.keep", "eval_steps": "train.eval_every",
    "beta1": "train.b1", "beta2": "train.b2", "out_dir": "run.dir",
}
