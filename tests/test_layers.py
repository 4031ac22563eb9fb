"""The layering of DESIGN.md §4: each layer imports only from the layers below it.

transport → actors (the generic runtime) → telemetry → data / models / rewards → rl → schedule →
sim, config → policy → algorithms → roles → recipes, plan (→ cli). ``digenrl.errors`` and ``digenrl.usercode`` (the
user's own Python files, imported only where allowed) are the ground every layer may use; they import no other layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "digenrl"

# What each layer may import from digenrl (besides itself and digenrl.errors).
_CORE = {"transport", "actors", "telemetry"}
ALLOWED: dict[str, set[str]] = {
    "transport": set(),
    "actors": {"transport"},
    "telemetry": set(),
    "data": set(),
    "models": set(),
    "rewards": set(),
    "rl": {"models"},
    "schedule": set(),
    "sim": {"schedule", "telemetry"},
    "config": {"schedule", "data", "models", "rewards", "rl", "sim"},
    "policy": {"config", "models", "rl"},
    "algorithms": {"config", "policy", "models", "rl"},
    "roles": _CORE | {"config", "policy", "algorithms", "data", "models", "rewards", "rl", "schedule"},
    "recipes": _CORE | {"config", "policy", "algorithms", "roles", "data", "models", "rewards", "rl", "schedule", "sim"},
    "doctor": _CORE | {"config", "recipes", "models"},
    "plan": {"config", "policy", "algorithms", "models", "schedule", "sim", "telemetry"},
}


def _layer(parts: tuple[str, ...]) -> str | None:
    name = parts[0].removesuffix(".py")
    return name if name in ALLOWED else None


GROUND = ("errors", "usercode")


def _imported_layers(path: Path) -> set[str]:
    layers: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from digenrl import config` imports the module digenrl.config
            names = [f"digenrl.{a.name}" for a in node.names] if node.module == "digenrl" else [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "digenrl" and len(parts) >= 2 and parts[1] not in GROUND:
                layers.add(parts[1])
    return layers


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py")
                                        if _layer(p.relative_to(PACKAGE).parts)), ids=str)
def test_no_upward_imports(path: Path) -> None:
    layer = _layer(path.relative_to(PACKAGE).parts)
    assert layer is not None
    upward = _imported_layers(path) - ALLOWED[layer] - {layer}
    assert not upward, f"{path.relative_to(PACKAGE)} (layer {layer}) imports {sorted(upward)}"


def test_every_module_belongs_to_a_layer() -> None:
    """A new package or top-level module must take its place in the layering first."""
    stray = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if not _layer(p.relative_to(PACKAGE).parts) and p.relative_to(PACKAGE).parts[0]
             not in ("__init__.py", *(f"{g}.py" for g in GROUND))]
    assert not stray, f"modules outside the layering: {stray}"


def test_the_runtime_holds_only_runtime_files() -> None:
    """digenrl/actors is what a user embeds: no RL role lives there."""
    files = {p.stem for p in (PACKAGE / "actors").glob("*.py")}
    assert files == {"__init__", "base", "_context", "_mailbox", "_node", "_wire", "_agent", "_child", "process",
                     "system", "worker", "allowlist", "loop"}


def test_every_package_ships_in_the_wheel() -> None:
    """pyproject.toml lists the packages explicitly: a new one must be added there too."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


@pytest.mark.parametrize("name", GROUND)
def test_the_ground_imports_no_layer(name: str) -> None:
    assert not _imported_layers(PACKAGE / f"{name}.py"), f"digenrl/{name}.py may import only the ground"
