"""The package layout: layers import only downward and without cycles, files stay short, facts live once."""
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


# The house, lowest layer first: a module may import only modules of its own layer or of lower ones
# (DESIGN.md). A module belongs to the layer of the longest prefix that names it; each must have one.
LAYERS = [
    ("errors, logs, hardware", ["trainer.errors", "trainer.logs", "trainer.hardware", "trainer.platforms"]),
    ("meshes", ["meshes"]),
    ("models", ["models"]),
    ("config (pure)", ["trainer.config"]),
    ("training core", ["trainer.state", "trainer.step", "trainer.optim", "trainer.guard", "trainer.parallel",
                       "trainer.data", "trainer.rl"]),
    ("ckpt, observe, plan", ["trainer.ckpt", "trainer.observe", "trainer.plan"]),
    ("running a job", ["trainer.run"]),
    ("cli and the Python API", ["trainer.cli", "trainer"]),
]


def _files(pkg):
    return sorted((ROOT / pkg).rglob("*.py"))


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            out[".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = f
    return out


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """{module: {module it imports: line}} over every .py file of the packages, read with ast: imports
    inside functions count. `from P import n` is an import of P.n where that is a module, else of P."""
    mods = _modules(root)

    def known(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for m, f in mods.items():
        base = m if f.name == "__init__.py" else m.rpartition(".")[0]
        edges = {}
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    mod = ".".join(base.split(".")[:len(base.split(".")) - node.level + 1] + ([mod] if mod else []))
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else known(mod) for a in node.names]
            else:
                continue
            for t in targets:
                if t and t != m:
                    edges.setdefault(t, node.lineno)
        graph[m] = edges
    return graph


def layer_of(module: str) -> int | None:
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    return None if best is None else best[1]


def upward_imports(graph) -> list[str]:
    """'a (layer) imports b (higher layer) at line n' for every import from a lower layer to a higher one."""
    out = []
    for a, edges in graph.items():
        for b, line in edges.items():
            if layer_of(b) > layer_of(a):
                out.append(f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]}) at line {line}")
    return sorted(out)


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    assert [m for m in import_graph() if layer_of(m) is None] == []


def test_layers_import_only_downward_and_without_cycles():
    graph = import_graph()
    assert upward_imports(graph) == []
    assert cycles(graph) == []


def test_the_trainer_package_keeps_its_jobs_in_subpackages():
    """At most 12 .py files directly in trainer/ (__init__.py included): a new job gets a subpackage."""
    top = sorted(f.name for f in (ROOT / "trainer").glob("*.py"))
    assert len(top) <= 12, top


@pytest.mark.parametrize("target,added,found", [
    # the config reading an HF folder through the checkpoint code: upward, and a circle back to the config
    ("trainer/config/__init__.py", "from trainer.ckpt.hf import with_hf_shapes", "both"),
    # two modules of one layer importing each other: no upward import, but a circle
    ("trainer/data/batches.py", "from trainer.data.prepare import load_tokenizer", "cycle"),
])
def test_the_check_sees_an_added_cycle_or_upward_import(tmp_path, target, added, found):
    """The import check fails on a copy of the packages with one function-local import added."""
    import shutil
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg)
    with open(tmp_path / target, "a") as f:
        f.write(f"\n\ndef _added():\n    {added}\n")
    graph = import_graph(tmp_path)
    assert bool(upward_imports(graph)) == (found == "both"), upward_imports(graph)
    assert cycles(graph), "the added circle was not seen"


