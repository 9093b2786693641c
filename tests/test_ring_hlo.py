"""The ring's and the all-gather's compiled train steps, read from their HLO (8 simulated CPU devices, T = 2048 over
4 context ranks: blocks of T/C = 512 tokens, tiles of 128): no float32 array of a block's scores anywhere ((512, 512),
(512, 2048) or their transposes as the last two dimensions: the dense per-block scores the ring had were
f32[1,2,2,512,512]), and the dots in each ring step after the first, counted through the loops that run them (their
trip counts known to XLA), cover (T/C) x (T/2C) query-key pairs per head: balanced, both branches of every step's
conditional; unbalanced, one branch runs no dot (a block from a later rank) and the other the whole block. XLA's cost
analysis cannot show this: it counts a conditional's costliest branch and a loop body once. The all-gather's step
(its loops' bounds are the tiles' positions, unknown to XLA: its work per rank is timed by
scripts/bench/context_attention.py) holds no (T/C, T/C) or (T/C, T) block of scores either, nor one of a tile of
queries against the row, (128, 2048): the all-gather before flash_blocks.py had f32[1,4,2,128,2048]."""
import math
import re

import pytest
from conftest import SGD

T, C, TILE = 2048, 4, 128
t = T // C
RING = SGD + ["mesh.data=2", "mesh.context=4", "train.context_attention=ring", f"model.seq_len={T}",
              "train.batch_size=2", f"model.attention_block={TILE}"]


def _hlo(extra, over=RING):
    from test_plan import _plan
    from trainer.plan.verify import measure
    cfg, _ = _plan(over + extra)
    return measure(cfg, grads=False).text


def _scores_shaped(hlo: str) -> list[str]:
    """The f32 arrays whose last two dimensions are a block's scores ((T/C or T) x (T/C or T)) or a tile of queries
    against the whole row's keys."""
    blocks = [[a, b] for a in (t, T) for b in (t, T)] + [[TILE, T], [T, TILE]]
    return [s for s in re.findall(r"f32\[([\d,]+)\]", hlo) if [int(x) for x in s.split(",")][-2:] in blocks]


def _computations(hlo: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head:
            name = head.group(1)
            out[name] = []
        elif name is not None and line.startswith(" "):
            out[name].append(line)
    return out


def _pairs(comps: dict, name: str, head_dim: int, heads: int) -> int:
    """Query-key pairs per head of the score-shaped dots (both of the output's last two dimensions wider than a head)
    run by computation `name`, through the loops (times their known trip count), calls and fusions it runs: a dot's
    output elements over the rank's rows x heads (XLA folds a kv head's query group into the query rows)."""
    total = 0
    for line in comps.get(name, []):
        dot = re.search(r"= f32\[([\d,]+)\]\{?[^ ]* dot\(", line)
        if dot:
            dims = [int(x) for x in dot.group(1).split(",")]
            if len(dims) >= 2 and min(dims[-2:]) > head_dim:
                assert math.prod(dims) % heads == 0, dims
                total += math.prod(dims) // heads
        loop = re.search(r" while\(.*body=%?([\w.\-]+)", line)
        if loop:
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            inner = _pairs(comps, loop.group(1), head_dim, heads)
            if inner:
                assert trips, f"a loop of dots without a known trip count: {line.strip()[:200]}"
                total += int(trips.group(1)) * inner
        for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line):
            total += _pairs(comps, callee, head_dim, heads)
    return total


def _branches(comps: dict) -> list[list[str]]:
    """The branch computations of every conditional in the program."""
    out = []
    for lines in comps.values():
        for line in lines:
            m = re.search(r" conditional\(.*branch_computations=\{([^}]*)\}", line)
            if m:
                out.append([b.strip().lstrip("%") for b in m.group(1).split(",")])
    return out


@pytest.mark.parametrize("balanced", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["balanced", "unbalanced"])
def test_no_block_of_scores_and_half_a_block_per_step(balanced):
    hlo = _hlo([] if balanced else ["train.context_load_balance=false"])
    square = _scores_shaped(hlo)
    assert not square, square[:5]
    comps = _computations(hlo)
    # the tiny preset: d_model 64, 8 heads of 8; one row per data rank (batch 2 over data 2)
    counted = [[_pairs(comps, b, 8, 1 * 8) for b in branches] for branches in _branches(comps)]
    steps = [c for c in counted if any(c)]  # the ring steps' conditionals (forward and backward)
    assert len(steps) >= 2, counted
    half = t * (t // 2)
    for c in steps:
        # the forward runs one score dot per tile pair, the backward two (the scores again and dP)
        if balanced:
            assert len(c) == 2 and all(x in (half, 2 * half) for x in c), (c, half)
        else:
            assert sorted(c)[0] == 0 and sorted(c)[1] in (t * t, 2 * t * t), (c, t * t)


def test_the_all_gather_step_holds_no_block_of_scores():
    hlo = _hlo(["train.context_attention=all_gather"])
    assert " all-gather(" in hlo
    square = _scores_shaped(hlo)
    assert not square, square[:5]
