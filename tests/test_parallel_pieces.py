"""trainer/parallel/ in pieces a reader can hold in mind: no function spans more than 60 lines, its nested
functions and lambdas included (STYLE.md habit 15), read with ast."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60


def spans(source: str, filename: str = "<source>") -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines spanned) of every function, async function and lambda at any depth."""
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                name = prefix + getattr(child, "name", "<lambda>")
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source, filename), "")
    return out


def test_spans_counts_nested_functions_and_lambdas():
    """The measure itself, on a hand-made source: a nested function and a lambda each counted, the
    enclosing function over its whole extent."""
    src = "def f():\n    def g():\n        return 1\n    h = lambda: (\n        2)\n    return g\n\nclass C:\n    def m(self):\n        pass\n"
    assert spans(src) == [("f", 1, 6), ("f.g", 2, 2), ("f.<lambda>", 4, 2), ("C.m", 9, 2)]


def test_no_function_in_parallel_spans_more_than_60_lines():
    files = sorted((ROOT / "trainer" / "parallel").glob("*.py"))
    assert any(f.name == "pipeline.py" for f in files)
    long = [f"{f.relative_to(ROOT)}:{line} {name} spans {n} lines" for f in files
            for name, line, n in spans(f.read_text(), str(f)) if n > MAX_LINES]
    assert not long, "split these into named functions:\n" + "\n".join(long)
