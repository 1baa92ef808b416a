"""The dependency rule: data -> attention/model -> tasks -> report; bench sits beside report
(it measures the tasks' own training step and composes their config).

Every import counts, including the lazy ones inside functions and relative ones. Besides the
layers: `speechattn.utils` (shared helpers) and `speechattn.errors` (the error base) import
nothing from the project and any layer may use them; the root package (`speechattn/__init__.py`)
imports nothing eagerly; `config` sits on data, model and tasks; the entry modules (`pretrain`, `downstream`, `analyze`) may use every
layer but `bench`; `export` uses `tasks` only. Inside `tasks` the jobs are independent, except that the head analysis reads
downstream runs: `pretrain` and `downstream` import no other job, `analysis` only `downstream`,
`abx` only `downstream` (its feature extraction).
`interop` (s3prl expert) reads upstreams through `model` and is imported by no layer; the
repository's `hubconf.py` may use `model` and `interop` only. `superb` (s3prl's SUPERB runner
with our upstreams) sits beside `interop` and `report`: it uses the built-in corpus (`data`),
the expert (`interop`) and the record it writes for the report (`tasks.records`), and no layer
imports it. No two modules import each other, directly or through others (`test_no_import_circles`).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "speechattn"

# For each layer, the project layers it may import from (besides itself and `utils`).
ALLOWED = {
    "data": set(),
    "attention": set(),
    "model": {"data", "attention"},
    "tasks": {"data", "attention", "model"},
    "report": {"data", "attention", "model", "tasks"},
    "bench": {"config", "data", "attention", "model", "tasks"},
    "interop": {"data", "attention", "model"},
    "superb": {"data", "attention", "model", "tasks", "interop"},
}
ROOT_MODULES = {
    "utils": set(),
    "errors": set(),
    "config": {"data", "attention", "model", "tasks"},
    "pretrain": {"config", "data", "attention", "model", "tasks"},
    "downstream": {"config", "data", "attention", "model", "tasks"},
    "analyze": {"config", "data", "attention", "model", "tasks", "report"},
    "prune": {"config", "tasks"},
    "export": {"tasks"},
    "abx": {"config", "tasks"},
}
JOBS = {"pretrain": set(), "downstream": set(), "analysis": {"downstream"}, "abx": {"downstream"}}
# "" is the root package itself (version, CONFIG_DIR, load_upstream); `errors` holds the base
# of every error raised on purpose, so any layer may raise one.
EVERYWHERE = {"utils", "errors", ""}


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def imported_modules(path: Path, lazy: bool = True) -> set[str]:
    """Absolute names of the project modules `path` imports (module level only: lazy=False)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    nodes = ast.walk(tree) if lazy else tree.body
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this file's package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names |= {base} | {
                f"{base}.{alias.name}"
                for alias in node.names
                if is_module(f"{base}.{alias.name}")  # `from speechattn import tasks`
            }
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
            if node.args and isinstance(node.args[0], ast.Constant):
                names.add(str(node.args[0].value))
    return {n for n in names if n == "speechattn" or n.startswith("speechattn.")}


def project_imports(path: Path, lazy: bool = True) -> set[str]:
    """The project layers / root modules `path` imports ("" for the root package)."""
    return {(n.split(".") + [""])[1] for n in imported_modules(path, lazy)}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_from_the_left(layer):
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, f"no modules under speechattn/{layer}/: the rule would hold vacuously"
    offenders = []
    for path in files:
        bad = project_imports(path) - ALLOWED[layer] - {layer} - EVERYWHERE
        if bad:
            offenders.append(f"{path.relative_to(PACKAGE)} imports {sorted(bad)}")
    assert not offenders, "dependency rule broken:\n" + "\n".join(offenders)


@pytest.mark.parametrize("module", sorted(ROOT_MODULES))
def test_root_modules_import_only_what_they_sit_on(module):
    used = project_imports(PACKAGE / f"{module}.py") - {module} - {"utils", "errors"}
    allowed = ROOT_MODULES[module] | ({""} if module not in ("utils", "errors") else set())
    assert used <= allowed, f"speechattn/{module}.py imports {sorted(used - allowed)}"


def test_every_root_module_is_covered():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(ROOT_MODULES), "add new root modules to ROOT_MODULES"


def test_the_root_package_imports_nothing_eagerly():
    """`import speechattn` stays cheap: only lazy imports inside its functions."""
    assert project_imports(PACKAGE / "__init__.py", lazy=False) == set()


@pytest.mark.parametrize("job", sorted(JOBS))
def test_jobs_are_independent(job):
    files = sorted((PACKAGE / "tasks" / job).rglob("*.py"))
    assert files, f"no modules under speechattn/tasks/{job}/"
    for path in files:
        used = {
            n.split(".")[2]
            for n in imported_modules(path)
            if n.startswith("speechattn.tasks.") and n.split(".")[2] in JOBS
        }
        bad = used - JOBS[job] - {job}
        assert not bad, f"{path.relative_to(PACKAGE)} imports the jobs {sorted(bad)}"


def test_hubconf_uses_only_the_upstream_api():
    used = project_imports(PACKAGE.parent / "hubconf.py")
    assert used and used - EVERYWHERE <= {"model", "interop"}, sorted(used)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circles():
    """No module imports, directly or through others, a module that imports it back (lazy
    imports inside functions included): every dependency runs one way."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: {m for m in imported_modules(path) if m in files and m != name}
        for name, path in files.items()
    }
    # a package's __init__ re-exporting its modules is not a circle: skip edges to parents
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)
