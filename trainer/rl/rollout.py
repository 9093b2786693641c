"""One GRPO generation: B prompts, G completions each drawn together by the current policy (models/sampler.py),
scored by the reward functions (trainer/rl/rewards.py), their advantages (models/objectives/grpo.py), and the
learner's rows (trainer/data/completions.py) with each token's weights, the old log-probabilities (the policy's own
forward before its first update, as TRL computes them without vLLM; the sampler's are kept only to report how far
they are) and, with beta > 0, the reference's. The batch serves grpo.num_iterations optimizer steps."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import numpy as np

from meshes import DATA, EXPERT, MODEL
from models.objectives import grpo
from models.sampler import sample_completions
from trainer.data.completions import gather_targets, rows
from trainer.rl import rewards as reward_fns

PER_TOKEN = ("loss_weight",) + grpo.FIELDS


@dataclasses.dataclass
class Settings:
    """What a generation needs besides the model: grpo.* and the sampler's keys, the step's microbatches, the tokens
    that end a completion and the padding id, the decoder of token ids to text (for the reward functions)."""
    G: int
    max_new: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    mask_truncated: bool = False
    microbatches: int = 1
    end_ids: tuple = ()
    pad: int = 0
    decode: Callable = lambda ids: " ".join(map(str, ids))  # noqa: E731
    dtype: object = np.float32  # the compute dtype of the sampler's forward and its KV cache (the run's)


def logps(c, params: dict, batch: dict, chunks: int = 1) -> np.ndarray:
    """Each target's log-probability at c.grpo.temperature (N, T): a forward of each of `chunks` consecutive row
    blocks in turn (the step's microbatches: its (N / chunks, T, V) logits are what one learning microbatch holds),
    jitted once per model and block shape."""
    N = batch["tokens"].shape[0]
    chunks = chunks if chunks > 0 and N % chunks == 0 else 1
    out, n = [], N // chunks
    for i in range(0, N, n):
        fields = {k: batch[k][i:i + n] for k in ("tokens", "segment_ids", "positions")}
        out.append(np.asarray(_logps_fn(c)(params, fields, batch["targets"][i:i + n])))
    return np.concatenate(out)


@functools.lru_cache(maxsize=8)
def _logps_fn(c):
    """token_logps of a batch's final hidden states, jitted once per model."""
    from models.objectives.objective import hidden

    def fn(p, fields, targets):  # one document per row: segment ids and positions as the learner's rows have them
        return grpo.token_logps(c, p, hidden(c, p, fields)[0], targets, lambda x, _: x)[0]
    return jax.jit(fn)


def placement(c, params: dict, N: int) -> tuple:
    """(rows, cache): where the rows' arrays and the KV cache go on the parameters' mesh: the rows split over its
    data (and expert) ranks where they divide N, the cache's kv heads over `model` where they divide; None for
    both without a mesh (one device, or parameters that are no NamedSharding)."""
    leaf = jax.tree.leaves(params)[0]
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    if not isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding) or mesh.size == 1:
        return None, None
    rows = tuple(a for a in (DATA, EXPERT) if mesh.shape.get(a, 1) > 1)
    n = int(np.prod([mesh.shape[a] for a in rows])) if rows else 1
    rows = rows if rows and N % n == 0 else None
    heads = MODEL if mesh.shape.get(MODEL, 1) > 1 and c.n_kv_heads % mesh.shape[MODEL] == 0 else None
    P = jax.sharding.PartitionSpec
    return (jax.sharding.NamedSharding(mesh, P(rows)),
            jax.sharding.NamedSharding(mesh, P(None, rows, None, heads, None)))


