"""The dependency rule: data -> attention/model -> tasks -> report (bench uses data/attention/model).

`interop` (s3prl expert) reads upstreams through `model` and is imported by no layer; the
repository's `hubconf.py` may use `model` and `interop` only.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "speechattn"

# For each layer, the project layers it may import from (besides itself).
ALLOWED = {
    "data": set(),
    "attention": set(),
    "model": {"data", "attention"},
    "tasks": {"data", "attention", "model"},
    "report": {"data", "attention", "model", "tasks"},
    "bench": {"data", "attention", "model"},
    "interop": {"data", "attention", "model"},
}


def project_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    layers = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "speechattn" and len(parts) > 1:
                layers.add(parts[1])
    return layers


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_from_the_left(layer):
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, f"no modules under speechattn/{layer}/: the rule would hold vacuously"
    offenders = []
    for path in files:
        bad = project_imports(path) & (set(ALLOWED) - ALLOWED[layer] - {layer})
        if bad:
            offenders.append(f"{path.relative_to(PACKAGE)} imports {sorted(bad)}")
    assert not offenders, "dependency rule broken:\n" + "\n".join(offenders)


def test_hubconf_uses_only_the_upstream_api():
    used = project_imports(PACKAGE.parent / "hubconf.py")
    assert used and used <= {"model", "interop"}, sorted(used)


def test_shared_helpers_import_nothing_from_the_project():
    """`speechattn.utils` is used by every layer, so it may use none of them."""
    assert project_imports(PACKAGE / "utils.py") == set()
