"""Who may join a system and what a worker agrees to run: CURVE keys (forced on loopback by giving the
system keys) and the worker's allow-list of actor classes, with real `digenrl worker` processes."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from _actors import Counter
from digenrl.actors import ActorSystem, AllowList
from digenrl.actors.allowlist import register_actor_class, registered
from digenrl.errors import ActorNotAllowed, RemoteError
from digenrl.transport.curve import create_keys, load_keys
from test_worker_and_example import _env
from tests.conftest import digenrl_command

pytestmark = pytest.mark.timeout(120)


async def _worker(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(*digenrl_command("worker", *args, "--log-level", "WARNING"),
                                                env=_env(), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def _ends(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_a_worker_without_the_clusters_key_is_refused_and_counted(tmp_path: Path) -> None:
    keys = load_keys(create_keys(tmp_path / "cluster"))
    other = create_keys(tmp_path / "other")
    async with ActorSystem(address="tcp://127.0.0.1:0", keys=keys, heartbeat_interval=0.2) as system:
        good = await _worker("--join", system.address, "--name", "good", "--keys", str(keys.path),
                             "--allow", "_actors:Counter")
        try:
            [worker] = await system.wait_for_workers(1, timeout=90)
            counter = await system.spawn(Counter, name="c", on=worker)
            assert await counter.add.call(2) == 2
            # Two intruders: no keys at all, and another cluster's keys. Both give up with a clear error.
            for args in ((), ("--keys", str(other))):
                code, err = await _ends(await _worker("--join", system.address, "--name", "intruder", *args))
                assert code == 1 and "CURVE handshake failed" in err, err
            assert system.node is not None
            assert system.node.transport.stats["auth_failed"] >= 2
            # The system is unaffected: same single worker, its actor keeps its state.
            assert [w.name for w in system.workers] == ["good"]
            assert await counter.add.call(3) == 5
        except BaseException:
            good.kill()
            raise
    assert (await _ends(good))[0] == 0


async def test_actor_processes_of_a_keyed_system_authenticate_with_its_keys(tmp_path: Path) -> None:
    keys = load_keys(create_keys(tmp_path / "cluster"))
    async with ActorSystem(address="tcp://127.0.0.1:0", keys=keys) as system:
        counter = await system.spawn(Counter, name="c", process=True)
        assert await counter.add.call(4) == 4
        assert system.node is not None and system.node.transport.stats["auth_failed"] == 0


async def test_spawn_of_a_class_outside_the_allow_list_is_refused_naming_it() -> None:
    async with ActorSystem(address="tcp://127.0.0.1:0", heartbeat_interval=0.2) as system:
        proc = await _worker("--join", system.address, "--name", "roles-only")
        try:
            [worker] = await system.wait_for_workers(1, timeout=90)
            with pytest.raises(RemoteError) as info:
                await system.spawn(Counter, name="c", on=worker)
            err = info.value
            assert err.exc_type == "digenrl.errors.ActorNotAllowed"
            assert "_actors:Counter" in err.message and "--allow _actors:Counter" in err.message
            assert "digenrl.roles.rollout:RolloutActor" in err.message  # the roles are allowed by default
            assert "c" not in {a for w in system.workers for a in w.actors}
        except BaseException:
            proc.kill()
            raise
    assert (await _ends(proc))[0] == 0


def test_allow_list_checks_paths_before_importing() -> None:
    allow = AllowList(["mypkg.actors:Greeter", Counter])
    allow.check({"mod": "_actors", "qual": "Counter"}, "w")
    allow.check({"mod": "mypkg.actors", "qual": "Greeter"}, "w")  # never imported: mypkg does not exist
    with pytest.raises(ActorNotAllowed, match=r"os:system.*--allow os:system"):
        allow.check({"mod": "os", "qual": "system"}, "w")
    with pytest.raises(ValueError, match="module:Class"):
        AllowList(["Greeter"])


def test_registered_classes_are_allowed_everywhere_in_the_program() -> None:
    class Local:  # registration is by path; this class is never constructed
        pass

    path = f"{Local.__module__}:{Local.__qualname__}"
    spec = {"mod": Local.__module__, "qual": Local.__qualname__}
    with pytest.raises(ActorNotAllowed):
        AllowList().check(spec, "w")
    assert register_actor_class(Local) is Local and path in registered()
    AllowList().check(spec, "w")



def test_the_default_allow_list_names_digenrls_real_role_classes() -> None:
    from digenrl.actors._agent import resolve_class
    from digenrl.roles import ROLE_CLASSES

    for path in ROLE_CLASSES:
        mod, qual = path.split(":")
        assert resolve_class({"mod": mod, "qual": qual}).__name__ == qual
