"""Conversations: records prepared through chat templates equal transformers' ids and assistant masks, JSONL and
Parquet prepare alike, packing is exact on every layout, training on conversations equals one device, and each
bad input is one line."""
import json
import shutil
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import SGD, TINY, fresh_state, max_rel, run_steps
from trainer.cli import main
from trainer.data.prepare import prepare

SLOW = pytest.mark.slow
F = Path(__file__).parent / "fixtures" / "chat"
REF = json.loads((F / "reference.json").read_text())
T = 128
MODEL = ["model.vocab_size=1032", f"model.seq_len={T}", "data.document_mask=true"]


def _prepare(tmp, src, template=None, **kw):
    out = tmp / "data.bin"
    kw.setdefault("heldout", 0)
    meta = prepare([str(src)], str(out), tokenizer=str(F / "tokenizer"), log=lambda *a: None, show_progress=False,
                   chat_template=template and str(F / "templates" / f"{template}.jinja"), date=REF["date"], **kw)
    toks, mask = np.fromfile(out, meta["dtype"]), np.fromfile(out.parent / meta["loss_mask"]["path"], np.uint8)
    return out, meta, toks, mask, np.fromfile(out.parent / meta["document_index"]["path"], np.uint64).astype(int)


@pytest.mark.parametrize("template", sorted(REF["templates"]))
def test_ids_and_masks_equal_transformers(tmp_path, template):
    for kind in ("conversations", "exchanges"):
        _, _, toks, mask, idx = _prepare(tmp_path / kind, F / f"{kind}.jsonl", template)
        refs = REF["templates"][template][kind]
        assert len(idx) == len(refs) + 1
        for i, r in enumerate(refs):
            assert toks[idx[i]:idx[i + 1]].tolist() == r["ids"], (template, kind, i)
            assert mask[idx[i]:idx[i + 1]].tolist() == r["mask"], (template, kind, i)


def test_the_tokenizer_folders_template_is_the_default_and_loss_on_all_counts_every_token(tmp_path):
    _, meta, toks, mask, idx = _prepare(tmp_path / "a", F / "conversations.jsonl")  # tokenizer_config's: chatml_gen
    ref = REF["templates"]["chatml_gen"]["conversations"]
    assert toks[idx[0]:idx[1]].tolist() == ref[0]["ids"] and meta["chat_template"]["generation_blocks"]
    _, meta, toks2, mask2, _ = _prepare(tmp_path / "b", F / "conversations.jsonl", loss_on="all")
    assert (toks2 == toks).all() and mask2.all() and not mask.all()
    assert meta["loss_mask"]["counted"]["train"] == len(toks)


