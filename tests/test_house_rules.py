"""The house rules, read from the code's own imports (no import is executed).

* no import cycle between modules of ``forgeflow/``;
* the packages of ``forgeflow/`` import one way, in :data:`PACKAGE_ORDER` (a package imports only
  packages before it; ``forgeflow/config.py`` sits above them all);
* ``forgeflow/`` imports no Prefect; ``tasks/`` imports no ``flows/`` or ``deployments/``;
  ``flows/`` imports no ``deployments/``; ``blocks/`` imports no ``tasks/``, ``flows/`` or
  ``deployments/``.

Imports inside functions and ``TYPE_CHECKING`` blocks count too: a cycle hidden in a function is
still a cycle of the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_ORDER = ("common", "ledger", "registry", "sandbox", "curation", "evaluation", "training", "packaging",
                 "serving")
"""forgeflow's packages, lowest first (also written in the README's layout section)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(folder: str) -> dict[str, Path]:
    return {_module_name(p): p for p in (ROOT / folder).rglob("*.py")
            if "migrations" not in p.parts and "data" not in p.relative_to(ROOT / folder).parts[:1]}


def _imports(path: Path) -> set[str]:
    """Every dotted name ``path`` imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def _with_packages(name: str, imported: set[str]) -> set[str]:
    """``imported`` plus the packages it loads first: importing ``a.b.c`` runs ``a/b/__init__.py``
    (unless the importer sits inside ``a.b``, which is then already loading)."""
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    out = set(imported)
    for dotted in imported:
        parts = dotted.split(".")
        out.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p not in own)
    return out


CORE = _sources("forgeflow")
EDGES = {name: {i for i in _with_packages(name, _imports(path)) if i in CORE and i != name}
         for name, path in CORE.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan 1972)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(EDGES[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(EDGES):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_core() -> None:
    assert _cycles() == []


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in PACKAGE_ORDER) else None


def test_packages_import_only_packages_below_them() -> None:
    rank = {p: i for i, p in enumerate(PACKAGE_ORDER)}
    assert {p.name for p in (ROOT / "forgeflow").iterdir() if p.is_dir() and (p / "__init__.py").exists()} \
        == set(PACKAGE_ORDER)
    wrong = []
    for module, targets in EDGES.items():
        here = _package(module)
        for target in targets:
            there = _package(target)
            if module == "forgeflow.config" or here is None or there is None:
                continue
            if rank[there] > rank[here]:
                wrong.append(f"{module} -> {target}")
    assert wrong == [], "imports against the package order " + " < ".join(PACKAGE_ORDER)
    assert not any(_package(t) is None and t != "forgeflow" for ts in EDGES.values() for t in ts
                   if t == "forgeflow.config"), "nothing in forgeflow/ imports forgeflow.config"


@pytest.mark.parametrize(("folder", "forbidden"), [
    ("forgeflow", ("prefect", "tasks", "flows", "blocks", "deployments")),
    ("tasks", ("flows", "deployments")),
    ("flows", ("deployments",)),
    ("blocks", ("tasks", "flows", "deployments")),
])
def test_layers_import_one_way(folder: str, forbidden: tuple[str, ...]) -> None:
    wrong = sorted(f"{name}: {imported}" for name, path in _sources(folder).items() for imported in _imports(path)
                   if imported.split(".")[0] in forbidden)
    assert wrong == []


def test_no_test_is_skipped_for_a_busy_port_or_a_missing_component() -> None:
    """A test that needs a server takes a free port (tests/helpers.py ``free_port``) and fails when
    the component it starts is missing: never ``pytest.skip`` because a port was busy or a tool
    that scripts/setup.sh installs is absent."""
    words = ("in use", "not installed", "missing", "port")
    wrong = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "skip"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest"):
                text = ast.unparse(node)
                if any(w in text for w in words) or (node.args and isinstance(node.args[0], ast.Name)):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert wrong == []


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 9
CODE_FOLDERS = ("forgeflow", "tasks", "flows", "blocks", "deployments")
SIZE_EXEMPT = {"forgeflow/ledger/tables.py"}
"""Tables are one declaration per column: long by nature, one job."""


def _code_files() -> list[Path]:
    return sorted(p for folder in CODE_FOLDERS for p in (ROOT / folder).rglob("*.py")
                  if "migrations" not in p.parts and str(p.relative_to(ROOT)) not in SIZE_EXEMPT)


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path)))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body without its docstring."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return 0 if not body else body[-1].end_lineno - body[0].lineno + 1  # type: ignore[operator]


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)


def _is_cli_command(path: Path, node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A typer command: its parameters are the command's options (flags a person types), declared
    one by one so ``--help`` lists them; they are not an internal call's argument list."""
    return path.parent.name == "cli" and any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
        for d in node.decorator_list)


