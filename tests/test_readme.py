"""README.md works when copied (issue 29): its Python blocks are the files they name, or run as written,
and every command it gives runs after the quick start (the venv activated, or spelled `.venv/bin/...`),
naming a real subcommand, script or module and real options."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer

from digenrl_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
PY_FILE = re.compile(r"(?<![\w./-])([\w./-]+\.py)\b")
ACTIVATE = "source .venv/bin/activate"


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    named: tuple[str, ...]  # the repository files the block says it is


def _python_blocks() -> list[Block]:
    """Every ```python block, with the files named by its first line, the line above it or the line below."""
    blocks = []
    for m in FENCE.finditer(README):
        if m.group(1).strip().lower() not in ("python", "py", "python3"):
            continue
        before = README[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        after = README[m.end():].lstrip("\n").split("\n", 1)[0]
        first = m.group(2).split("\n", 1)[0]
        around = [before, after] + ([first] if first.lstrip().startswith(("#", '"""', "'''")) else [])
        named = {p for text in around for p in PY_FILE.findall(text) if (ROOT / p).is_file()}
        blocks.append(Block(README.count("\n", 0, m.start()) + 1, m.group(2), tuple(sorted(named))))
    return blocks


BLOCKS = _python_blocks()


def test_the_readme_has_python_blocks() -> None:
    assert BLOCKS, "no ```python block found: the extraction is broken, or the README lost its example"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_each_python_block_is_the_file_it_names_or_runs(block: Block, tmp_path: Path) -> None:
    """A block naming a file (e.g. `examples/hello_actor.py`) must be that file, byte for byte: a reader
    copies the block, the tests run the file. A block naming none is run here as a reader would."""
    assert len(block.named) <= 1, f"README.md:{block.line}: the block names several files {block.named}"
    if block.named:
        path = ROOT / block.named[0]
        assert block.code.encode() == path.read_bytes(), (
            f"README.md:{block.line}: the block differs from {block.named[0]}, which it says it is")
        return
    script = tmp_path / f"readme_line{block.line}.py"
    script.write_text(block.code)
    # this checkout ahead of the inherited PYTHONPATH (as tests.conftest.child_env): the block saved elsewhere
    # imports the digenrl under test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"README.md:{block.line} exits {out.returncode}:\n{out.stderr[-3000:]}"


# -- commands ---------------------------------------------------------------------------------------------

COMMAND = re.compile(r"(?<![\w./-])((?:\.venv/bin/)?(?:digenrl|python)) ")
PROMPT = re.compile(r"^\s*[\w.-]*\$ ")  # node0$ ..., $ ...


@dataclass(frozen=True)
class Command:
    line: int
    text: str


def _blank(text: str, start: int, end: int) -> str:
    """``text`` with [start, end) replaced by newlines and spaces: offsets (and line numbers) stay put."""
    return text[:start] + "".join(c if c == "\n" else " " for c in text[start:end]) + text[end:]


def _commands() -> list[Command]:
    """Every `digenrl ...` / `python ...` command line of the README: in code spans and indented blocks."""
    text = README
    for m in FENCE.finditer(README):
        text = _blank(text, m.start(), m.end())
    found: list[tuple[int, str]] = []
    offset, start, previous_blank, in_block, pending = 0, 0, True, False, ""
    for line in text.split("\n"):  # indented blocks: one command per line, `\` continuing it
        in_block = line.startswith("    ") and line.strip() != "" and (previous_blank or in_block)
        if in_block:
            start = start if pending else offset
            logical = pending + PROMPT.sub("", line).strip()
            pending = logical[:-1] + " " if logical.endswith("\\") else ""
            if not pending:
                found += [(start, cmd) for cmd in _split(logical)]
            text = _blank(text, offset, offset + len(line))
        previous_blank = line.strip() == ""
        offset += len(line) + 1
    for m in re.finditer(r"`([^`]+)`", text):
        found += [(m.start(), cmd) for cmd in _split(" ".join(m.group(1).split()))]
    return [Command(README.count("\n", 0, at) + 1, cmd) for at, cmd in sorted(found)]


