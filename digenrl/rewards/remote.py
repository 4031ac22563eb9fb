"""A client for an HTTP reward service (stdlib ``urllib`` only), e.g. one started with
``python -m digenrl.rewards.server`` or any server speaking the same JSON (see :mod:`._wire`).

Transient failures (connection refused or reset, timeouts, HTTP 5xx) are retried with exponential
backoff; a 4xx answer is the caller's fault and is raised at once. Either way the final failure is a
:class:`RewardError` naming the URL and the cause.

An edit reward served remotely needs the samples' input images: ``send_sources=True``
(``reward.remote_sources``) makes the client ``uses_sources``, so the callers pass them (``rewards/base.py``),
and sends them in the request's ``sources`` field.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

import torch

from digenrl.rewards._wire import IMAGE_FORMATS, encode_images, encode_sources
from digenrl.rewards.base import RewardError, check_batch

__all__ = ["RemoteReward"]

log = logging.getLogger(__name__)


class RemoteReward:
    """Scores batches by POSTing them to ``url``.

    Args:
        url: the service endpoint, e.g. ``http://127.0.0.1:8000/score`` (what
            ``python -m digenrl.rewards.server --port 8000`` prints; it scores on the base URL too).
        timeout: seconds per attempt.
        retries: extra attempts after the first for transient failures.
        backoff: first retry delay in seconds (doubles each retry).
        image_format: ``"png"`` (compact) or ``"raw"`` (exact uint8 array, no codec).
        name: the name to report.
        send_sources: send each sample's input images (``[B, K, 3, H, W]``, the ``sources`` of
            :meth:`score`) for a served reward that scores against them; sets ``uses_sources``.

    Raises:
        ValueError: bad arguments.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        retries: int = 2,
        backoff: float = 0.2,
        image_format: str = "png",
        name: str = "remote",
        send_sources: bool = False,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward url must start with http:// or https://, got {url!r}")
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
        if timeout <= 0 or retries < 0:
            raise ValueError(f"timeout must be > 0 and retries >= 0, got {timeout}, {retries}")
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.image_format = image_format
        self.name = name
        self.uses_sources = send_sources  # the callers pass sources= only to a reward that says so

    def score(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None) -> torch.Tensor:
        """POST the batch (with ``sources``, the input images ``[B, K, 3, H, W]``, under ``send_sources``) and
        return the scores. Without ``send_sources`` no sources are sent.

        Raises:
            RewardError: malformed batch or sources, no sources under ``send_sources``, the server answered
                an error, it could not be reached after all retries, or its answer is malformed.
        """
        check_batch(images, prompts, self.name)
        request = {"prompts": list(prompts), "images": encode_images(images, self.image_format)}
        if self.uses_sources:
            if sources is None:
                raise RewardError(f"{self._who}: send_sources (reward.remote_sources) is set, but no input images "
                                  "were passed (sources=None)")
            try:
                request["sources"] = encode_sources(sources, images.shape[0], self.image_format)
            except RewardError as exc:
                raise RewardError(f"{self._who}: {exc}") from None
        reply = self._post(json.dumps(request).encode())
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list) or len(scores) != images.shape[0]:
            raise RewardError(f"{self._who}: expected {images.shape[0]} scores, got {str(reply)[:200]}")
        try:
            return torch.tensor([float(s) for s in scores], dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise RewardError(f"{self._who}: non-numeric scores {scores[:8]}") from exc

    def probe(self) -> None:
        """Check that ``url`` answers on a scoring path, without scoring anything (run at start-up).

        POSTs an empty batch, with the retries of :meth:`score`. Any HTTP answer but 404 counts: the
        path serves (digenrl's server refuses an empty batch with 400 before any reward runs), unless
        it says that its reward needs the input images this client does not send.

        Raises:
            RewardError: the message :meth:`score` would raise for this URL: nothing answers after
                the retries, HTTP 404 (no scoring endpoint on that path), or the served reward needs
                sources and ``send_sources`` is off (naming ``reward.remote_sources``).
        """
        body = {"prompts": [], "images": encode_images(torch.zeros(0, 3, 1, 1), "png")}
        if self.uses_sources:
            body["sources"] = encode_sources(torch.zeros(0, 1, 3, 1, 1), 0)
        self._post(json.dumps(body).encode(), probe=True)

    @property
    def _who(self) -> str:
        return f"reward {self.name!r} at {self.url}"

    def _scoring_url(self) -> str:
        """The URL digenrl's own server scores on, on this URL's host and port."""
        parts = urlsplit(self.url)
        return urlunsplit((parts.scheme, parts.netloc, "/score", "", ""))

    def _post(self, body: bytes, probe: bool = False) -> object:
        delay = self.backoff
        last = "no attempt"
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url, data=body, method="POST", headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                detail = _error_text(exc)
                if exc.code == 404:
                    raise RewardError(f"{self._who}: HTTP 404 ({detail}): no scoring endpoint there; set reward.url "
                                      f"to the URL the reward server prints (`python -m digenrl.rewards.server` "
                                      f"scores on {self._scoring_url()})") from exc
                if probe and "reward.remote_sources" in detail and not self.uses_sources:
                    raise RewardError(f"{self._who}: the served reward scores each output against its input images; "
                                      "set reward.remote_sources = true to send them") from exc
                if probe:  # the path serves: it answered, whatever it thought of an empty batch
                    return None
                if exc.code < 500:
                    raise RewardError(f"{self._who}: HTTP {exc.code}: {detail}") from exc
                last = f"HTTP {exc.code}: {detail}"
            except (urllib.error.URLError, socket.timeout, ConnectionError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            except json.JSONDecodeError as exc:
                raise RewardError(f"{self._who}: answer is not JSON ({exc})") from exc
            if attempt < self.retries:
                log.warning("reward server %s: attempt %d failed (%s); retrying in %.2fs", self.url, attempt + 1, last, delay)
                time.sleep(delay)
                delay *= 2
        hint = ""
        if not last.startswith("HTTP"):  # nothing answered: say how to start the server this URL expects
            parts = urlsplit(self.url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            hint = (f"; is the reward server running? `python -m digenrl.rewards.server --reward NAME --port {port}` "
                    f"serves {self._scoring_url()}; set reward.url to the URL it prints")
        tries = f"{self.retries + 1} attempt{'s' if self.retries else ''}"
        raise RewardError(f"{self._who}: failed after {tries}: {last}{hint}")


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        obj = json.loads(exc.read() or b"{}")
        return str(obj.get("error", obj))[:500]
    except (json.JSONDecodeError, OSError, AttributeError):
        return exc.reason if isinstance(exc.reason, str) else str(exc)
