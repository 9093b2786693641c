"""README.md and docs/*.md: relative links resolve, anchors match headings, the README stays a short map."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SETUP = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && meshtrain train",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && pytest -q",
]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    s = re.sub(r"`|\*\*?|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", s).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug in a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def links(path: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(_outside_code(path.read_text()))]


def test_slug_follows_github():
    assert slug("Gradient sync (`train.grad_sync`)") == "gradient-sync-traingrad_sync"
    assert slug("Local SGD, DiLoCo and the Hogwild! lab") == "local-sgd-diloco-and-the-hogwild-lab"
    assert slug("Crashes, not hangs") == "crashes-not-hangs"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    """Every relative link names an existing file, and every #anchor a heading of its target."""
    bad = []
    for target in links(doc):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)


def test_readme_is_a_short_map_starting_with_the_setup_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 210, f"README.md has {len(lines)} lines; move detail into docs/"
    body = [ln for ln in lines if ln.strip() and not ln.startswith("# ")]
    assert body[:6] == ["```bash", SETUP[0], "```", "```bash", SETUP[1], "```"]
