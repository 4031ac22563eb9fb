"""Bad input: a listening actor fed >= 1000 malformed messages from a raw ZeroMQ socket keeps serving."""

from __future__ import annotations

import asyncio
import random
import tempfile
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from _actors import Counter
from digenrl.actors import ActorRef, ActorSystem
from digenrl.transport import codec

N_FUZZ = 1200
REAL_EVERY = 20


def _valid_call(call_id: int, method: str, args: list[Any], to: str = "target") -> list[bytes]:
    frames = codec.encode({"k": "call", "i": call_id, "to": to, "m": method}, [args, {}])
    return [bytes(f) for f in frames]


def _fuzz_messages(rng: random.Random) -> tuple[list[list[bytes]], dict[int, str]]:
    """Malformed messages of many kinds; also the ids of call-shaped ones that must get an error reply."""
    out: list[list[bytes]] = []
    must_answer: dict[int, str] = {}
    for n in range(N_FUZZ):
        kind = n % 10
        if kind == 0:  # random bytes, random frame count
            out.append([rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 4))])
        elif kind == 1:  # a valid call truncated at a random point
            head = _valid_call(10_000 + n, "add", [1])[0]
            out.append([head[: rng.randrange(0, len(head))]])
        elif kind == 2:  # wrong protocol version
            out.append([msgpack.packb([rng.choice([0, 2, 99, -1, "1"]), 0, {"k": "call"}, None])])
        elif kind == 3:  # huge declared sizes: bin32/str32/array32 lengths far beyond the data
            out.append([rng.choice([b"\xc6\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff", b"\xdd\xff\xff\xff\xff"]) + rng.randbytes(8)])
        elif kind == 4:  # a tensor declaring a petabyte, or pointing at frames that are not there
            rec = msgpack.packb(["f32", [1 << 40, 1 << 8], 1])
            payload = msgpack.ExtType(codec.EXT_TENSOR, rec)
            n_frames = rng.choice([0, 1, 5])
            out.append([msgpack.packb([codec.PROTOCOL_VERSION, n_frames, {"k": "tell", "to": "target", "m": "add"}, payload])]
                       + [b"x" * 8] * n_frames)
        elif kind == 5:  # valid codec, unknown runtime kind or mistyped fields
            header = rng.choice([{"k": "bogus"}, {"k": "call", "i": "7", "to": "target", "m": "add"}, {"k": 3},
                                 {"k": "call", "i": 1, "to": "", "m": "add"}, {"k": "ok"}, {"k": "dead", "a": 1}])
            out.append([bytes(f) for f in codec.encode(header, None)])
        elif kind == 6:  # call-shaped, but the method does not exist: must be answered
            must_answer[20_000 + n] = "target.no_such_method"
            out.append(_valid_call(20_000 + n, "no_such_method", [1]))
        elif kind == 7:  # wrong argument count: must be answered, naming the method
            must_answer[20_000 + n] = "target.add"
            out.append(_valid_call(20_000 + n, "add", [1, 2, 3]))
        elif kind == 8:  # call payload of the wrong shape, absurdly nested, or to an unknown actor
            if n % 40 == 18:  # [[[[...1...]]]] nested 900 or 5000 deep, written by hand (packb refuses)
                deep = b"\x91" * rng.choice([900, 5000]) + b"\x01"
                head = {"k": "call", "i": 1, "to": "target", "m": "add"}
                out.append([b"\x94" + msgpack.packb(codec.PROTOCOL_VERSION) + b"\x00" + msgpack.packb(head)
                            + b"\x92\x91" + deep + b"\x80"])
            elif n % 20 == 8:
                must_answer[20_000 + n] = "nobody.add"
                out.append(_valid_call(20_000 + n, "add", [1], to="nobody"))
            else:
                must_answer[20_000 + n] = "target.add"
                out.append([bytes(f) for f in codec.encode({"k": "call", "i": 20_000 + n, "to": "target", "m": "add"},
                                                            rng.choice([None, 5, [1], {"a": 1}, [[1], "kw"]]))])
        else:  # forged replies and dead notices: nobody to deliver to / not trusted
            header = rng.choice([{"k": "ok", "i": rng.randrange(1 << 30)}, {"k": "dead", "a": "ipc://x", "why": "forged"},
                                 {"k": "pong", "i": 1}, {"k": "cancel", "i": 5, "to": "target"}])
            out.append([bytes(f) for f in codec.encode(header, None)])
    return out, must_answer


async def test_fuzzed_input_is_dropped_or_answered_and_real_calls_keep_working() -> None:
    rng = random.Random(1234)
    messages, must_answer = _fuzz_messages(rng)
    fuzz_addr = f"ipc://{tempfile.gettempdir()}/digenrl-fuzz-{rng.randrange(1 << 30)}.sock"
    ctx = zmq.asyncio.Context()
    inbox = ctx.socket(zmq.ROUTER)  # where the actor's error replies to the fuzzer arrive
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.bind(fuzz_addr)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.IDENTITY, fuzz_addr.encode())
    try:
        async with ActorSystem() as server, ActorSystem() as client:
            await server.spawn(Counter, name="target")
            target = ActorRef("target", server.address, actor_class=Counter, node=client.node)
            raw.connect(server.address)
            real: list[asyncio.Future[int]] = []
            for n, frames in enumerate(messages):
                await raw.send_multipart(frames)
                if n % REAL_EVERY == 0:
                    real.append(target.add.call(1))  # over zmq from another endpoint, interleaved
                    await asyncio.sleep(0)
            results = await asyncio.wait_for(asyncio.gather(*real), 60)
            assert results == list(range(1, len(real) + 1))  # every real call ran, in order
            assert await target.history.call() == [1] * len(real)  # no fuzzed call reached the endpoint

            answered: dict[int, dict[str, Any]] = {}
            async with asyncio.timeout(30):
                while not set(must_answer) <= set(answered):
                    frames = await inbox.recv_multipart()
                    header, _ = codec.decode(frames[1:])
                    answered[header["i"]] = header
            for call_id, where in must_answer.items():
                reply = answered[call_id]
                assert reply["k"] == "err" and reply["w"] == where, reply
            assert any("no endpoint 'no_such_method'" in r["e"] for r in answered.values())
            assert any(r["e"].startswith("add(): too many positional arguments") for r in answered.values())
            assert server.node is not None
            dropped = server.node.transport.stats["dropped"]
            assert dropped >= N_FUZZ - len(must_answer) - N_FUZZ // 10  # the rest were dropped (and logged)
            assert await target.add.call(1) == len(real) + 1
    finally:
        raw.close(0)
        inbox.close(0)
        ctx.term()
