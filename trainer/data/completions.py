"""A batch of GRPO's rows (models/objectives/grpo.py) from prompts and their sampled completions: row i holds prompt i
then completion i from position 0, padding after (causal attention: the padding changes nothing before it), so
that the learner needs neither document masks nor per-row positions. The target of a row's position p is its token
p + 1: completion token j of a prompt of P tokens is the target at P + j - 1, where its per-token values go (the
loss and metric weights, the old and the reference log-probabilities, the advantage, the completion mask); every
other target has weight 0."""
from __future__ import annotations

import numpy as np

from models.batch import from_windows
from models.objectives.grpo import FIELDS


def completion_targets(prompts: list, width: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(row index (N, width), target column (N, width)) of each completion position j < width: where its values go
    in the (N, seq_len) target layout (a column past the row clipped to its last; its weight is 0 there)."""
    starts = np.array([len(p) for p in prompts], np.int64)
    cols = np.minimum(starts[:, None] - 1 + np.arange(width)[None, :], seq_len - 1)
    return np.broadcast_to(np.arange(len(prompts))[:, None], cols.shape), cols


def rows(prompts: list, completions: np.ndarray, per_token: dict, seq_len: int, pad: int = 0) -> dict:
    """The batch {field: (N, seq_len)} of N prompts (lists of ids) and their completions (N, C) (padded after their
    end), with `per_token` {grpo field: (N, C) values of each completion position} scattered to the targets that
    predict them (0 elsewhere). A prompt plus its completion longer than seq_len + 1 is a ValueError."""
    completions = np.asarray(completions)
    N, C = completions.shape
    windows = np.full((N, seq_len + 1), pad, np.int32)
    for i, p in enumerate(prompts):
        if not len(p):
            raise ValueError(f"prompt {i} is empty: a completion needs at least one token before it")
        if len(p) + C > seq_len + 1:
            raise ValueError(f"prompt {i} ({len(p)} tokens) and its completion ({C}) exceed seq_len {seq_len} + 1")
        windows[i, :len(p)] = p
        windows[i, len(p):len(p) + C] = completions[i]
    r, c = completion_targets(prompts, C, seq_len)
    out = {}
    for k in ("loss_weight",) + FIELDS:
        a = np.zeros((N, seq_len), np.float32)
        a[r, c] = np.asarray(per_token[k], np.float32)
        out[k] = a
    batch = from_windows(windows, out.pop("loss_weight"))
    return {**batch, **out}


def gather_targets(values_NT: np.ndarray, prompts: list, width: int) -> np.ndarray:
    """The (N, width) per-completion-position values of a (N, seq_len) target layout (`rows`' inverse)."""
    r, c = completion_targets(prompts, width, values_NT.shape[1])
    return np.asarray(values_NT)[r, c]
