"""The layering of DESIGN.md §4: each layer imports only from the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "digenrl"
RUNTIME = {"base", "_wire", "_node", "_mailbox", "_agent", "_child", "process", "system", "worker", "__init__"}

# What each layer may import from digenrl (besides itself and digenrl.errors).
ALLOWED: dict[str, set[str]] = {
    "transport": set(),
    "runtime": {"transport"},
    "models": set(),
    "rewards": set(),
    "rl": {"models"},
    "schedule": set(),
    "sim": {"schedule"},
}


def _layer_of(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE).parts
    if parts[0] == "actors":
        return "runtime" if path.stem in RUNTIME else None
    return parts[0] if parts[0] in ALLOWED else None


def _imported_layers(path: Path) -> set[str]:
    layers: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] != "digenrl" or len(parts) < 2 or parts[1] == "errors":
                continue
            if parts[1] == "actors":
                layers.add("runtime" if len(parts) < 3 or parts[2] in RUNTIME else "roles")
            else:
                layers.add(parts[1])
    return layers


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if _layer_of(p)), ids=str)
def test_no_upward_imports(path: Path) -> None:
    layer = _layer_of(path)
    assert layer is not None
    upward = _imported_layers(path) - ALLOWED[layer] - {layer}
    assert not upward, f"{path.relative_to(PACKAGE)} (layer {layer}) imports {sorted(upward)}"
