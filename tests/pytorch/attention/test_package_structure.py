"""The repository's rules that a reader should not have to re-check by hand: short functions,
one home per name (no re-export shims), one immutable prepared call, an import graph without
loops whose arrows run from cp/ to backends/; every test file run by the QA script; the
README's Python floor true for what its commands install."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "transformer_engine"
DPA = "transformer_engine.pytorch.attention.dot_product_attention"
MAX_BODY_LINES = 60


def _body_lines(node: ast.FunctionDef) -> int:
    """Lines from the first statement after the signature and docstring to the end: TE's long
    signatures (DotProductAttention.forward's 25 arguments) are TE's, not ours to shorten."""
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def _long_functions(source: str, name: str):
    return [(f"{name}:{node.lineno} {node.name}", _body_lines(node)) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > MAX_BODY_LINES]


def test_no_function_body_passes_sixty_lines():
    long = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _long_functions(path.read_text(), str(path.relative_to(ROOT)))]
    assert long == [], f"functions over {MAX_BODY_LINES} lines (split them): {long}"


def test_the_line_count_counts_the_body_not_the_signature_or_docstring():
    signature = "def f(\n" + "".join(f"    a{i}=None,\n" for i in range(80)) + "):\n"
    short = signature + '    """Doc.\n\n    More.\n    """\n' + "    x = 1\n" * 60
    assert _long_functions(short, "m") == []
    assert _long_functions(short + "    return x\n", "m") == [("m:1 f", 61)]


def test_utils_holds_only_te_names_and_backends_no_private_ones():
    utils = importlib.import_module(f"{DPA}.utils")
    public = {n for n in vars(utils) if not n.startswith("__")}
    assert public == {"AttentionLogging", "AttentionParams", "get_attention_backend", "get_qkv_layout"}
    backends = importlib.import_module(f"{DPA}.backends")
    private = {n for n, v in vars(backends).items() if n.startswith("_") and not n.startswith("__") and not isinstance(v, type(utils))}
    assert private == set()


def test_attention_inputs_is_one_frozen_record():
    from transformer_engine.pytorch.attention.dot_product_attention.prepare.inputs import AttentionInputs

    assert AttentionInputs.__dataclass_params__.frozen
    assert "bias_shape" in {f.name for f in dataclasses.fields(AttentionInputs)}  # derived once, in the record


# ---------------------------------------------------------------------------------- the import graph


def _module_files():
    """{dotted module name: path} of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules) -> set:
    """The package's modules ``name`` imports anywhere in its file (function-level imports
    too: a loop hidden in a function body is still a loop). ``from P import x`` names P.x when
    that is a module, else P itself."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            if target in modules:
                subs = {f"{target}.{a.name}" for a in node.names}
                out.update(subs & modules.keys())
                if not subs <= modules.keys():
                    out.add(target)
    return out


def _import_graph():
    modules = _module_files()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph):
    """One import cycle of ``graph`` as a list of modules, or None."""
    state, stack = {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = "done"
        return None

    for u in sorted(graph):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def test_every_module_imports():
    for name in _module_files():
        importlib.import_module(name)


def test_backends_import_nothing_from_cp():
    """Arrows run from cp/ to backends/, never back: a backend knows nothing of CP."""
    cp = f"{DPA}.cp"
    hits = [(name, sorted(t for t in targets if t == cp or t.startswith(cp + "."))) for name, targets in _import_graph().items()
            if name.startswith(f"{DPA}.backends")]
    assert [h for h in hits if h[1]] == []


def test_no_import_cycle():
    """No loop anywhere in the package; in particular none between cp/ and the module (the a2a
    path once built a nested DotProductAttention)."""
    graph = _import_graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    reach, todo = set(), [n for n in graph if n.startswith(f"{DPA}.cp")]
    while todo:
        for t in graph[todo.pop()] - reach:
            reach.add(t)
            todo.append(t)
    assert f"{DPA}.dot_product_attention" not in reach


def test_the_cycle_finder_finds_a_loop():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_backends_running_span_schedules_declare_their_kernel_interface():
    """cp/ asks the selected backend for KERNEL (no label map): every backend declaring a ring
    or all-gather comm type names a class with the kernel interface; the others name None."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends import BACKENDS

    for cls in BACKENDS:
        if cls.CP_COMM_TYPES - {"a2a"}:
            assert all(callable(getattr(cls.KERNEL, m, None)) for m in ("forward", "backward", "stats_to_rows", "stats_from_rows")), cls
        else:
            assert cls.KERNEL is None, cls


# ---------------------------------------------------------------------------------- docstring references
# A file move leaves docstrings naming the old home (``:mod:`.fast_path``` after fast_path.py
# moved into prepare/). Every relative Sphinx target is resolved the way Python resolves a
# relative import from the file that writes it: one dot is the file's own package, each further
# dot one package up; the dotted rest is the longest importable module prefix followed by
# attributes (a class, a function, a method, a module-level constant).

