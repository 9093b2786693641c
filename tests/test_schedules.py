"""Pipeline schedule tables (trainer/parallel/schedules.py): dependencies, liveness, idle share, rendering."""
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.parallel.schedules import BWD_EMBED, FWD_EMBED, build, idle_fraction, main, plan, render

ROOT = Path(__file__).resolve().parents[1]

CASES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 4, 1), ("1f1b", 8, 8, 1),
         ("1f1b", 4, 16, 1), ("gpipe", 4, 4, 2), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 2, 4, 3)]


def _ticks(table):
    """{(kind, stage, m, v): [ticks]} read off the table."""
    at = {}
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is not None:
                at.setdefault((op.kind, s, op.m, op.v), []).append(t)
    return at


@pytest.mark.parametrize("sched,S,M,V", CASES)
def test_each_op_once_and_after_its_inputs(sched, S, M, V):
    table = build(sched, S, M, V)
    at = _ticks(table)
    assert sorted(at) == sorted((k, s, m, v) for k in "FB" for s in range(S) for m in range(M) for v in range(V))
    assert all(len(ts) == 1 for ts in at.values())
    t = {k: ts[0] for k, ts in at.items()}
    for s in range(S):
        for m in range(M):
            for v in range(V):
                # virtual stage q = v*S + s: forward needs q-1's forward a tick earlier (one hop)
                if s > 0:
                    assert t["F", s, m, v] >= t["F", s - 1, m, v] + 1
                elif v > 0:
                    assert t["F", 0, m, v] >= t["F", S - 1, m, v - 1] + 1
                if s < S - 1:
                    assert t["B", s, m, v] >= t["B", s + 1, m, v] + 1
                elif v < V - 1:
                    assert t["B", s, m, v] >= t["B", 0, m, v + 1] + 1
                assert t["B", s, m, v] > t["F", s, m, v]


def _max_live(table, S, M):
    """Most stage inputs held on one stage at once: from its forward until its backward."""
    t = {k: ts[0] for k, ts in _ticks(table).items()}
    return max(sum(t["F", s, m, 0] <= tick <= t["B", s, m, 0] for m in range(M))
               for s in range(S) for tick in range(len(table)))


@pytest.mark.parametrize("S,M", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_1f1b_holds_at_most_S_inputs_gpipe_M(S, M):
    assert _max_live(build("1f1b", S, M), S, M) <= S
    assert _max_live(build("gpipe", S, M), S, M) == M
    assert plan(build("1f1b", S, M)).n_act <= S  # the executor's buffer follows


@pytest.mark.parametrize("sched,S,M,V", CASES)
def test_idle_share_counted_from_the_table(sched, S, M, V):
    table = build(sched, S, M, V)
    idle = sum(op is None for row in table for op in row)
    assert idle_fraction(table) == idle / (S * len(table))
    if sched != "interleaved_1f1b":
        # forward and backward each take a tick: 2(MV + S - 1) ticks, the same bubble as GPipe
        assert len(table) == 2 * (M * V + S - 1)
        assert idle == 2 * S * (S - 1)


def test_interleaving_shrinks_the_bubble():
    assert idle_fraction(build("interleaved_1f1b", 4, 8, 2)) < idle_fraction(build("1f1b", 4, 8))


def test_1f1b_warm_up_steady_cool_down():
    table = build("1f1b", 4, 8)
    for s in range(4):
        ops = [row[s] for row in table if row[s] is not None]
        kinds = "".join(op.kind for op in ops)
        warm = 4 - s - 1
        assert kinds == "F" * warm + "FB" * (8 - warm) + "B" * warm, (s, kinds)
        assert [op.m for op in ops if op.kind == "B"] == list(range(8))


def test_render_s4_m8():
    text = render(build("1f1b", 4, 8))
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[0].split()[2:] == "F0 F1 F2 F3 . . . B0 F4 B1 F5 B2 F6 B3 F7 B4 . B5 . B6 . B7".split()
    assert lines[3].split()[2:9] == ". . . F0 B0 F1 B1".split()
    out = subprocess.run([sys.executable, "-m", "trainer.parallel.schedules", "4", "8", "1f1b"],
                         capture_output=True, text=True, check=True).stdout
    assert text in out and "22 ticks" in out


def _simulate_buffers(table, p, S):
    """Replay the plan's slot reads and writes; every read finds the (m, v) the op expects."""
    act = [dict() for _ in range(S)]
    cot = [dict() for _ in range(S)]
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is None:
                continue
            first = p.branch[t, s] in (FWD_EMBED, BWD_EMBED)
            if not first:
                assert act[s].get(int(p.slot[t, s])) == (op.m, op.v), (t, s, op)
            if op.kind == "B":
                assert cot[s].get(int(p.cot_slot[t, s])) == (op.m, op.v), (t, s, op)
        for s, op in enumerate(row):  # writes land at the end of the tick
            if p.loss_slot[t, s] < p.n_cot:
                cot[s][int(p.loss_slot[t, s])] = (op.m, op.v)
            src_f, src_b = row[(s - 1) % S], row[(s + 1) % S]
            if p.recv_act[t, s] < p.n_act:
                act[s][int(p.recv_act[t, s])] = (src_f.m, src_f.v + (s == 0))
            if p.recv_cot[t, s] < p.n_cot:
                cot[s][int(p.recv_cot[t, s])] = (src_b.m, src_b.v - (s == S - 1))


@pytest.mark.parametrize("sched,S,M,V", CASES)
def test_plan_slots_hold_the_right_inputs(sched, S, M, V):
    table = build(sched, S, M, V)
    _simulate_buffers(table, plan(table, V), S)


def test_start_up_line_reads_the_table():
    from trainer.parallel.schedules import describe
    assert describe(4, 8, 1, "1f1b") == "pipeline 1f1b x1: 4 stages, 8 microbatches, 22 ticks, bubble 27.3%"


def test_unknown_schedule():
    with pytest.raises(ValueError):
        build("zigzag", 4, 8)


@pytest.mark.parametrize("doc,schedules", [("README.md", ["gpipe", "1f1b"]),  # interleaved: docs/parallelism.md
                                           ("docs/parallelism.md", ["gpipe", "1f1b", "interleaved_1f1b"])])
def test_docs_show_the_tables_the_code_builds(doc, schedules, capsys):
    """The S=4, M=8 tables in the docs are `python -m trainer.parallel.schedules 4 8 SCHEDULE`'s output, verbatim."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    for sched in schedules:
        main(["4", "8", sched])
        out = capsys.readouterr().out
        assert f"\n{out}" in text, f"{doc}: regenerate the {sched} table"
