"""scripts/bench/scaling.py writes a well-formed table between its markers (part c, on a small shape)."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))


def test_memory_part_writes_one_well_formed_table_between_its_markers(tmp_path):
    import scaling
    # 128 x 32 tokens x 32768 float32 logits = 512 MB: the default rule tiles them
    job = dict(vocab=32768, extra=["model.preset=tiny", "model.seq_len=32", "train.batch_size=128"])
    res = [{"job": job, "out": scaling.work_c(job), "jax": "test"}]
    doc = tmp_path / "perf.md"
    doc.write_text("# before\n\n<!-- scaling:begin -->\n<!-- scaling:c:begin -->\nstale\n<!-- scaling:c:end -->\n"
                   "<!-- scaling:end -->\n\n# after\n")
    for _ in range(2):  # rewriting replaces the block, never appends a second one
        scaling.write(doc, "c", scaling.block("c", res, "cmd", quick=True))
    text = doc.read_text()
    assert text.startswith("# before") and text.endswith("# after\n") and "stale" not in text
    assert text.count("<!-- scaling:c:begin -->") == 1
    inner = text.split("<!-- scaling:c:begin -->")[1].split("<!-- scaling:c:end -->")[0]
    rows = [line for line in inner.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 2  # header, rule, whole and tiled
    assert len({line.count("|") for line in rows}) == 1, rows
    whole, tiled = (float(r.split("|")[3]) for r in rows[2:])  # temp GiB column
    assert 0 < tiled < 0.6 * whole, (whole, tiled)


def test_performance_doc_has_a_marked_block_for_every_part():
    import scaling
    text = (ROOT / "docs" / "performance.md").read_text()
    for part in scaling.PARTS:
        assert len(re.findall(rf"<!-- scaling:{part}:(begin|end) -->", text)) == 2, part
