"""Write docs/config.md's table of every config key from the schema (trainer/config/sections.py); --check: exit 1 if it
differs. The prose around the table is kept; tests/test_config_schema.py fails when the table drifts.

    python scripts/config_docs.py [--check]
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DOC = ROOT / "docs" / "config.md"
BEGIN, END = "<!-- keys: written by scripts/config_docs.py from the schema; edit trainer/config/sections.py -->", \
    "<!-- end of keys -->"


def generated(text: str) -> str:
    """docs/config.md's text with the table between the markers written from the schema."""
    from trainer.config import keys_markdown
    block = re.escape(BEGIN) + r".*?" + re.escape(END)
    if not re.search(block, text, flags=re.S):
        raise SystemExit(f"{DOC} has no '{BEGIN}' ... '{END}' block to write the table into")
    return re.sub(block, lambda _: f"{BEGIN}\n{keys_markdown()}\n{END}", text, flags=re.S)


if __name__ == "__main__":
    old = DOC.read_text()
    new = generated(old)
    if "--check" in sys.argv[1:]:
        sys.exit(0 if new == old else f"{DOC} differs from the schema; run python scripts/config_docs.py")
    DOC.write_text(new)
