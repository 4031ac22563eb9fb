"""A flood of malformed messages: counted per reason, a bounded number of log lines, the actor keeps serving."""

from __future__ import annotations

import logging
import re

import msgpack
import pytest
import zmq
import zmq.asyncio

from _actors import Counter
from digenrl.actors import Actor, ActorSystem, dropped_counts, endpoint
from digenrl.transport import codec

N = 1000  # of each kind


class Probe(Actor):
    @endpoint
    async def drops(self) -> dict[str, dict[str, int]]:
        return dropped_counts()


def _flood() -> list[list[bytes]]:
    garbage = [b"not a digenrl message"]  # not one msgpack value
    version = [msgpack.packb([99, 0, {"k": "call"}, None])]  # another protocol version
    header = [bytes(f) for f in codec.encode({"k": "bogus"}, None)]  # a valid envelope, no actor-protocol kind
    return [garbage] * N + [version] * N + [header] * N


async def test_3000_malformed_messages_are_counted_by_reason_in_few_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.asyncio.Context()
    inbox = ctx.socket(zmq.ROUTER)  # where the actor's reply to the flooder arrives
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.bind("tcp://127.0.0.1:0")
    me = inbox.getsockopt_string(zmq.LAST_ENDPOINT)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.IDENTITY, me.encode())
    try:
        with caplog.at_level(logging.WARNING, logger="digenrl.transport"):
            async with ActorSystem(address="tcp://127.0.0.1:0") as system:
                await system.spawn(Probe, name="probe")
                counter = await system.spawn(Counter, name="counter")
                raw.connect(system.address)
                for frames in _flood():
                    await raw.send_multipart(frames)
                # One connection delivers in order: the reply to this call means the flood was read.
                await raw.send_multipart([bytes(f) for f in codec.encode({"k": "call", "i": 1, "to": "probe",
                                                                          "m": "drops"}, [[], {}])])
                frames = await inbox.recv_multipart()
                header, payload = codec.decode(frames[1:])
                assert header["k"] == "ok", header
                assert payload == {system.address: {"dropped": 3 * N, "dropped/garbage": N, "dropped/version": N,
                                                    "dropped/header": N}}
                assert await counter.add.call(1) == 1  # the actor still answers
    finally:
        raw.close(0)
        inbox.close(0)
        ctx.term()
    lines = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert 7 <= len(lines) <= 20, lines  # 5 in full, then summaries (every 1000 drops, and the rest at close)
    assert all(me in line for line in lines)  # each names the peer
    assert "(garbage): header frame is not one msgpack value" in lines[0]
    summed = [re.search(r"dropped (\d+) more malformed messages from .* \((.*)\); (\d+) from it in all", line)
              for line in lines[5:]]
    assert all(summed), lines[5:]
    assert 5 + sum(int(m[1]) for m in summed) == 3 * N == int(summed[-1][3])  # every drop is in some line
    assert "garbage: 995, version: 5" in summed[0][2]  # counts per reason