def _parquet(src: Path, dst: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    recs = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    for r in recs:  # Parquet merges the keys of a struct column: tool schemas and arguments as JSON text in both
        if "tools" in r:
            r["tools"] = json.dumps(r["tools"], ensure_ascii=False)
        for m in r["messages"]:
            for c in m.get("tool_calls") or []:
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
    src2 = dst.with_suffix(".jsonl")
    src2.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    pq.write_table(pa.Table.from_struct_array(pa.array(recs)), dst, row_group_size=7)  # every row's columns
    return src2


def test_jsonl_and_parquet_give_the_same_bin_mask_index_and_split(tmp_path):
    (tmp_path / "src").mkdir()
    jsonl = _parquet(F / "conversations.jsonl", tmp_path / "src" / "chats.parquet")
    a = _prepare(tmp_path / "j", jsonl, "chatml", heldout=0.3)
    b = _prepare(tmp_path / "p", tmp_path / "src" / "chats.parquet", "chatml", heldout=0.3)
    for x, y in zip(a[2:], b[2:]):
        np.testing.assert_array_equal(x, y)
    assert a[1]["heldout_range"] == b[1]["heldout_range"] and a[1]["documents"] == b[1]["documents"]
    # the split: a record is held out by the CRC-32 of its JSON with None dropped and keys sorted
    def drop_none(x):
        if isinstance(x, dict):
            return {k: drop_none(v) for k, v in x.items() if v is not None}
        return [drop_none(v) for v in x] if isinstance(x, list) else x

    recs = [drop_none(json.loads(line)) for line in jsonl.read_text().splitlines()]
    held = [r for r in recs if zlib.crc32(json.dumps(r, sort_keys=True, ensure_ascii=False,
                                                     separators=(",", ":")).encode()) % 10_000 < 3000]
    assert 0 < len(held) == a[1]["documents"]["heldout"] < len(recs)


def test_packing_by_hand():
    from trainer.data.packing import pack
    # documents of 9, 5, 4, 3 and 12 tokens: 8, 4, 3, 2 and 11 targets; rows of 8: the 11 is split 8 + 3
    starts = np.cumsum([0, 9, 5, 4, 3, 12])
    p = pack(starts, 8)
    rows = [[(int(p.start[k]), int(p.length[k]), int(p.offset[k])) for k in range(p.row_ptr[r], p.row_ptr[r + 1])]
            for r in range(p.rows)]
    # longest first, each into the row with the least room that holds it: 8 | 8 | 4 + 3 (room 1 left) | the
    # split's 3 opens a row that the 2 then joins (room 5 is the only one >= 2). In document order within a row.
    # (Next-fit in document order would take 5 rows: 8 | 4 + 3 | 2 | 8 | 3.)
    assert rows == [[(0, 8, 0)], [(21, 8, 0)], [(9, 4, 0), (14, 3, 0)], [(18, 2, 0), (29, 3, 8)]]
    assert p.split == 1 and p.documents == 5


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """The conversations prepared with the ChatML template, a third held out."""
    tmp = tmp_path_factory.mktemp("chats")
    return _prepare(tmp, F / "conversations.jsonl", "chatml", heldout=0.3)


def _alone(out: Path, toks, mask, idx, lo: int, hi: int, params, c):
    """Sum and count of the masked loss of documents lo..hi-1, each piece (at most T targets) alone in a row."""
    from models.batch import from_windows
    from models.objectives.objective import loss_sum
    total, count = 0.0, 0
    for a, b in zip(idx[lo:hi], idx[lo + 1:hi + 1]):
        for s in range(a, b - 1, T):
            n = min(T, b - 1 - s)
            w = np.zeros((1, T + 1), np.int64)
            w[0, :n + 1] = toks[s:s + n + 1]
            weight = np.zeros((1, T), np.float32)
            weight[0, :n] = mask[s + 1:s + n + 1]
            seg = np.zeros((1, T), np.int32)
            seg[0, :n] = 1
            pos = np.zeros((1, T), np.int32)
            pos[0, :n] = np.arange(s - a, s - a + n)
            total += float(loss_sum(c, params, from_windows(w, weight, seg, pos)))
            count += int(weight.sum())
    return total, count


@pytest.mark.parametrize("mesh", [(1, 1, 1), (2, 1, 4), pytest.param((2, 2, 1), marks=SLOW)],
                         ids=["1dev", "zero3-2x1x4", "1f1b-2x2x1"])
def test_a_packed_batch_is_the_sum_of_its_conversations_alone(chats, mesh):
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.state import make_setup
    from trainer.step import jit_eval_step
    out, meta, toks, mask, idx = chats
    d, st, m = mesh
    over = TINY + MODEL + [f"mesh.data={d}", f"mesh.stage={st}", f"mesh.model={m}", "train.batch_size=32"]
    over += ["train.zero_stage=3"] if m > 1 else []
    over += ["train.pipeline_schedule=1f1b", "train.microbatches=2"] if st > 1 else []
    s = make_setup(load_config(over), jax.devices()[:d * st * m])
    b = Batches(load_corpus(str(out)), 0, 32, T, s.model.vocab_size, document_mask=True)
    assert 0 < b.packed_eval.rows <= 32  # one eval batch holds every held-out row once
    with jax.set_mesh(s.mesh):
        params = fresh_state(s)["params"]
        got_sum, got_count = jax.device_get(jit_eval_step(s)(params, jax.device_put(b.eval(0), s.batch_sharding())))
    n_train = meta["documents"]["train"]
    ref_sum, ref_count = _alone(out, toks, mask, idx, n_train, len(idx) - 1, jax.tree.map(np.asarray, params),
                                s.model)
    assert int(got_count) == ref_count == meta["loss_mask"]["counted"]["heldout"]
    np.testing.assert_allclose(got_sum / got_count, ref_sum / ref_count, rtol=1e-5)


TRAIN = TINY + MODEL + SGD


@pytest.mark.parametrize("layout", [
    pytest.param(["mesh.data=2", "mesh.model=4", "train.zero_stage=3"], id="zero3-2x1x4"),
    pytest.param(["mesh.data=2", "mesh.stage=2", "mesh.model=1", "train.pipeline_schedule=1f1b",
                  "train.microbatches=2"], id="1f1b-2x2x1", marks=SLOW),
    pytest.param(["mesh.data=8", "mesh.stage=1", "mesh.model=1", "train.zero_stage=1", "train.microbatches=2"],
                 id="zero1-m2-8x1x1", marks=SLOW),
    pytest.param(["mesh.data=8", "mesh.stage=1", "mesh.model=1", "train.grad_sync=ring"], id="ring-8x1x1",
                 marks=SLOW)])
def test_training_on_conversations_equals_one_device(chats, layout):
    got = run_steps(TRAIN + layout, source=str(chats[0]))
    ref = run_steps(TRAIN + ["mesh.data=1", "mesh.stage=1", "mesh.model=1"], 1, source=str(chats[0]))
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5)
    np.testing.assert_allclose(got.grad_norms, ref.grad_norms, rtol=1e-5)
    assert max_rel(got.params, ref.params) < 1e-5