def _split(text: str) -> list[str]:
    """The digenrl/python commands in one shell line (`a && b`, `bash -c '...'`, `# comments` dropped)."""
    out = []
    for m in COMMAND.finditer(text):
        cmd = re.split(r"&&|;|\||'| #", text[m.start():])[0].strip()
        out.append(cmd)
    return out


COMMANDS = _commands()


def test_the_readme_gives_commands() -> None:
    assert len(COMMANDS) > 20, COMMANDS


def test_every_command_runs_in_a_fresh_shell_after_the_quick_start() -> None:
    """Bare `digenrl` and `python` exist only in the venv: a command that comes before the README says to
    activate it must name `.venv/bin/...` (on a fresh machine `python` has no torch, `digenrl` is not
    on PATH)."""
    at = README.find(ACTIVATE)
    activated = README.count("\n", 0, at) + 1 if at >= 0 else sys.maxsize
    bare = [f"README.md:{c.line}: {c.text}" for c in COMMANDS
            if c.line < activated and not c.text.startswith(".venv/bin/")]
    where = f"before README.md:{activated} says `{ACTIVATE}`" if at >= 0 else f"and the README never says `{ACTIVATE}`"
    assert not bare, f"bare commands {where}:\n" + "\n".join(bare)


def _options(tokens: list[str]) -> list[str]:
    """The option names among ``tokens`` (placeholders' brackets and quotes stripped, `--set=x` -> `--set`)."""
    names = (t.strip("[]()\"'").split("=")[0] for t in tokens)
    return [n for n in names if re.fullmatch(r"--?[A-Za-z][\w-]*", n)]


def _check_digenrl(tokens: list[str]) -> str | None:
    cmd = typer.main.get_command(app)  # a group has `commands` (typer vendors its own click)
    i = 1
    while hasattr(cmd, "commands") and i < len(tokens) and tokens[i] in cmd.commands:
        cmd, i = cmd.commands[tokens[i]], i + 1
    if hasattr(cmd, "commands") and i < len(tokens) and not tokens[i].startswith("-"):
        return f"no subcommand {tokens[i]!r} of `{' '.join(tokens[:i])}`"
    known = {"--help"} | {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    unknown = [o for o in _options(tokens[i:]) if o not in known]
    return f"`{' '.join(tokens[:i])}` has no option {unknown}" if unknown else None


def _ours(path: Path) -> bool:
    """A file of this repository (not of an installed package, even one installed under .venv here)."""
    path = path.resolve()
    if not path.is_relative_to(ROOT):
        return False
    return not any(part.startswith(".") or part == "site-packages" for part in path.relative_to(ROOT).parts)


def _check_python(tokens: list[str]) -> str | None:
    if len(tokens) < 2:
        return "python with nothing to run"
    if tokens[1] == "-m":
        spec = importlib.util.find_spec(tokens[2])
        if spec is None:
            return f"no module {tokens[2]!r}"
        path, args = Path(spec.origin or ""), tokens[3:]
    else:
        path, args = ROOT / tokens[1], tokens[2:]
        if not path.is_file():
            return f"no file {tokens[1]}"
    if not _ours(path):  # a tool's own options (pytest -q) are its business
        return None
    source = path.read_text()
    unknown = [o for o in _options(args) if f'"{o}"' not in source and f"'{o}'" not in source]
    name = " ".join(tokens[1:3]) if tokens[1] == "-m" else tokens[1]
    return f"{name} takes no option {unknown}" if unknown else None


def test_every_command_names_a_real_subcommand_script_and_options() -> None:
    """What the README tells a reader to type exists: `digenrl` subcommands and their options, the
    scripts and modules `python` runs and the options those parse."""
    problems = []
    for c in COMMANDS:
        tokens = c.text.split()
        program = tokens[0].removeprefix(".venv/bin/")
        problem = _check_digenrl(tokens) if program == "digenrl" else _check_python(tokens)
        if problem:
            problems.append(f"README.md:{c.line}: `{c.text}`: {problem}")
    assert not problems, "\n".join(problems)