def test_no_module_over_the_size_of_one_job() -> None:
    lines = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8").count("\n") for p in _code_files()}
    assert {p: n for p, n in lines.items() if n > MAX_MODULE_LINES} == {}


def test_no_function_over_eighty_lines() -> None:
    long = {f"{p.relative_to(ROOT)}:{n.name}": _body_lines(n) for p in _code_files() for n in _functions(p)
            if _body_lines(n) > MAX_FUNCTION_LINES}
    assert long == {}


def test_ten_parameters_or_more_take_a_parameter_object() -> None:
    """Flows included: a stage flow takes its inputs as typed parameter models (nested forms in the
    Prefect UI), not as a long flat list."""
    many = {f"{p.relative_to(ROOT)}:{n.name}": _parameters(n) for p in _code_files() for n in _functions(p)
            if _parameters(n) > MAX_PARAMETERS and not _is_cli_command(p, n)}
    assert many == {}


IO_CALLS = frozenset({"Store", "sha256_file", "sha256_tree", "atomic_write_text", "atomic_write_bytes", "read_state",
                      "read_jsonl_objects", "open", "upgrade", "read_text", "write_text", "read_bytes", "write_bytes"})
"""Calls that read or write the store or files: in ``flows/`` only inside tasks (``tasks/``), where they are
retried, cached or at least shown as task runs."""


def test_no_store_or_file_io_in_a_flow_body() -> None:
    """DESIGN.md's rule "no I/O in a flow body outside a task", read from the calls of ``flows/``: the store
    (``Store(...)``, ``.upgrade()``), file digests and atomic writes, the serving state file and raw file reads
    go through a task. ``flows/stagekit.py`` is exempt: it writes the run's own ``summary.json``."""
    found = []
    for path in sorted((ROOT / "flows").glob("*.py")):
        if path.name == "stagekit.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = (node.func.id if isinstance(node.func, ast.Name)
                        else node.func.attr if isinstance(node.func, ast.Attribute) else None)
                if name in IO_CALLS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}(...)")
    assert found == []


def _names_any(annotation: ast.expr | None) -> bool:
    """Whether an annotation (a string one parsed too) names ``Any`` or ``typing.Any``."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return any(isinstance(n, ast.Name) and n.id == "Any" or isinstance(n, ast.Attribute) and n.attr == "Any"
               for n in ast.walk(annotation))


def test_no_any_in_a_task_signature() -> None:
    """Issue 35: every parameter and return of a function in ``tasks/`` (nested ones too) has a real type
    (a model, a TypedDict, ``forgeflow.common.fsutil.JSONObject`` for a free-form document), never ``Any``."""
    found = []
    for path in sorted((ROOT / "tasks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, [args.vararg, args.kwarg])]
                found += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}({a.arg})" for a in params
                          if _names_any(a.annotation)]
                if _names_any(node.returns):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} -> Any")
    assert found == []


def test_tasks_open_the_store_one_way() -> None:
    """Issue 35: a task reaches the store through ``tasks.common.shared_store`` only (never ``Store(...)`` nor
    ``.dispose()``), so one rule says which engine a task uses and who disposes it."""
    found = []
    for path in sorted((ROOT / "tasks").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        exempt = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "shared_store"
                  for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and id(node) not in exempt:
                name = (node.func.id if isinstance(node.func, ast.Name)
                        else node.func.attr if isinstance(node.func, ast.Attribute) else None)
                if name in ("Store", "dispose"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}(...)")
    assert found == []
