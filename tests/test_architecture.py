"""The package layout: dependencies point one way (meshes <- models <- trainer), files stay short."""
import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("meshes", "models", "trainer")


def _imports(path: Path) -> set[str]:
    """Top-level project modules a file imports (absolute imports only: the project uses no others)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.split(".")[0] in PACKAGES}


def _files(pkg):
    return sorted((ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("pkg,forbidden", [("meshes", ("models", "trainer")), ("models", ("trainer",))])
def test_dependencies_point_one_way(pkg, forbidden):
    bad = [(str(f.relative_to(ROOT)), m) for f in _files(pkg) for m in _imports(f) if m.split(".")[0] in forbidden]
    assert not bad, bad


def test_training_path_does_not_import_the_planner():
    """plan/ (planner, simulator) is for `meshtrain plan`/`simulate`; training runs without it."""
    core = [ROOT / "trainer" / n for n in ("state.py", "step.py", "loop.py", "pipeline.py", "sync.py", "data.py")]
    bad = [(f.name, m) for f in core for m in _imports(f) if m.startswith("trainer.plan")]
    assert not bad, bad


def test_importing_models_does_not_import_trainer():
    code = "import sys, models, meshes; print(sorted(m for m in sys.modules if m.split('.')[0] == 'trainer'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_file_over_400_lines(pkg):
    long = {str(f.relative_to(ROOT)): n for f in _files(pkg) if (n := len(f.read_text().splitlines())) > 400}
    assert not long, long


def _code(path: Path) -> str:
    """A file's code without its strings and comments (where prose may quote a formula)."""
    text = path.read_text()
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    spans = [(starts[t.start[0] - 1] + t.start[1], starts[t.end[0] - 1] + t.end[1])
             for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if t.type in (tokenize.STRING, tokenize.COMMENT)]
    for a, b in reversed(spans):
        text = text[:a] + '""' + text[b:]
    return text


# A fact's pattern in code -> the one file allowed to hold it.
FACTS = {
    "a device's datasheet peak (H100 989, A100 312, v5p 459, ... TFLOP/s)":
        (r"\b(989|494|312|156|459|197|275)(\.0)?\s*(e12|\*\s*1e12)", "trainer/plan/devices.py"),
    "a link bandwidth in GB/s": (r"\b(450|300|600|200)\s*\*\s*GB\b", "trainer/plan/devices.py"),
    "the ring all-reduce's 2(K-1)": (r"\b2\s*\*\s*\(\s*[\w.]+\s*-\s*1\s*\)", "trainer/collectives.py"),
    "the ring's (K-1)/K": (r"\(\s*(\w+)\s*-\s*1\s*\)\s*/\s*\1\b", "trainer/collectives.py"),
    "the Transfer type (bytes a device sends per collective, and their time)":
        (r"\bclass\s+Transfer\b", "trainer/plan/types.py"),
}


@pytest.mark.parametrize("fact", FACTS)
def test_each_fact_is_written_once(fact):
    """Hardware figures, collective costs and the bubble are defined in one file and imported elsewhere."""
    pattern, home = FACTS[fact]
    files = [f for pkg in PACKAGES + ("scripts",) for f in _files(pkg)]
    where = sorted({str(f.relative_to(ROOT)) for f in files if re.search(pattern, _code(f))})
    assert where == [home], where


def test_the_pipeline_schedules_are_listed_once():
    """The schedules' names are one tuple, trainer/schedules.SCHEDULES; the config and the executor import it."""
    pattern = r"\(\s*[\"']gpipe[\"'],\s*[\"']1f1b[\"'],\s*[\"']interleaved_1f1b[\"']\s*\)"
    files = [f for pkg in PACKAGES + ("scripts",) for f in _files(pkg)]
    assert sorted({str(f.relative_to(ROOT)) for f in files if re.search(pattern, f.read_text())}) == \
        ["trainer/schedules.py"]


def _stderr_prints(path: Path) -> list[int]:
    """Lines of `print(..., file=sys.stderr)` (or `file=stderr`) and `sys.stderr.write(...)` calls in a file."""
    def is_stderr(node):
        return (isinstance(node, ast.Attribute) and node.attr == "stderr") or \
            (isinstance(node, ast.Name) and node.id == "stderr")
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "print" and any(k.arg == "file" and is_stderr(k.value)
                                                               for k in node.keywords):
            hits.append(node.lineno)
        elif isinstance(f, ast.Attribute) and f.attr == "write" and is_stderr(f.value):
            hits.append(node.lineno)
    return hits


def test_library_code_logs_instead_of_printing_to_stderr():
    """Diagnostics go through `logging` (the CLI sets up its handler); only trainer/cli.py prints its one-line errors."""
    allowed = {ROOT / "trainer" / "cli.py"}
    bad = {str(f.relative_to(ROOT)): lines for pkg in PACKAGES for f in _files(pkg)
           if f not in allowed and (lines := _stderr_prints(f))}
    assert not bad, bad
    assert _stderr_prints(ROOT / "trainer" / "cli.py"), "the check finds nothing: it no longer sees the CLI's prints"
