"""Static typing of endpoints: a call's argument and return types flow from the endpoint to the caller.

Runs mypy on a small snippet when mypy is installed (it is not a runtime dependency); the
``assert_type`` checks in ``test_actor_api.py`` document the same contract at run time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SNIPPET = '''
import asyncio
from typing import assert_type
from digenrl.actors import Actor, ActorRef, ActorSystem, broadcast, endpoint

class Counter(Actor):
    @endpoint
    async def add(self, k: int) -> int:
        return k

    @endpoint(compute=True)
    def step(self, x: float, *, scale: float = 1.0) -> str:
        return str(x * scale)

async def main() -> None:
    async with ActorSystem() as s:
        c = await s.spawn(Counter, name="c")
        assert_type(c.add.call(1), asyncio.Future[int])
        assert_type(await c.step.call(1.0, scale=2.0), str)
        assert_type(await broadcast([c], Counter.add, 2), list[int])
        assert_type(c.ref, ActorRef[Counter])
        c.add.call("x")  # BAD: wrong argument type
        c.step.call(1.0, scale="a")  # BAD: wrong keyword type
        await broadcast([c], Counter.add, "x")  # BAD: wrong broadcast argument
'''


def test_endpoint_signatures_are_checked_statically(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (dev tool, not a dependency)")
    source = textwrap.dedent(SNIPPET)
    (tmp_path / "snippet.py").write_text(source)
    bad = [i for i, line in enumerate(source.splitlines(), 1) if "# BAD" in line]
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nfollow_imports = silent\n[mypy-torch.*,zmq.*,numpy.*]\nfollow_imports = skip\nignore_missing_imports = True\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", str(tmp_path / ".cache"),
         "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=170,
        env={**os.environ, "MYPYPATH": str(Path(__file__).resolve().parents[2])},  # digenrl as source
    )
    errors = sorted({int(line.split(":")[1]) for line in out.stdout.splitlines() if "snippet.py:" in line and ": error:" in line})
    assert len(bad) == 3 and errors == bad, out.stdout  # exactly the three bad calls, nothing else