_RELATIVE_REF = re.compile(r":(mod|func|class|meth|attr|data|obj):`[~!]?(\.+)([\w.]+)`")


def _resolve(dotted: str, want_module: bool) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        if want_module and cut < len(parts):
            return False
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _relative_refs():
    """(where, role, absolute target) for every relative target written in the package's files."""
    for name, path in _module_files().items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for match in _RELATIVE_REF.finditer(path.read_text()):
            role, dots, rest = match.groups()
            base = package.split(".")[: len(package.split(".")) - len(dots) + 1]
            line = path.read_text().count("\n", 0, match.start()) + 1
            yield f"{path.relative_to(ROOT)}:{line}", role, ".".join(base + [rest])


def test_relative_docstring_references_resolve():
    refs = list(_relative_refs())
    assert len(refs) > 50  # the pattern still finds what the package writes
    broken = [f"{where} :{role}:`{target}`" for where, role, target in refs if not _resolve(target, role == "mod")]
    assert broken == [], "relative :role:`.target` references naming nothing (moved or renamed?):\n" + "\n".join(broken)


def test_the_reference_resolver_tells_modules_from_attributes():
    assert _resolve(f"{DPA}.prepare.fast_path", want_module=True)
    assert not _resolve(f"{DPA}.fast_path", want_module=True)
    assert _resolve(f"{DPA}.prepare.inputs.AttentionInputs", want_module=False)
    assert not _resolve(f"{DPA}.prepare.inputs.AttentionInputs", want_module=True)
    assert not _resolve(f"{DPA}.prepare.inputs.NoSuchName", want_module=False)


# ---------------------------------------------------------------------------------- the QA script


def test_every_test_file_is_listed_in_the_qa_script():
    """Upstream once shipped a test file that its QA script silently skipped."""
    script = (ROOT / "qa" / "L0_pytorch_unittest" / "test.sh").read_text()
    listed = set(re.findall(r"^run_file (\S+)", script, flags=re.M))
    present = {p.name for p in (ROOT / "tests" / "pytorch" / "attention").glob("test_*.py")}
    assert present - listed == set(), f"test files not run by test.sh: {sorted(present - listed)}"
    assert listed - present == set(), f"test.sh runs files that do not exist: {sorted(listed - present)}"


def _gpu_marks(source: str):
    """(whether the module sets ``pytestmark = pytest.mark.gpu``, how many tests are decorated
    with ``pytest.mark.gpu`` one by one)."""
    tree = ast.parse(source)
    module = any(isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["pytestmark"]
                 and ast.unparse(n.value) == "pytest.mark.gpu" for n in tree.body)
    decorated = sum(ast.unparse(d) == "pytest.mark.gpu" for n in ast.walk(tree)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) for d in n.decorator_list)
    return module, decorated


def test_gpu_tests_live_in_gpu_files_and_nowhere_else():
    """One marker per file: test_gpu_*.py files mark every test gpu (module-level pytestmark),
    other test files mark none, so the QA script may skip GPU files whole on a CPU machine."""
    mixed = []
    for path in sorted((ROOT / "tests" / "pytorch" / "attention").glob("test_*.py")):
        module, decorated = _gpu_marks(path.read_text())
        if module != path.name.startswith("test_gpu_") or decorated:
            mixed.append(path.name)
    assert mixed == [], f"files mixing GPU and CPU tests (or GPU files without pytestmark = pytest.mark.gpu): {mixed}"


# ---------------------------------------------------------------------------------- the README's Python floor
# The quick start states a Python floor for both of its commands; CI runs them on that floor. This
# fails if the README's number drifts below what the pinned torch or the test extra's packages
# demand, or above the interpreter CI runs.


def _stated_floor() -> tuple:
    match = re.search(r"only Python (\d+)\.(\d+) or newer", (ROOT / "README.md").read_text())
    assert match, "the README's quick start must state its Python floor as 'only Python X.Y or newer'"
    return int(match.group(1)), int(match.group(2))


def test_the_interpreter_meets_the_stated_floor():
    assert sys.version_info[:2] >= _stated_floor()


@pytest.mark.parametrize("package", ["torch", "megatron-core"])
def test_the_stated_floor_satisfies_what_the_commands_install(package):
    """The installed distribution's Requires-Python admits the stated floor."""
    try:
        requires = importlib.metadata.metadata(package)["Requires-Python"]
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{package} is not installed (the test extra installs it)")
    if not requires:
        return
    major, minor = _stated_floor()
    assert SpecifierSet(requires).contains(f"{major}.{minor}"), f"{package} needs Python {requires}; the README says {major}.{minor}"