def compile_sampler(s, prompt: int, options: dict | None = None):
    """The sampler's cached step compiled for the setup's devices (a TPU topology ahead of time), abstract inputs
    laid out as a run lays them (`placement`): train.batch_size rows reading `prompt` tokens each (the prefill: the
    prompts' length; 1: one decode step) into a cache of the whole context, in the run's compute dtype."""
    from models.decode import init_cache
    from models.sampler import decode_step
    c, N = s.model, s.cfg.train.batch_size
    params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), s.shapes["params"],
                          s.shardings["params"])
    rows, spread = placement(c, params, N)
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=spread),
                         jax.eval_shape(lambda: init_cache(c, N, c.seq_len, s.dtype)))
    i32, f32 = jax.ShapeDtypeStruct((), np.int32), jax.ShapeDtypeStruct((), np.float32)
    args = (params, jax.ShapeDtypeStruct((N, prompt), np.int32, sharding=rows), i32, cache,
            jax.ShapeDtypeStruct((N,), np.int32, sharding=rows), jax.eval_shape(lambda: jax.random.key(0)),
            f32, i32, f32, i32)
    with jax.set_mesh(s.mesh):
        return decode_step(c, s.dtype).lower(*args).compile(options or {})


def generation(c, params: dict, records: list, functions: list, weights, st: Settings, key,
               reference: dict | None = None) -> tuple[dict, dict]:
    """(the learner's batch {field: (N, seq_len)}, the generation's metrics) of B records ({"prompt_ids": [...],
    "prompt": text or messages, other fields}), rows in groups of G consecutive completions."""
    prompts = [r["prompt_ids"] for r in records for _ in range(st.G)]
    got = sample_completions(c, params, prompts, st.max_new, key, temperature=st.temperature, top_k=st.top_k,
                             top_p=st.top_p, end_ids=st.end_ids, pad=st.pad,
                             placement=placement(c, params, len(prompts)), dtype=st.dtype)
    N, L = got["tokens"].shape
    ids = [list(got["tokens"][i, :got["lengths"][i]]) for i in range(N)]
    texts = [st.decode([t for t in x if t not in st.end_ids]) for x in ids]
    if isinstance(records[0].get("prompt"), list):  # a conversation's completion is the assistant's message, as TRL's
        texts = [[{"role": "assistant", "content": x}] for x in texts]
    names = sorted({k for r in records for k in r} - {"prompt_ids", "prompt"})
    fields = {k: [r.get(k) for r in records for _ in range(st.G)] for k in names}
    scored = reward_fns.score(functions, [r.get("prompt") for r in records for _ in range(st.G)], texts, ids, fields)
    adv, metrics = grpo.advantages(scored, weights if len(weights) else np.ones(len(functions)), st.G,
                                   st.scale_rewards)
    mask = (np.arange(L)[None, :] < got["lengths"][:, None]).astype(np.float32)
    if st.mask_truncated:
        mask *= got["ended"][:, None]
    w = grpo.token_weights(st.loss_type, mask, st.microbatches, c.grpo.max_completion_length)
    per = {"loss_weight": w["loss"], "metric_weight": w["metric"], "completion": mask,
           "advantage": np.broadcast_to(adv[:, None], mask.shape), "old_logp": np.zeros_like(mask),
           "ref_logp": np.zeros_like(mask)}
    batch = rows(prompts, got["tokens"], per, c.seq_len, st.pad)
    per["old_logp"] = gather_targets(logps(c, params, batch, st.microbatches), prompts, L)
    if reference is not None and c.grpo.beta:
        per["ref_logp"] = gather_targets(logps(c, reference, batch, st.microbatches), prompts, L)
    lengths = got["lengths"].astype(np.float64)
    done = lengths[got["ended"]] if got["ended"].any() else np.zeros(1)
    metrics.update(reward_fns.metrics([n for n, _ in functions], scored))
    metrics.update({"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                    "completions/max_length": lengths.max(),
                    "completions/clipped_ratio": float(1 - got["ended"].mean()),
                    "completions/mean_terminated_length": done.mean(), "completions/min_terminated_length": done.min(),
                    "completions/max_terminated_length": done.max(),
                    "sampling/logp_difference/max": float(np.abs((per["old_logp"] - got["logps"]) * mask).max()),
                    "tokens": int(sum(len(p) for p in prompts) + lengths.sum())})  # TRL's num_tokens adds these up
    return rows(prompts, got["tokens"], per, c.seq_len, st.pad), metrics
