"""README.md and docs/*.md: relative links resolve, anchors match headings, the README stays a short map; every
repository path named there or in the docstrings and comments of the code (trainer/, models/, meshes/, scripts/)
exists."""
import ast
import io
import re
import tokenize
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


# a repository path: a top-level folder of the project, then names, not inside a URL or another path (no word, '.',
# '/' or '-' before it); one with a glob, a <placeholder>, {braces} or '...' in it names no one file
REPO_PATH = re.compile(r"(?<![\w./-])((?:trainer|models|meshes|scripts|tests|docs|\.ci)/[^\s`'\"()\[\],;:|=]*)")
CODE = ("trainer", "models", "meshes", "scripts")
# files of earlier revisions, named by the scripts that load an old revision's tree (scripts/bench/)
EARLIER = {"scripts/bench.py", "trainer/pipeline.py", "trainer/pipeline_1f1b.py"}


def named_paths(text: str) -> set[str]:
    """The repository paths a text names (trailing '/' kept: a folder; a sentence's full stop dropped); none with a
    glob or a placeholder in it."""
    found = (m.group(1).partition("#")[0].rstrip(".-") for m in REPO_PATH.finditer(text))
    return {p for p in found if not re.search(r"[*<>{}]|\.\.\.", p)}


def prose_of_python(source: str) -> str:
    """A Python file's docstrings and comments (what a reader takes as true of the code), without its code."""
    tree = ast.parse(source)
    docs = [ast.get_docstring(n, clean=False) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    return "\n".join([d for d in docs if d] + comments)


def prose_of(path: Path) -> str:
    """What a file says about the repository: a Markdown file whole, a Python file's docstrings and comments, another
    script's comment lines."""
    text = path.read_text()
    if path.suffix == ".md":
        return text
    if path.suffix == ".py":
        return prose_of_python(text)
    return "\n".join(ln.split("#", 1)[1] for ln in text.splitlines() if ln.lstrip().startswith("#") or " # " in ln)


def code_map_paths(readme: str) -> set[str]:
    """The README code map's bare file names, each under the folder it follows: `trainer/run/` (`loop.py`, ...)."""
    out = set()
    for m in re.finditer(r"`((?:trainer|models|meshes|scripts)/[\w/]*/)` \(([^|]*?)\)(?: \||;|$)", readme, flags=re.M):
        out |= {m.group(1) + name for name in re.findall(r"`([\w.]+\.(?:py|yaml|sh))`", m.group(2))}
    return out


def missing_paths(files, root: Path = ROOT) -> list[str]:
    """'file: path' for each repository path a file names that does not exist (a folder's must be a folder). A file's
    whole text is searched first; only a file naming a missing path is read for its prose (parsing every file would
    take seconds)."""
    bad = []
    for f in files:
        text = f.read_text()
        said = named_paths(text) | (code_map_paths(text) if f.name == "README.md" else set())
        gone = [p for p in sorted(said - EARLIER)
                if not (root / p).exists() or p.endswith("/") and (root / p).is_file()]
        if gone and f.suffix != ".md":
            prose = named_paths(prose_of(f))
            gone = [p for p in gone if p in prose]
        bad += [f"{f.relative_to(root)}: {p}" for p in gone]
    return bad


def test_every_path_the_docs_and_the_code_name_exists():
    """README.md, docs/*.md and the docstrings and comments of trainer/, models/, meshes/ and scripts/ name only paths
    that exist (a file moved: every mention follows)."""
    code = [f for pkg in CODE for f in sorted((ROOT / pkg).rglob("*")) if f.is_file() and f.suffix in (".py", ".sh",
                                                                                                     ".sbatch")]
    bad = missing_paths(DOCS + code)
    assert not bad, "named but missing: " + "; ".join(bad)


def test_a_wrong_path_is_caught(tmp_path):
    """The check finds a moved module named in a docstring, a comment, a doc and the code map, and nothing in code,
    a URL, a glob or a placeholder."""
    (tmp_path / "trainer" / "run").mkdir(parents=True)
    (tmp_path / "trainer" / "run" / "on_nan.py").write_text("")
    (tmp_path / "mod.py").write_text('''"""Acts on trainer/run/guard.py's counters."""
X = "trainer/run/gone.py"  # read by trainer/run/on_nan.py and models/moe.py
''')
    (tmp_path / "README.md").write_text("see `trainer/run/on_nan.py`, https://x.org/models/nope.py, "
                                        "`models/families/*.py`, `trainer/<name>.py`\n"
                                        "| plug-ins | `trainer/run/` (`on_nan.py`, `guard.py`) |\n")
    bad = missing_paths([tmp_path / "mod.py", tmp_path / "README.md"], tmp_path)
    assert bad == ["mod.py: models/moe.py", "mod.py: trainer/run/guard.py", "README.md: trainer/run/guard.py"], bad


def test_the_code_map_names_every_module():
    """Each module of meshes/, models/ and trainer/ (a package's __init__.py aside) is on the README's code map, so
    a module added or moved shows there."""
    readme = (ROOT / "README.md").read_text()
    named = named_paths(readme) | code_map_paths(readme)
    modules = [str(f.relative_to(ROOT)) for pkg in ("meshes", "models", "trainer")
               for f in sorted((ROOT / pkg).rglob("*.py")) if f.name != "__init__.py"]
    missing = [m for m in modules if m not in named]
    assert not missing, f"not on the README's code map: {missing}"
