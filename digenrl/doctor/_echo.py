"""``python -m digenrl.doctor._echo ADDRESS LOOP``: a ZmqTransport echo on the named event loop."""

from __future__ import annotations

import sys


async def _serve(address: str) -> None:
    from digenrl.transport.zmq import ZmqTransport

    t = ZmqTransport(address)
    print("READY", flush=True)
    try:
        while (msg := await t.recv()).header.get("op") != "stop":
            await t.send(msg.src, msg.header, msg.payload)
    finally:
        await t.aclose()


if __name__ == "__main__":
    from digenrl.actors.loop import run

    run(_serve(sys.argv[1]), sys.argv[2])
