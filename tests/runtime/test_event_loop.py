"""``runtime.event_loop``: the driver and every actor process run on the configured loop."""

from __future__ import annotations

import pytest

from _actors import Counter
from digenrl.actors import ActorSystem
from digenrl.actors.loop import resolve_event_loop, run, running_loop_name
from digenrl.config import config_from_dict
from digenrl.errors import ConfigError

uvloop = pytest.importorskip("uvloop")


@pytest.fixture(scope="module", autouse=True)
def _uvloop_opened_once() -> None:
    # uvloop's first loop opens a process-wide pipe it keeps: not a leak of the code under test.
    uvloop.new_event_loop().close()


async def _where() -> str:
    return running_loop_name()


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_run_uses_the_named_loop(kind: str) -> None:
    assert run(_where(), kind) == kind


def test_default_is_uvloop_when_installed() -> None:
    assert resolve_event_loop(None) == "uvloop"
    assert run(_where()) == "uvloop"


def test_unknown_loop_is_refused_and_the_coroutine_never_runs() -> None:
    coro = _where()
    with pytest.raises(ValueError, match="'tornado' is not one of uvloop, asyncio"):
        run(coro, "tornado")
    assert coro.cr_frame is None  # closed, so no "never awaited" warning either


def test_config_key_is_validated() -> None:
    assert config_from_dict({}).runtime.event_loop == "uvloop"
    assert config_from_dict({"runtime": {"event_loop": "asyncio"}}).runtime.event_loop == "asyncio"
    with pytest.raises(ConfigError, match=r"runtime\.event_loop: 'trio' is not allowed"):
        config_from_dict({"runtime": {"event_loop": "trio"}})


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_actor_processes_run_on_the_drivers_loop(kind: str) -> None:
    async def main() -> tuple[str, str, int]:
        async with ActorSystem(heartbeat_interval=0.2, heartbeat_timeout=5.0, shutdown_timeout=3.0) as system:
            counter = await system.spawn(Counter, name=f"loop-{kind}", process=True)
            return running_loop_name(), await counter.loop_kind.call(), await counter.add.call(2)

    assert run(main(), kind) == (kind, kind, 2)

