"""Mixtures of sources (data.mixture, data.mixture_schedule; trainer/data/mixture.py): each source's share of the
rows follows its weight, the batch of a step is a pure function of (seed, step) on any process layout, a schedule
takes effect at its step, one source alone draws as itself, eval reports each source, threads and memory do not grow
with the sources, bad input is one line."""
import gc
import json
import os
import threading

import numpy as np
import pytest

from trainer.cli import main
from trainer.errors import UserError

T, B = 16, 8


def _bins(tmp, n: int, tokens: int = 20_000, vocab: int = 300):
    """n bare token files (no tokenizer: every one alike), each of its own token range, so a row shows its source."""
    out = []
    for j in range(n):
        p = tmp / f"s{j:02d}.bin"
        lo = (j * 10) % (vocab - 10)
        np.random.default_rng(j).integers(lo, lo + 10, tokens).astype(np.uint16).tofile(p)
        out.append(str(p))
    return out


def _mixture(entries, schedule=(), **kw):
    from trainer.config import load_config
    from trainer.data.mixture import Mixture
    keys = [f"data.mixture=[{','.join(entries)}]"] + ([f"data.mixture_schedule=[{','.join(schedule)}]"]
                                                        if schedule else [])
    cfg = load_config(keys)
    return Mixture(cfg.data, 0, B, T, 400, **kw)


def test_shares_follow_the_weights_and_rows_show_their_source(tmp_path):
    """0.7 / 0.2 / 0.1 over 200 steps: each source's share of the rows within 3 standard errors of its weight (of a
    multinomial draw: systematic sampling keeps it far closer); every row's tokens are its source's."""
    a, b, c = _bins(tmp_path, 3)
    m = _mixture([f"{a}=0.7", f"{b}=0.2", f"{c}=0.1"])
    src = np.concatenate([m.sources_of(s) for s in range(200)])
    share, w = np.bincount(src, minlength=3) / len(src), np.array([0.7, 0.2, 0.1])
    assert np.all(np.abs(share - w) <= 3 * np.sqrt(w * (1 - w) / len(src))), share
    batch, rows = m.global_train(5), m.sources_of(5)
    lo = np.array([0, 10, 20])[rows][:, None]
    assert np.all((batch["tokens"] >= lo) & (batch["tokens"] < lo + 10))


def test_a_batch_is_a_function_of_seed_and_step_on_any_layout(tmp_path):
    """Another instance (a resumed run) reads the same batches; each of 2 (or 4) processes builds its rows of them."""
    entries = [f"{p}={w}" for p, w in zip(_bins(tmp_path, 3), (0.5, 0.3, 0.2))]
    m = _mixture(entries)
    for step in (0, 3, 97):
        whole = m.global_train(step)
        again = _mixture(entries).global_train(step)
        assert all(np.array_equal(whole[k], again[k]) for k in whole)
        for P in (2, 4):
            parts = [_mixture(entries, process_index=i, process_count=P).train(step) for i in range(P)]
            assert all(np.array_equal(np.concatenate([p[k] for p in parts]), whole[k]) for k in whole)


def test_one_source_draws_as_itself(tmp_path):
    from trainer.data.batches import Batches, load_corpus
    (a,) = _bins(tmp_path, 1)
    m = _mixture([f"{a}=1"])
    alone = Batches(load_corpus(a), 0, B, T, 400)
    for step in (0, 7):
        x, y = m.global_train(step), alone.global_train(step)
        assert all(np.array_equal(x[k], y[k]) for k in y)


def test_a_schedule_takes_effect_at_its_step(tmp_path):
    """'100:NAME=0': source NAME fills rows up to the 99th step (index 98) and none from the 100th (index 99)."""
    a, b = _bins(tmp_path, 2)
    m = _mixture([f"{a}=0.5", f"{b}=0.5"], ["100:s01=0"])
    assert (m.sources_of(98) == 1).sum() == B // 2 and (m.sources_of(99) == 1).sum() == 0
    assert np.array_equal(m.weights(98), [0.5, 0.5]) and np.array_equal(m.weights(99), [0.5, 0.0])


def test_threads_and_memory_do_not_grow_with_sources(tmp_path):
    """50 sources: the loader is one thread (as for one source), and resident memory per source stays under 5 MB
    (the figure: `pytest tests/test_mixture.py -k threads -s`)."""
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    paths = _bins(tmp_path, 50, tokens=200_000)
    counts = {}
    for n in (1, 50):
        gc.collect()
        before, threads = rss(), threading.active_count()
        m = _mixture([f"{p}=1" for p in paths[:n]])
        it = m.iterate(0, 40)
        seen = max(threading.active_count() - threads for _ in zip(range(40), it))
        counts[n] = (seen, rss() - before)
        it.close() if hasattr(it, "close") else None
        del it, m
    (t1, _), (t50, grew) = counts[1], counts[50]
    print(f"loader threads: {t1} (1 source), {t50} (50 sources); resident memory {grew / 50 / 2**20:.2f} MB per source")
    assert 1 <= t50 <= t1 <= 2 and grew / 50 < 5 * 2**20


