"""README.md and the docs/ pages work when copied (issues 29, 37): their Python blocks are the files they name,
or run as written; every command they give names a real subcommand, script or module and real options, and
every `--set key=value` a real configuration key (a `digenrl run|validate|plan` of a shipped config loads
with its overrides); the README's commands run after its quick start (the venv activated, or spelled
`.venv/bin/...`); every page the README links exists; docs/configuration.md is what the config classes say."""

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
DOCUMENTS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
README = DOCUMENTS["README.md"]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
PY_FILE = re.compile(r"(?<![\w./-])([\w./-]+\.py)\b")
ACTIVATE = "source .venv/bin/activate"


@dataclass(frozen=True)
class Block:
    doc: str  # the document's path in the repository
    line: int  # of the opening fence, 1-based
    code: str
    named: tuple[str, ...]  # the repository files the block says it is


def _python_blocks(doc: str, text: str) -> list[Block]:
    """Every ```python block, with the files named by its first line, the line above it or the line below."""
    blocks = []
    for m in FENCE.finditer(text):
        if m.group(1).strip().lower() not in ("python", "py", "python3"):
            continue
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        after = text[m.end():].lstrip("\n").split("\n", 1)[0]
        first = m.group(2).split("\n", 1)[0]
        around = [before, after] + ([first] if first.lstrip().startswith(("#", '"""', "'''")) else [])
        named = {p for line in around for p in PY_FILE.findall(line) if (ROOT / p).is_file()}
        blocks.append(Block(doc, text.count("\n", 0, m.start()) + 1, m.group(2), tuple(sorted(named))))
    return blocks


BLOCKS = [b for doc, text in DOCUMENTS.items() for b in _python_blocks(doc, text)]


def test_the_docs_have_python_blocks() -> None:
    assert BLOCKS, "no ```python block found: the extraction is broken, or the docs lost their examples"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.doc}:{b.line}" for b in BLOCKS])
def test_each_python_block_is_the_file_it_names_or_runs(block: Block, tmp_path: Path) -> None:
    """A block naming a file (e.g. `examples/hello_actor.py`) must be that file, byte for byte: a reader
    copies the block, the tests run the file. A block naming none is run here as a reader would."""
    assert len(block.named) <= 1, f"{block.doc}:{block.line}: the block names several files {block.named}"
    if block.named:
        path = ROOT / block.named[0]
        assert block.code.encode() == path.read_bytes(), (
            f"{block.doc}:{block.line}: the block differs from {block.named[0]}, which it says it is")
        return
    script = tmp_path / f"block_line{block.line}.py"
    script.write_text(block.code)
    # this checkout ahead of the inherited PYTHONPATH (as tests.conftest.child_env): the block saved elsewhere
    # imports the digenrl under test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"{block.doc}:{block.line} exits {out.returncode}:\n{out.stderr[-3000:]}"


# -- commands ---------------------------------------------------------------------------------------------

COMMAND = re.compile(r"(?<![\w./-])((?:\.venv/bin/)?(?:digenrl|python)) (?!= )")  # not a TOML `python = ...`
PROMPT = re.compile(r"^\s*[\w.-]*\$ ")  # node0$ ..., $ ...
SHELL_FENCES = ("", "bash", "sh", "shell", "console")


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str


def _blank(text: str, start: int, end: int) -> str:
    """``text`` with [start, end) replaced by newlines and spaces: offsets (and line numbers) stay put."""
    return text[:start] + "".join(c if c == "\n" else " " for c in text[start:end]) + text[end:]


def _commands(doc: str, source: str) -> list[Command]:
    """Every `digenrl ...` / `python ...` command line of a document: in code spans and indented blocks."""
    text = source
    found: list[tuple[int, str]] = []
    for m in FENCE.finditer(source):
        if m.group(1).strip().lower() in SHELL_FENCES:  # a shell block: one command per line, `\` continuing it
            offset, pending, start = m.start(2), "", 0
            for line in m.group(2).split("\n"):
                start = start if pending else offset
                logical = pending + PROMPT.sub("", line).strip()
                pending = logical[:-1] + " " if logical.endswith("\\") else ""
                if not pending and not logical.startswith("#"):
                    found += [(start, cmd) for cmd in _split(logical)]
                offset += len(line) + 1
        text = _blank(text, m.start(), m.end())
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
    return [Command(doc, source.count("\n", 0, at) + 1, cmd) for at, cmd in sorted(found)]


def _split(text: str) -> list[str]:
    """The digenrl/python commands in one shell line (`a && b`, `bash -c '...'`, `# comments` dropped)."""
    out = []
    for m in COMMAND.finditer(text):
        cmd = re.split(r"&&|;|\||'| #", text[m.start():])[0].strip()
        out.append(cmd)
    return out