def test_importing_a_layer_loads_no_higher_one():
    """At run time too: importing a module (the package __init__s included) loads no module of a higher
    layer. One fresh interpreter per module, run side by side."""
    cases = {"models": ("trainer",),
             "trainer.config": ("trainer.ckpt", "trainer.data", "trainer.parallel", "trainer.plan", "trainer.run",
                                "trainer.observe"),
             "trainer.step": ("trainer.ckpt", "trainer.plan", "trainer.run", "trainer.observe")}
    procs = {m: subprocess.Popen([sys.executable, "-c", f"import sys, {m}; print(sorted(x for x in sys.modules "
                                  f"if x.startswith({bad!r})))"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for m, bad in cases.items()}
    loaded = {m: p.communicate(timeout=120)[0].strip() for m, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), loaded
    assert loaded == {m: "[]" for m in cases}, loaded


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_file_over_400_lines(pkg):
    long = {str(f.relative_to(ROOT)): n for f in _files(pkg) if (n := len(f.read_text().splitlines())) > 400}
    assert not long, long


def long_functions(root: Path, pkg: str, most: int = 60) -> dict[str, int]:
    """Every function (or method) in `pkg` longer than `most` lines, from its def to its last line."""
    out = {}
    for f in sorted((root / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= most:
                out[f"{f.relative_to(root)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return out


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_function_over_60_lines(pkg):
    assert long_functions(ROOT, pkg) == {}


def test_the_60_line_check_sees_a_long_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    lines = lambda n, indent: "".join(f"{indent}x{i} = {i}\n" for i in range(n))  # noqa: E731
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n{lines(59, '    ')}\n\nclass C:\n    def long(self):\n"
                                           f"{lines(60, '        ')}")
    assert long_functions(tmp_path, "pkg") == {"pkg/m.py:64 long": 61}  # 60 lines and its def; `short` has 60


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
        (r"\b(989|494|312|156|459|197|275)(\.0)?\s*(e12|\*\s*1e12)", "trainer/hardware.py"),
    "a link bandwidth in GB/s": (r"\b(450|300|600|200)\s*\*\s*GB\b", "trainer/hardware.py"),
    "the ring all-reduce's 2(K-1)": (r"\b2\s*\*\s*\(\s*[\w.]+\s*-\s*1\s*\)", "trainer/parallel/collective_costs.py"),
    "the ring's (K-1)/K": (r"\(\s*(\w+)\s*-\s*1\s*\)\s*/\s*\1\b", "trainer/parallel/collective_costs.py"),
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
    """The schedules' names are one tuple, trainer/sections.SCHEDULES, with the config's other choices."""
    pattern = r"\(\s*[\"']gpipe[\"'],\s*[\"']1f1b[\"'],\s*[\"']interleaved_1f1b[\"']\s*\)"
    files = [f for pkg in PACKAGES + ("scripts",) for f in _files(pkg)]
    assert sorted({str(f.relative_to(ROOT)) for f in files if re.search(pattern, f.read_text())}) == \
        ["trainer/config/sections.py"]


def _string_literals(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


# files that write a Hugging Face module name which happens to be a parameter's too (peft's modules_to_save lm_head)
HF_MODULE_NAMES = {"lm_head": ("scripts/make_peft_fixture.py",)}


def test_each_parameter_name_is_written_in_the_family_module_and_its_hf_adapter():
    """The Llama inventory (models.inventory) is the one list of parameter names: each name is a string literal in
    the family's module and in its Hugging Face adapter, and elsewhere only in the decoder whose default halves and
    head read them (models/transformer.py) and in another family's that extends the inventory
    (models/families/gemma.py, models/families/moe.py, DeepSeek's family and adapter models/families/deepseek.py,
    models/hf/deepseek.py and its latent attention models/families/mla.py, whose norms and output projection keep
    Llama's names; gpt-oss's family and adapter), nowhere else in the code (tests aside): not in the trainer's
    checkpoint, export or planner code. Names that are also logical axes (embed, layers) are exempt."""
    from models import from_preset, inventory
    inv = inventory(from_preset("tiny", tie_embeddings=False))
    names = (set(inv) | set(inv["layers"])) - {"embed", "layers"}
    assert {"wq", "w_down", "final_norm", "lm_head"} <= names
    files = [f for pkg in PACKAGES + ("scripts",) for f in _files(pkg)]
    literals = {str(f.relative_to(ROOT)): _string_literals(f) for f in files}
    for name in sorted(names):
        where = sorted(f for f, lits in literals.items() if name in lits)
        others = [f for f in where if f not in ("models/hf/llama.py", "models/families/llama.py")]
        assert {"models/hf/llama.py", "models/families/llama.py"} <= set(where), (name, where)
        assert set(others) <= {"models/transformer.py", "models/families/gemma.py", "models/hf/gemma.py",
                               "models/families/moe.py", "models/families/mla.py", "models/families/deepseek.py",
                               "models/hf/deepseek.py", "models/families/gpt_oss.py",
                               "models/hf/gpt_oss.py", *HF_MODULE_NAMES.get(name, ())}, (name, where)


def private_model_imports(root: Path = ROOT) -> list[str]:
    """`from models... import _x` and `models..._x` outside models/: the private names of the model."""
    bad = []
    for f in [f for pkg in PACKAGES + ("scripts", "tests") for f in sorted((root / pkg).rglob("*.py"))]:
        rel = str(f.relative_to(root))
        if rel.startswith("models/"):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "models":
                bad += [f"{rel}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and isinstance(node.value, (ast.Name, ast.Attribute)) and ast.unparse(node.value).split(".")[0]
                  in ("models", "fast_cpu", "transformer", "loss", "attention", "decode")):
                bad.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return bad


def test_no_private_name_of_models_is_used_outside_it(tmp_path):
    assert private_model_imports() == []
    (tmp_path / "models").mkdir()
    for pkg in PACKAGES[::2] + ("scripts", "tests"):
        (tmp_path / pkg).mkdir(exist_ok=True)
    (tmp_path / "trainer" / "x.py").write_text("from models.objectives.objective import _hidden\nimport models\n"
                                               "models.loss._y\n")
    assert private_model_imports(tmp_path) == ["trainer/x.py:1 _hidden", "trainer/x.py:3 models.loss._y"]


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


# What a family declares (models/spec.py): nothing outside the spec module asks a model config by name. A model config,
# for this check: a name the code gives one (CONFIG_NAMES), an attribute `.model` (cfg.model, s.model, run.s.model),
# a call of CONFIG_MAKERS, a name a module or function binds to one of those, and `self` in a class deriving from
# ModelConfig (in its file)
CONFIG_NAMES, CONFIG_MAKERS = {"c", "mc"}, {"model_config", "from_preset"}


def _is_config(node, bound: frozenset, in_config: bool) -> bool:
    if isinstance(node, ast.Name):
        return node.id in CONFIG_NAMES | bound or (node.id == "self" and in_config)
    if isinstance(node, ast.Call):
        return ast.unparse(node.func).split(".")[-1] in CONFIG_MAKERS
    return isinstance(node, ast.Attribute) and node.attr == "model"


def _bound(scope, bound: frozenset, in_config: bool) -> frozenset:
    """The names an assignment in `scope` binds to a model config (pairwise for `a, b = x, y`)."""
    out = set(bound)
    for n in ast.walk(scope):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                pairs = zip(t.elts, n.value.elts) if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple) \
                    else [(t, n.value)]
                out |= {a.id for a, v in pairs if isinstance(a, ast.Name) and _is_config(v, bound, in_config)}
    return frozenset(out)


def _lookups(node, rel: str, bound: frozenset, in_config: bool, classes: set, bad: list) -> None:
    if isinstance(node, ast.ClassDef):
        in_config = any(isinstance(b, ast.Name) and b.id in classes for b in node.bases)
    elif isinstance(node, (ast.Module, ast.FunctionDef, ast.Lambda)):
        bound = _bound(node, bound, in_config)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
            and node.args and _is_config(node.args[0], bound, in_config):
        bad.append(f"{rel}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, ...)")
    for child in ast.iter_child_nodes(node):
        _lookups(child, rel, bound, in_config, classes, bad)


def config_lookups(root: Path = ROOT) -> list[str]:
    """'file:line getattr(obj, ...)' of each getattr/hasattr on a model config in meshes/, models/ and trainer/,
    models/spec.py apart."""
    bad = []
    for f in [f for pkg in PACKAGES for f in sorted((root / pkg).rglob("*.py"))]:
        text, rel = f.read_text(), str(f.relative_to(root))
        if rel != "models/spec.py" and ("getattr(" in text or "hasattr(" in text):
            tree = ast.parse(text)
            classes, grew = {"ModelConfig"}, True
            while grew:  # the file's classes deriving from ModelConfig, through one another
                grew = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                        and any(isinstance(b, ast.Name) and b.id in classes for b in n.bases)} - classes
                classes |= grew
            _lookups(tree, rel, frozenset(), False, classes, bad)
    return bad


def test_no_getattr_or_hasattr_on_a_model_config_outside_the_spec(tmp_path):
    """What the trainer, planner and counters ask of a model is a declared field or hook (models/spec.py); the check
    sees each kind of lookup added (the spec module itself may)."""
    assert config_lookups() == []
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "models" / "spec.py").write_text("def f(c):\n    return getattr(c, 'x')\n")
    (tmp_path / "models" / "fam.py").write_text(
        "class Cfg(ModelConfig):\n    pass\n\n\nclass Sub(Cfg):\n    def w(self):\n        return getattr(self, 'k')\n")
    (tmp_path / "trainer" / "x.py").write_text(
        "def f(cfg, s, mc):\n    m = cfg.model\n    t, n = cfg.train, model_config(cfg)\n"
        "    return getattr(m, 'a'), hasattr(s.model, 'b'), getattr(n, 'c', 0), hasattr(mc, 'd'), getattr(t, 'e')\n")
    assert config_lookups(tmp_path) == ["models/fam.py:7 getattr(self, ...)", "trainer/x.py:4 getattr(m, ...)",
                                        "trainer/x.py:4 hasattr(s.model, ...)", "trainer/x.py:4 getattr(n, ...)",
                                        "trainer/x.py:4 hasattr(mc, ...)"]
