"""Fixtures of the multi-host suite: two hosts as network namespaces (see netns.py), the run's CURVE keys,
and the tiny default started across them as the README's "Several machines" commands do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from digenrl.transport.curve import create_keys
from tests.multihost.netns import Hosts, make_hosts, unavailable
from tests.multihost.runs import Placed

_WHY_NOT = unavailable()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.multihost)
            if _WHY_NOT is not None:
                item.add_marker(pytest.mark.skip(reason=_WHY_NOT))


@pytest.fixture
def hosts(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Hosts]:
    """Hosts A (198.18.0.1) and B (198.18.0.2); every process in them is killed and both removed at the end.

    A failed test's message gets every process's log tail (they stay under ``tmp_path/logs``)."""
    made = make_hosts(tmp_path / "logs")
    try:
        yield made
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(made.logs())
        made.close()


@pytest.fixture(scope="session")
def placed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Placed]:
    """Runs shared by every test that compares placements (see :class:`Placed`), on hosts of their own that
    live for the session. A failed run's assertion carries every process's log tail."""
    root = tmp_path_factory.mktemp("placed")
    made = make_hosts(root / "logs")
    try:
        yield Placed(made, create_keys(root / "keys"), root)
    finally:
        made.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