@pytest.mark.parametrize("entries,schedule,message", [
    (["A=0.5", "B=-0.1"], [], r"^data.mixture entry '.*s01.bin=-0.1' has a negative weight; weights are >= 0"),
    (["A=0", "B=0"], [], r"^data.mixture weights are all 0; give at least one source a positive weight$"),
    (["A=0.5", "B=0.5"], ["10:web=0.3"], r"^data.mixture_schedule entry '10:web=0.3' names 'web', which is not a "
     r"source of data.mixture \(s00, s01\); use one of those names$"),
    (["A=0.5", "B=0.5"], ["10:s00=0", "20:s01=0"], r"^data.mixture_schedule leaves every weight 0 from step 20"),
    (["A0.5"], [], r"^data.mixture entry '.*s00.bin0.5' is not \[NAME:\]SOURCE=WEIGHT; write e.g."),
])
def test_bad_mixtures_are_one_line(tmp_path, entries, schedule, message):
    a, b = _bins(tmp_path, 2)
    entries = [e.replace("A", a).replace("B", b) for e in entries]
    with pytest.raises(UserError, match=message) as e:
        _mixture(entries, schedule)
    assert "\n" not in str(e.value)


def test_sources_of_different_tokenizers_are_one_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"d{i}.txt").write_text(" ".join(f"w{i}x{k}" for k in range(300)))
    for out, vocab in (("a.bin", "300"), ("b.bin", "320")):
        assert main(["prepare", str(src), "--out", str(tmp_path / out), "--train-tokenizer", vocab, "--no-progress",
                     "--heldout", "0.3"]) == 0
        os.replace(tmp_path / "tokenizer.json", tmp_path / f"{out}.tokenizer.json")
        meta = json.loads((tmp_path / f"{out}.json").read_text())
        meta["tokenizer"]["path"] = f"{out}.tokenizer.json"
        (tmp_path / f"{out}.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"^data.mixture mixes tokenizers: 'a' has tokenizer [0-9a-f]{12}, 'b' "
                       r"tokenizer [0-9a-f]{12}; prepare every source with one tokenizer"):
        _mixture([f"{tmp_path / 'a.bin'}=0.5", f"{tmp_path / 'b.bin'}=0.5"])



def _same_names(tmp):
    """Two sources prepared as the docs show (--out runs/X/data.bin): both named 'data' by their file name."""
    out = []
    for j, run in enumerate(("web", "code")):
        (tmp / run).mkdir()
        np.random.default_rng(j).integers(10 * j, 10 * j + 10, 20_000).astype(np.uint16).tofile(tmp / run / "data.bin")
        out.append(str(tmp / run / "data.bin"))
    return out


def test_an_entry_names_its_source(tmp_path):
    """'web:A=0.75' and 'code:B=0.25', both files data.bin: the names are what the schedule and the rows go by (code's
    rows hold tokens 10-19, its file's), and the same files without names are one line naming the fix."""
    a, b = _same_names(tmp_path)
    m = _mixture([f"web:{a}=0.75", f"code:{b}=0.25"], ["3:code=0"])
    assert m.names == ["web", "code"] and m.sources == [a, b]
    src, batch = m.sources_of(1), m.global_train(1)
    assert (src == 1).sum() == B // 4 and np.all((batch["tokens"][src == 1] >= 10) & (batch["tokens"][src == 1] < 20))
    assert (m.sources_of(2) == 1).sum() == 0  # the 3rd step (index 2) on: code's weight 0
    with pytest.raises(UserError, match=r"^data.mixture names two sources 'data' \(a source is named by its file or "
                       r"folder name unless its entry names it\); name them apart: data.mixture=\[web:"):
        _mixture([f"{a}=0.75", f"{b}=0.25"])
    with pytest.raises(UserError, match=r"^data.mixture names two sources 'web'"):
        _mixture([f"web:{a}=0.75", f"web:{b}=0.25"])


@pytest.mark.parametrize("entry,parsed", [
    ("s3://bkt/web/=0.5", ("web", "s3://bkt/web/", 0.5)),
    ("web:s3://bkt/x.bin=0.5", ("web", "s3://bkt/x.bin", 0.5)),
    ("gs://bkt/d/data.bin=1", ("data", "gs://bkt/d/data.bin", 1.0)),
    ("code_v2:runs/b:c/data.bin=2", ("code_v2", "runs/b:c/data.bin", 2.0)),
    ("runs/a/data.bin=0.3", ("data", "runs/a/data.bin", 0.3)),
])
def test_a_name_is_an_identifier_before_a_colon_that_no_url_has(entry, parsed):
    from trainer.config.mixture_entries import split_entry
    assert split_entry(entry) == parsed


