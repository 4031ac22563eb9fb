"""DropLog: per-peer rate limit by count and by time, a bounded set of peer names, counts per reason."""

from __future__ import annotations

import logging

import pytest

from digenrl.transport._drops import DropLog


def _log(caplog: pytest.LogCaptureFixture, **kw: object) -> tuple[DropLog, dict[str, int], list[float]]:
    now = [0.0]
    stats: dict[str, int] = {"dropped": 0}
    drops = DropLog(logging.getLogger("test.drops"), "endpoint x", stats, clock=lambda: now[0], **kw)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="test.drops")
    return drops, stats, now


def test_a_slow_trickle_is_summarized_every_every_s(caplog: pytest.LogCaptureFixture) -> None:
    drops, stats, now = _log(caplog, burst=2, every_s=10.0, every_n=1000)
    for i in range(30):  # one drop per second for 30 s
        now[0] = float(i)
        drops("peer", "garbage" if i % 3 else "version", "bad")
    assert stats == {"dropped": 30, "dropped/garbage": 20, "dropped/version": 10}
    lines = caplog.messages
    assert len(lines) == 2 + 2  # two in full, then a summary when 10 s of pending drops have passed (twice)
    assert lines[2].startswith("endpoint x: dropped 11 more malformed messages from peer in 10.0 s (")
    drops.flush()
    assert sum(int(m.split()[3]) for m in caplog.messages[2:]) == 28


def test_many_peer_names_share_one_entry_past_max_peers(caplog: pytest.LogCaptureFixture) -> None:
    drops, stats, _ = _log(caplog, burst=1, max_peers=3)
    for i in range(100):
        drops(f"spoofed-{i}", "garbage", "bad")
    assert stats["dropped"] == 100
    assert len(caplog.messages) == 4  # three named peers and the shared entry, one line each
    assert "<other peers>" in caplog.messages[-1]
