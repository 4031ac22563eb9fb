"""A tiny HTTP reward service over the stdlib ``http.server`` (for tests and for running a reward on
another machine). It speaks the JSON of :mod:`digenrl.rewards._wire`.

Run one::

    python -m digenrl.rewards.server --reward jpeg_compressibility --port 0
    python -m digenrl.rewards.server --reward clipscore --set path=/models/clip-vit-large-patch14 --device cuda
    python -m digenrl.rewards.server --python examples/rewards/brightness.py:Brightness --set target=0.5

It binds to 127.0.0.1 unless ``--host`` says otherwise and writes its URL as the first line of stdout
(useful with ``--port 0``). It scores on ``POST /score`` and, for a ``reward.url`` given as a bare base
URL (``http://host:port``), on ``POST /`` too; any other path gets 404 naming the URL to use. Bodies above ``--max-bytes`` are refused (413); malformed requests get 400
with the reason; a reward that raises gets 500.

A served edit reward (``uses_sources``, e.g. ``edit_consistency``) is handed the request's ``sources``
(the samples' input images); a request without them gets 400 telling the client to send them
(``reward.remote_sources = true``). A reward that does not use sources ignores them, undecoded.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from digenrl.errors import ConfigError
from digenrl.rewards._wire import decode_images, decode_sources
from digenrl.rewards.base import Reward, RewardError, score_with_sources

__all__ = ["RewardServer", "main"]

log = logging.getLogger(__name__)


class RewardServer:
    """Serves ``reward`` on ``http://host:port/score`` (and ``/``) from a background thread.

    Args:
        reward: the reward to serve.
        host: bind address (loopback by default).
        port: 0 picks a free port.
        max_bytes: largest accepted request body.
    """

    def __init__(self, reward: Reward, *, host: str = "127.0.0.1", port: int = 0, max_bytes: int = 64 << 20) -> None:
        self.reward = reward
        self.max_bytes = max_bytes
        self.requests = 0
        self._lock = threading.Lock()  # rewards need not be thread-safe
        self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The scoring endpoint."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/score"

    def start(self) -> RewardServer:
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="reward-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until interrupted."""
        self._httpd.serve_forever()

    def close(self) -> None:
        """Stop serving and release the socket."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _score(self, payload: Any) -> list[float]:
        if not isinstance(payload, dict):
            raise RewardError("request body must be a JSON object")
        prompts = payload.get("prompts")
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise RewardError("prompts: expected a list of strings")
        needs_sources = getattr(self.reward, "uses_sources", False)
        if needs_sources and payload.get("sources") is None:  # before the images: a client's probe learns it too
            raise RewardError(f"sources: the served reward {self.reward.name!r} scores each output against its "
                              "input images, and this request carries none; the client must send them "
                              "(reward.remote_sources = true, or RemoteReward(..., send_sources=True))")
        images = decode_images(payload.get("images"))
        sources = decode_sources(payload["sources"], len(prompts)) if needs_sources else None
        with self._lock:
            self.requests += 1
            return [float(s) for s in score_with_sources(self.reward, images, prompts, sources)]

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server naming)
                # The base URL scores too: configs and users write either form.
                if self.path.rstrip("/") not in ("", "/score"):
                    return self._reply(404, {"error": f"unknown path {self.path!r}; this server scores on POST "
                                                      f"{server.url} (or the base URL)"})
                length = int(self.headers.get("Content-Length") or 0)
                if length > server.max_bytes:
                    return self._reply(413, {"error": f"body of {length} bytes exceeds max {server.max_bytes}"})
                try:
                    payload = json.loads(self.rfile.read(length))
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    return self._reply(400, {"error": f"body is not JSON: {exc}"})
                try:
                    scores = server._score(payload)
                except RewardError as exc:
                    return self._reply(400, {"error": str(exc)})
                except Exception as exc:  # any failure of the reward is a 500, never a dropped connection
                    log.exception("reward failed")
                    return self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
                self._reply(200, {"scores": scores})

            def _reply(self, code: int, obj: dict[str, Any]) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("reward server: " + fmt, *args)

        return Handler


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m digenrl.rewards.server``."""
    from digenrl.rewards.registry import REWARD_NAMES, make_reward
    from digenrl.rewards.user import allow_user_reward

    ap = argparse.ArgumentParser(description="Serve a digenrl reward over HTTP (JSON).")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--reward", choices=[n for n in REWARD_NAMES if n != "remote"])
    which.add_argument("--python", metavar="FILE.py:CLASS", help="serve a reward of your own, as reward.models.NAME."
                       "python names it (docs/rewards.md)")
    ap.add_argument("--set", dest="table", action="append", default=[], metavar="KEY=VALUE",
                    help="an entry of the reward's [reward.models.NAME] table, e.g. --set path=/models/clip (repeatable)")
    ap.add_argument("--device", default="cpu", help="where the reward runs: cpu, cuda or cuda:K")
    ap.add_argument("--dtype", default="", help="float32, bfloat16 or float16 (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        name, table = args.reward, _table(ap, args.table)
        if args.python:  # this command line is the process's own config: it may import the file
            name, table = allow_user_reward(args.python, "--python").rpartition(":")[2], {**table, "python": args.python}
        reward = make_reward(name, table=table, device=args.device, dtype=args.dtype)
    except ConfigError as exc:  # one line naming the key (reward.models.NAME.KEY is --set KEY here)
        ap.error(str(exc))
    srv = RewardServer(reward, host=args.host, port=args.port, max_bytes=args.max_bytes)
    sys.stdout.write(srv.url + "\n")  # the URL is this program's output (for --port 0), not a status line
    sys.stdout.flush()
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()


def _table(ap: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` entries as the reward's table (values as TOML literals; bare words are strings)."""
    import tomllib

    table: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            ap.error(f"--set {item!r}: expected KEY=VALUE")
        try:
            table[key.strip()] = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            table[key.strip()] = raw.strip()
    return table


if __name__ == "__main__":
    main()