def _lines(capsys):
    return [line for line in capsys.readouterr().err.strip().splitlines() if line]


def _bad(tmp_path, capsys, lines: list[str] | None = None, template: str | None = None, extra=()):
    src = tmp_path / "bad.jsonl"
    if lines is not None:
        src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o" / "data.bin"
    args = ["prepare", str(src), "--out", str(out), "--tokenizer", str(F / "tokenizer"), "--no-progress", *extra]
    if template:
        (tmp_path / "t.jinja").write_text(template)
        args += ["--chat-template", str(tmp_path / "t.jinja")]
    code = main(args)
    err = _lines(capsys)
    written = list((tmp_path / "o").iterdir()) if (tmp_path / "o").exists() else []
    return code, err, written


CONV = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}]})
# renders the last assistant turn with a marker the earlier renderings lack: no prefix of the whole
LAST_DIFFERS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if loop.last %} (end){% endif %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("case,lines,template,extra,says", [
    ("not json", [CONV, "{not json"], None, (), "bad.jsonl:2 is not JSON"),
    ("no known field", [CONV, json.dumps({"body": "x"})], None, (), "has none of the fields 'text', 'messages'"),
    ("template error", [CONV], "{{ raise_exception('no tools here') }}", (),
     "cannot render it (TemplateError: no tools"),
    ("turn not found", [CONV], LAST_DIFFERS, (), "needs {% generation %} blocks"),
    ("no counted token", [json.dumps({"messages": [{"role": "user", "content": "hi"}]})], None, ("--heldout", "0"),
     "counts no token of the training split"),
    ("empty held-out", [CONV], None, ("--heldout", "0.05"), "held out none of the 1 records"),
])
def test_bad_records_are_one_line_and_write_nothing(tmp_path, capsys, case, lines, template, extra, says):
    code, err, written = _bad(tmp_path, capsys, lines, template, extra)
    assert code == 2 and len(err) == 1 and says in err[0], (case, err)
    assert written == [], written


def test_conversations_need_a_chat_template(tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(F / "tokenizer" / "tokenizer.json", tok)
    (tmp_path / "c.jsonl").write_text(CONV + "\n")
    code = main(["prepare", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o" / "d.bin"), "--tokenizer", str(tok),
                 "--heldout", "0", "--no-progress"])
    err = _lines(capsys)
    assert code == 2 and len(err) == 1 and "has no chat template" in err[0] and "--chat-template" in err[0], err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_document_mask_false_with_a_loss_mask_is_one_line(chats, tmp_path, capsys):
    code = main(["train", *TINY, *MODEL[:2], f"data.source={chats[0]}", "data.document_mask=false",
                 f"run.dir={tmp_path / 'r'}"])
    err = _lines(capsys)
    assert code == 2 and "data.document_mask=false" in err[-1] and "loss mask" in err[-1], err


def _train(chats, run, steps: int, mesh, *extra):
    from trainer.config import load_config
    from trainer.run.loop import train
    d, st, m = mesh
    cfg = load_config(TRAIN + [f"data.source={chats[0]}", f"run.dir={run}", f"train.steps={steps}",
                               "checkpoint.every=2", "train.eval_every=2", "train.eval_batches=2", "run.log_every=1",
                               f"mesh.data={d}", f"mesh.stage={st}", f"mesh.model={m}", *extra])
    result = train(cfg, jax.devices()[:d * st * m])
    return {r["step"]: r for r in result.history if "loss" in r}, result


@SLOW  # four runs (~40 s); the batches of a step are a pure function of (seed, step), tested on windows by default
def test_resume_is_bit_exact_and_another_mesh_continues_with_the_same_batches(chats, tmp_path):
    straight, res = _train(chats, tmp_path / "a", 4, (8, 1, 1))
    _train(chats, tmp_path / "b", 2, (8, 1, 1))
    resumed, _ = _train(chats, tmp_path / "b", 4, (8, 1, 1))
    assert [resumed[s]["loss"] for s in (3, 4)] == [straight[s]["loss"] for s in (3, 4)]  # bitwise
    assert [resumed[s]["grad_norm"] for s in (3, 4)] == [straight[s]["grad_norm"] for s in (3, 4)]
    _train(chats, tmp_path / "c", 2, (8, 1, 1))
    other, _ = _train(chats, tmp_path / "c", 4, (2, 1, 4), "train.zero_stage=3")
    for s in (3, 4):
        np.testing.assert_allclose([other[s]["loss"], other[s]["grad_norm"]],
                                   [straight[s]["loss"], straight[s]["grad_norm"]], rtol=1e-5)
        assert other[s]["counted_tokens"] == straight[s]["counted_tokens"]
    assert all(r.get("eval_counted_tokens") == chats[1]["loss_mask"]["counted"]["heldout"]
               for r in res.history if "eval_loss" in r)


def test_an_exported_chat_run_carries_its_chat_template(chats, tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", *TRAIN, f"data.source={chats[0]}", f"run.dir={run}", "train.steps=1",
                 "train.eval_every=0"]) == 0
    # conversations of up to 1,374 tokens in rows of 128: split, and said so
    note = [x for x in capsys.readouterr().err.splitlines() if x.startswith("packed ")]
    assert len(note) == 1 and f"{chats[1]['documents']['train']} training conversations" in note[0], note
    assert "none dropped" in note[0] and " 0 longer" not in note[0], note
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    got = (tmp_path / "hf" / "chat_template.jinja").read_text()
    assert got == (F / "templates" / "chatml.jinja").read_text()
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (F / "tokenizer" / "tokenizer.json").read_bytes()
    # transformers' generate stops at the end of an assistant's turn as well as at the end of the text
    ids = {t["content"]: t["id"] for t in json.loads((F / "tokenizer" / "tokenizer.json").read_text())["added_tokens"]}
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|endoftext|>"], ids["<|im_end|>"]], gen


@SLOW  # two training processes and a restart (~40 s); the in-process resume above covers the stop-and-resume case
def test_kill9_mid_run_resumes_bit_exact_on_conversations(chats, tmp_path):
    import os
    from test_checkpoint import finish, losses, start, step_dirs, wait_for
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    extra = [f"data.source={chats[0]}", "model.vocab_size=1032", f"model.seq_len={T}", "train.steps=12"]
    assert finish(start(tmp_path / "a", env, *extra)) == 0
    p = start(tmp_path / "b", env, *extra, "checkpoint.every=4")
    wait_for(lambda: 4 in step_dirs(tmp_path / "b"), p, "the step-4 checkpoint")
    p.kill()
    p.wait()
    assert finish(start(tmp_path / "b", env, *extra, "checkpoint.every=4")) == 0
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 12 and a == b  # exact float equality, every step


def test_a_rerun_is_skipped_until_the_mask_is_gone(tmp_path, capsys):
    args = ["prepare", str(F / "exchanges.jsonl"), "--out", str(tmp_path / "d.bin"),
            "--tokenizer", str(F / "tokenizer"), "--heldout", "0", "--no-progress"]
    assert main(args) == 0 and main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("skipped: ")
    (tmp_path / "d.bin.mask").unlink()
    assert main(args) == 0 and not capsys.readouterr().out.splitlines()[-1].startswith("skipped: ")
    assert (tmp_path / "d.bin.mask").is_file()
