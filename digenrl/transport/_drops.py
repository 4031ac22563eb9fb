"""Dropped input from peers: counted by reason, logged with a per-peer rate limit.

A peer that sends garbage (a port scanner, a client of another protocol, a hostile process) must
neither reach the receiver nor flood the log: each peer's first ``burst`` drops are logged in full,
then one summary line per peer every ``every_s`` seconds or ``every_n`` drops, with counts per
reason. Counts (all peers) live in the endpoint's ``stats`` as ``dropped`` and ``dropped/<reason>``.

The peer name is what the sender says it is (a ZeroMQ identity), so a flood spread over many names
is bounded too: past ``max_peers`` names, the rest share one entry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["DropLog"]

_OTHERS = "<other peers>"


@dataclass
class _PeerDrops:
    total: int = 0
    pending: Counter[str] = field(default_factory=Counter)  # reasons not yet in a log line
    since: float = 0.0  # when the pending drops started
    timer: asyncio.TimerHandle | None = None  # summarizes the pending drops if the flood stops


class DropLog:
    """Counts dropped messages into ``stats`` and logs them, rate-limited per peer.

    Args:
        logger: where the lines go (WARNING).
        who: this endpoint, as it should appear in the lines.
        stats: the endpoint's counters; ``dropped`` and ``dropped/<reason>`` are incremented here.
        burst: drops per peer logged one by one.
        every_s, every_n: after the burst, a summary line per peer at most this often (seconds), or
            after this many more drops, whichever comes first.
        max_peers: distinct peer names tracked; more share one entry.
        clock: the time source (monotonic seconds).
    """

    def __init__(self, logger: logging.Logger, who: str, stats: dict[str, int], *, burst: int = 5,
                 every_s: float = 10.0, every_n: int = 1000, max_peers: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.who, self.stats = logger, who, stats
        self.burst, self.every_s, self.every_n, self.max_peers = burst, every_s, every_n, max_peers
        self._clock = clock
        self._peers: dict[str, _PeerDrops] = {}

    def __call__(self, src: str | None, reason: str, detail: object) -> None:
        """Count one dropped message from ``src`` for ``reason`` (a short word); ``detail`` says what was wrong."""
        self.stats["dropped"] = self.stats.get("dropped", 0) + 1
        key = f"dropped/{reason}"
        self.stats[key] = self.stats.get(key, 0) + 1
        name = (src or "?")[:120]
        peer = self._peers.get(name)
        if peer is None:
            if len(self._peers) >= self.max_peers:
                name = _OTHERS
            peer = self._peers.setdefault(name, _PeerDrops())
        peer.total += 1
        if peer.total <= self.burst:
            self.log.warning("%s: dropped a malformed message from %s (%s): %s%s", self.who, name, reason,
                             str(detail)[:300], "; further drops from this peer are summarized"
                             if peer.total == self.burst else "")
            return
        now = self._clock()
        if not peer.pending:
            peer.since = now
            self._arm(name, peer)
        peer.pending[reason] += 1
        if sum(peer.pending.values()) >= self.every_n or now - peer.since >= self.every_s:
            self._summary(name, peer, now)

    def flush(self) -> None:
        """Log the summary of every peer's drops not yet reported (e.g. when the endpoint closes)."""
        now = self._clock()
        for name, peer in self._peers.items():
            if peer.pending:
                self._summary(name, peer, now)

    def _arm(self, name: str, peer: _PeerDrops) -> None:
        """Summarize ``every_s`` from now even if no further drop comes (only on an event loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        peer.timer = loop.call_later(self.every_s, lambda: peer.pending and self._summary(name, peer, self._clock()))

    def _summary(self, name: str, peer: _PeerDrops, now: float) -> None:
        if peer.timer is not None:
            peer.timer.cancel()
            peer.timer = None
        reasons = ", ".join(f"{reason}: {n}" for reason, n in peer.pending.most_common())
        self.log.warning("%s: dropped %d more malformed messages from %s in %.1f s (%s); %d from it in all",
                         self.who, sum(peer.pending.values()), name, now - peer.since, reasons, peer.total)
        peer.pending.clear()