def test_a_missing_source_names_the_mixture_entry(tmp_path):
    (a,) = _bins(tmp_path, 1)
    missing = tmp_path / "nope" / "data.bin"
    with pytest.raises(UserError, match=f"^data.mixture entry 'web:{missing}=0.5' names source '{missing}', which "
                       "does not exist; give an existing file or folder") as e:
        _mixture([f"{a}=0.5", f"web:{missing}=0.5"])
    assert "data.source" not in str(e.value)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(UserError, match=f"^data.mixture entry '{empty}=0.5': source '{empty}' is empty"):
        _mixture([f"{a}=0.5", f"{empty}=0.5"])


def test_a_mixture_without_brackets_is_its_comma_list(tmp_path):
    """data.mixture=A=0.5,B=0.5 (no brackets: what a shell user types) is the list [A=0.5,B=0.5], on the command
    line and in a YAML file; a list key without a form of its entries (run.plugins) says the form in one line."""
    from trainer.config import load_config
    a, b = _bins(tmp_path, 2)
    cfg = load_config([f"data.mixture=web:{a}=0.5, {b}=0.5", "data.mixture_schedule=3:web=0"])
    assert cfg.data.mixture == [f"web:{a}=0.5", f"{b}=0.5"] and cfg.data.mixture_schedule == ["3:web=0"]
    with pytest.raises(UserError, match=r"^config key 'run.plugins' \(command line\) is a list: write "
                       r"run.plugins=\[A,B\] \(brackets, quoted in a shell\)$"):
        load_config(["run.plugins=m:C"])
    (tmp_path / "c.yaml").write_text(f"data:\n  mixture: {a}=0.5,{b}=0.5\n")
    assert load_config([str(tmp_path / "c.yaml")]).data.mixture == [f"{a}=0.5", f"{b}=0.5"]


def test_a_data_source_beside_a_mixture_is_said_to_be_ignored(tmp_path, caplog):
    """data.source set beside data.mixture: one warning line saying data.source is not read (train and plan both
    validate); data.source left at its default, none."""
    from trainer.config import load_config, validate
    a, b = _bins(tmp_path, 2)
    for source, said in ((None, False), (a, True)):
        caplog.clear()
        keys = [f"data.mixture=[{a}=0.5,{b}=0.5]"] + ([f"data.source={source}"] if source else [])
        validate(load_config(keys), 8)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warned == ([f"data.source='{a}' is ignored: data.mixture names this run's sources; drop data.source, "
                           "or drop data.mixture to train on that source alone"] if said else []), warned

@pytest.mark.slow
def test_a_killed_mixture_run_resumes_on_the_same_batches(tmp_path):
    """meshtrain train on a mixture with a weight change at step 7: metrics.jsonl has eval_loss/NAME per source (one
    named by its entry, web) and their weighted mean; SIGKILL after the step-4 checkpoint, then the same command:
    every step's loss and gradient norm equal the uninterrupted run's, bit for bit."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import TINY
    a, b, c = _bins(tmp_path, 3)
    keys = TINY + ["model.vocab_size=300", "model.seq_len=16", "train.steps=12", "checkpoint.every=4",
                   "run.log_every=1", "train.eval_every=6", "train.eval_batches=1",
                   f"data.mixture=[web:{a}=0.7,{b}=0.2,{c}=0.1]", "data.mixture_schedule=[7:s02=0.5]"]
    cmd = [sys.executable, "-c", "import sys; from trainer.cli import main; sys.exit(main(sys.argv[1:]))", "train"]

    def lines(run):
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    subprocess.run(cmd + keys + [f"run.dir={tmp_path / 'whole'}"], check=True, capture_output=True)
    run = tmp_path / "killed"
    p = subprocess.Popen(cmd + keys + [f"run.dir={run}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if (run / "metrics.jsonl").exists() and any(r.get("step", 0) >= 6 and "loss" in r for r in lines(run)):
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not any(r.get("step") == 12 for r in lines(run)), "killed too late"
    subprocess.run(cmd + keys + [f"run.dir={run}"], check=True, capture_output=True)
    whole, again = lines(tmp_path / "whole"), lines(run)
    steps = lambda rs: {r["step"]: (r["loss"], r["grad_norm"]) for r in rs if "loss" in r}  # noqa: E731
    assert steps(again) == steps(whole) and len(steps(whole)) == 12
    evals = [r for r in whole if "eval_loss" in r]
    assert [r["step"] for r in evals] == [6, 12]
    for r in evals:
        assert {"eval_loss/web", "eval_loss/s01", "eval_loss/s02"} <= set(r) and "eval_loss/s00" not in r
    w = {6: (0.7, 0.2, 0.1), 12: (0.7, 0.2, 0.5)}
    for r in evals:
        mean = np.dot(w[r["step"]], [r[f"eval_loss/{n}"] for n in ("web", "s01", "s02")]) / sum(w[r["step"]])
        assert abs(r["eval_loss"] - mean) < 1e-6