COMMANDS = [c for doc, text in DOCUMENTS.items() for c in _commands(doc, text)]


def test_the_docs_give_commands() -> None:
    assert len(COMMANDS) > 40, COMMANDS
    assert len([c for c in COMMANDS if c.doc == "README.md"]) >= 4, "the README lost its commands"


def test_every_command_runs_in_a_fresh_shell_after_the_quick_start() -> None:
    """Bare `digenrl` and `python` exist only in the venv: a command that comes before the README says to
    activate it must name `.venv/bin/...` (on a fresh machine `python` has no torch, `digenrl` is not
    on PATH)."""
    at = README.find(ACTIVATE)
    activated = README.count("\n", 0, at) + 1 if at >= 0 else sys.maxsize
    bare = [f"README.md:{c.line}: {c.text}" for c in COMMANDS
            if c.doc == "README.md" and c.line < activated and not c.text.startswith(".venv/bin/")]
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
    """What the docs tell a reader to type exists: `digenrl` subcommands and their options, the
    scripts and modules `python` runs and the options those parse."""
    problems = []
    for c in COMMANDS:
        tokens = c.text.split()
        program = tokens[0].removeprefix(".venv/bin/")
        problem = _check_digenrl(tokens) if program == "digenrl" else _check_python(tokens)
        if problem:
            problems.append(f"{c.doc}:{c.line}: `{c.text}`: {problem}")
    assert not problems, "\n".join(problems)


# -- configuration keys, links, the generated reference -------------------------------------------------------

SET = re.compile(r"--set[= ]+[\"']?([A-Za-z_][\w.]*)=")


def _config_keys() -> set[str]:
    """Every `table.key` a config file may set (a table's dict keys, such as reward.weights.NAME, under it)."""
    import dataclasses

    from digenrl.config import Config

    return {f"{t.name}.{k.name}" for t in dataclasses.fields(Config) for k in dataclasses.fields(t.default_factory())}


def test_every_set_names_a_configuration_key() -> None:
    """A `digenrl ... --set table.key=value` the docs give names a key that exists."""
    keys, problems = _config_keys(), []
    for c in COMMANDS:
        if c.text.split()[0].removeprefix(".venv/bin/") != "digenrl":
            continue
        for m in SET.finditer(c.text):
            key = m.group(1)
            if key not in keys and ".".join(key.split(".")[:2]) not in keys:
                problems.append(f"{c.doc}:{c.line}: --set {key}: no such key")
    assert not problems, "\n".join(problems)


def test_every_run_of_a_shipped_config_loads_with_its_overrides() -> None:
    """`digenrl run|validate|plan configs/X.toml --set ...` as written: the file and its overrides make a
    valid config (what `digenrl validate` checks first)."""
    import shlex

    from digenrl.config import load_config

    problems, tried = [], 0
    for c in COMMANDS:
        try:
            tokens = shlex.split(c.text.replace("\\\n", " "))
        except ValueError:
            continue
        if tokens[0].removeprefix(".venv/bin/") != "digenrl" or len(tokens) < 3 or tokens[1] not in (
                "run", "validate", "plan") or not (ROOT / tokens[2]).is_file():
            continue
        sets = [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t == "--set"]
        if any(re.search(r"[A-Z]{3,}|\.\.\.|<", s) for s in sets):  # a placeholder (NODE0_IP, DIR, <...>)
            continue
        tried += 1
        try:
            load_config(ROOT / tokens[2], sets)
        except Exception as exc:  # noqa: BLE001 - the message is the finding
            problems.append(f"{c.doc}:{c.line}: `{c.text}`: {type(exc).__name__}: {exc}")
    assert tried >= 5, tried
    assert not problems, "\n".join(problems)


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_linked_file_exists() -> None:
    missing = []
    for doc, text in DOCUMENTS.items():
        base = (ROOT / doc).parent
        for m in LINK.finditer(text):
            target = m.group(1)
            if not re.match(r"[a-z]+://", target) and not (base / target).exists():
                missing.append(f"{doc}: link to {target}")
    assert not missing, "\n".join(missing)


def test_the_readme_is_short_and_links_every_docs_page() -> None:
    assert README.count("\n") < 150, f"README.md has {README.count(chr(10))} lines: move detail into docs/"
    unlinked = [d for d in DOCUMENTS if d.startswith("docs/") and f"({d})" not in README]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_configuration_reference_is_what_the_config_classes_say() -> None:
    from digenrl_cli.reference import reference

    assert DOCUMENTS.get("docs/configuration.md") == reference(), (
        "docs/configuration.md is stale: regenerate it with `digenrl config-reference --out docs/configuration.md`")
