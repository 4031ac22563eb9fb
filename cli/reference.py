"""``digenrl config-reference``: every configuration key, generated from the config classes themselves.

The reference is read from ``digenrl/config.py``: each ``[table]`` is a frozen dataclass of ``Config``, its
docstring the table's introduction, each field a key with its default (from the dataclass), its type (from
the annotation), the comments written beside and above it in the source, and the values its
``__post_init__`` allows (``_choice(key, value, CHOICES)``) or requires (``_check(key, ok, what, value)``).
Nothing is written twice, so the page cannot drift from the code: ``tests/test_docs.py`` regenerates it and
compares it with ``docs/configuration.md``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import re
import tokenize
from pathlib import Path
from typing import Any

import typer


HEADER = """\
# Configuration reference

Every key of a run's TOML file, table by table, with its default. Generated from `digenrl/config.py` by
`digenrl config-reference --out docs/configuration.md` (the tests check that this page is what the code says:
edit the code, not this page). `--set table.key=value` overrides any key on the command line;
`digenrl validate CONFIG` lists every problem of a file at once. Shipped configs: `configs/*.toml`.
"""


def _toml(value: Any) -> str:
    """A default as it would be written in a config file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }" if value else "{}"
    return repr(value)


def _comments(source: str) -> dict[int, str]:
    """The comment on each line of ``source`` (1-based), found by the tokenizer (a '#' in a string is none)."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string.lstrip("#").strip()
    return found


def _prose(text: str) -> str:
    """reST-ish docstring text as one Markdown paragraph per blank-line block (``x`` -> `x`, escaped pipes)."""
    text = inspect.cleandoc(text).replace("``", "`")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paragraphs if p)


def _choices(node: ast.expr, fn: ast.FunctionDef, config_module: Any) -> tuple[Any, ...] | None:
    """The allowed values a ``_choice`` call names: a literal tuple, or a tuple constant of the config module
    (or of a module ``__post_init__`` imports it from), possibly wrapped in ``tuple(...)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "tuple" and node.args:
        node = node.args[0]
    if isinstance(node, ast.Tuple):
        try:
            return tuple(ast.literal_eval(node))
        except ValueError:
            return None
    if not isinstance(node, ast.Name):
        return None
    value = None
    for imp in ast.walk(fn):  # a name imported inside __post_init__ shadows the module's
        if isinstance(imp, ast.ImportFrom) and imp.module:
            for alias in imp.names:
                if (alias.asname or alias.name) == node.id:
                    value = getattr(importlib.import_module(imp.module), alias.name, None)
    if value is None:
        value = getattr(config_module, node.id, None)
    return tuple(value) if isinstance(value, (tuple, list, dict)) else None


def _key(node: ast.expr) -> str | None:
    """A check's key: a string, or an f-string's literal head (``f"reward.weights.{name}"`` -> reward.weights)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value).rstrip(".")
    return None


def _allowed(cls_node: ast.ClassDef, config_module: Any) -> dict[str, list[str]]:
    """Per key, what ``__post_init__`` says of it: the choices of ``_choice`` and the ``what`` of ``_check``."""
    said: dict[str, list[str]] = {}
    for fn in cls_node.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "__post_init__"):
            continue
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) >= 3):
                continue
            key = _key(call.args[0])
            if key is None:
                continue
            if call.func.id == "_choice" and (choices := _choices(call.args[2], fn, config_module)) is not None:
                text = "one of " + ", ".join(f"`{_toml(c)}`" for c in choices)
                if text not in said.get(key, []):
                    said.setdefault(key, []).append(text)
            elif call.func.id == "_check" and isinstance(call.args[2], ast.Constant):
                said.setdefault(key, []).append(f"must be {call.args[2].value}")
    return said


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("``", "`")


def _table(name: str, cls: type, node: ast.ClassDef, comments: dict[int, str], lines: list[str],
           config_module: Any) -> str:
    allowed = _allowed(node, config_module)
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())  # type: ignore[misc]
                for f in dataclasses.fields(cls)}
    rows = []
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        key = stmt.target.id
        above, line = [], stmt.lineno - 1
        while line >= 1 and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        what = " ".join(x for x in (*above, comments.get(stmt.lineno, "")) if x)
        what = " ".join([what, *(f"({a})" for a in allowed.get(f"{name}.{key}", []))]).strip()
        rows.append(f"| `{key}` | `{_cell(_toml(defaults[key]))}` | {_cell(ast.unparse(stmt.annotation))} | "
                    f"{_cell(what)} |")
    doc = _prose(inspect.getdoc(cls) or "")
    return "\n".join([f"## `[{name}]`", "", _cell(doc).replace("\\|", "|"), "",
                      "| key | default | type | what it does |", "|---|---|---|---|", *rows, ""])


def reference() -> str:
    """The whole reference page, as Markdown."""
    from digenrl import config as config_module

    source = inspect.getsource(config_module)
    tree, comments, lines = ast.parse(source), _comments(source), source.splitlines()
    nodes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    parts = [HEADER]
    for f in dataclasses.fields(config_module.Config):
        cls = f.default_factory  # type: ignore[misc]
        parts.append(_table(f.name, cls, nodes[cls.__name__], comments, lines, config_module))  # type: ignore[union-attr]
    return "\n".join(parts)


def register(app: typer.Typer) -> None:
    @app.command("config-reference")
    def config_reference(out: Path | None = typer.Option(None, "--out", help="write here (default: print)")) -> None:
        """Print (or write) every configuration key with its default, generated from the config classes."""
        text = reference()
        if out is None:
            typer.echo(text, nl=False)
        else:
            out.write_text(text)
            typer.echo(f"wrote {out}")
