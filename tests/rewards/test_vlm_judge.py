"""The ``vlm_judge`` reward (issue 31) through the real ``openai`` client against a loopback
chat-completions server speaking the API's documented JSON: both scoring modes against hand-computed
scores, the pixels and rendered prompt on the wire, bounded concurrency, and every failure (malformed
answer, timeout, HTTP errors) ending in a RewardError after the configured number of attempts."""

from __future__ import annotations

import base64
import io
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("openai")

from digenrl.errors import ConfigError  # noqa: E402
from digenrl.rewards.base import GuardedReward, RewardError, to_uint8_hwc  # noqa: E402
from digenrl.rewards.vlm import VlmJudge, rating_score, vlm_judge, yes_probability  # noqa: E402

# (status, JSON body, seconds to wait before answering) for the request body and its 1-based number.
Answer = Callable[[dict[str, Any], int], tuple[int, dict[str, Any], float]]


def completion(text: str, top: list[tuple[str, float]] | None = None) -> dict[str, Any]:
    """A chat.completion object as the API documents it (logprobs only when ``top`` is given)."""
    logprobs = None
    if top is not None:
        entries = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]
        logprobs = {"content": [{**entries[0], "top_logprobs": entries}], "refusal": None}
    return {"id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": "judge",
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": logprobs,
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out has hung up: expected here


class FakeJudge:
    """A chat-completions server on 127.0.0.1 that records every request and its concurrency."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        self._httpd = _QuietServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.01,), daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    return self._send(404, {"error": {"message": f"no {self.path}"}})
                self._send(200, {"object": "list", "data": [{"id": "judge", "object": "model", "created": 0,
                                                             "owned_by": "test"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests.append(body)
                    server.headers.append({k.lower(): v for k, v in self.headers.items()})
                    n = len(server.requests)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    if self.path != "/v1/chat/completions":
                        return self._send(404, {"error": {"message": f"no {self.path}"}})
                    status, payload, delay = server.answer(body, n)
                    time.sleep(delay)
                    self._send(status, payload)
                finally:
                    with server._lock:
                        server.in_flight -= 1

        return Handler

    def __enter__(self) -> FakeJudge:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], FakeJudge]]:
    servers: list[FakeJudge] = []

    def start(answer: Answer) -> FakeJudge:
        servers.append(FakeJudge(answer).__enter__())
        return servers[-1]

    yield start
    for s in servers:
        s.__exit__()


def text_of(body: dict[str, Any]) -> str:
    return next(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text")


def images_of(body: dict[str, Any]) -> list[str]:
    return [p["image_url"]["url"] for p in body["messages"][0]["content"] if p["type"] == "image_url"]


def decode(url: str) -> np.ndarray:
    """The pixels of a ``data:image/...;base64,`` URL."""
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))


def judge(server: FakeJudge, **table: Any) -> VlmJudge:
    return vlm_judge({"base_url": server.base_url, "model": "judge", "backoff": 0.01, **table}, "cpu", "float32")


def batch(n: int = 2, h: int = 6, w: int = 5) -> torch.Tensor:
    # Exact multiples of 1/255: the 8-bit pixels on the wire are these values, no rounding in between.
    return torch.randint(0, 256, (n, 3, h, w), generator=torch.Generator().manual_seed(0)).float() / 255


def test_yesno_scores_p_yes_over_p_yes_plus_no(serve: Callable[[Answer], FakeJudge]) -> None:
    tops = {
        "a": [("Yes", -0.1), ("No", -2.3)],
        "b": [(" no", -0.5), ("NO", -1.5), ("yes", -2.0), ("Maybe", -3.0)],  # variants summed, others ignored
    }
    server = serve(lambda body, n: (200, completion("x", tops[text_of(body)]), 0.0))
    scores = judge(server, prompt_template="{prompt}").score(batch(), ["a", "b"])
    expected = [math.exp(-0.1) / (math.exp(-0.1) + math.exp(-2.3)),
                math.exp(-2.0) / (math.exp(-2.0) + math.exp(-0.5) + math.exp(-1.5))]
    assert scores.dtype == torch.float32 and scores.tolist() == pytest.approx(expected, rel=1e-6)


def test_rating_maps_1_to_n_onto_0_to_1(serve: Callable[[Answer], FakeJudge]) -> None:
    answers = {"a": "7", "b": "Rating: 10/10", "c": " 1."}
    server = serve(lambda body, n: (200, completion(answers[text_of(body)]), 0.0))
    scores = judge(server, mode="rating", max_rating=10, prompt_template="{prompt}").score(batch(3), ["a", "b", "c"])
    assert scores.tolist() == pytest.approx([6 / 9, 1.0, 0.0])
    assert all("logprobs" not in body and body["max_tokens"] == 8 for body in server.requests)


def test_the_request_carries_the_pixels_and_the_rendered_prompt(serve: Callable[[Answer], FakeJudge],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    server = serve(lambda body, n: (200, completion("Yes", [("Yes", -0.1), ("No", -2.3)]), 0.0))
    images = batch(1)
    template = 'Is this "{prompt}"? ({max_rating}) Answer yes or no.'
    reward = judge(server, prompt_template=template, top_logprobs=5, seed=7, api_key_env="JUDGE_TEST_KEY")
    reward.score(images, ["a cat"])
    (body,) = server.requests
    assert text_of(body) == 'Is this "a cat"? (10) Answer yes or no.'
    assert body["messages"][0]["content"][-1]["type"] == "text"  # images first, then the question
    assert {k: body[k] for k in ("model", "temperature", "seed", "max_tokens", "logprobs", "top_logprobs")} == \
        {"model": "judge", "temperature": 0.0, "seed": 7, "max_tokens": 1, "logprobs": True, "top_logprobs": 5}
    (url,) = images_of(body)
    assert url.startswith("data:image/png;base64,")
    decoded = decode(url)
    assert np.array_equal(decoded, to_uint8_hwc(images)[0].numpy())
    assert server.headers[0]["authorization"] == "Bearer sk-test"


def test_no_key_variable_sends_empty_and_jpeg_keeps_the_size(serve: Callable[[Answer], FakeJudge]) -> None:
    server = serve(lambda body, n: (200, completion("Yes", [("Yes", -0.1)]), 0.0))
    images = batch(1, 16, 12)
    judge(server, image_format="jpeg").score(images, ["p"])
    (url,) = images_of(server.requests[0])
    assert url.startswith("data:image/jpeg;base64,")
    decoded = decode(url).astype(float)
    assert decoded.shape == (16, 12, 3)
    assert np.abs(decoded - to_uint8_hwc(images)[0].numpy()).mean() < 8  # lossy, but the same picture
    assert server.headers[0]["authorization"] == "Bearer EMPTY"


def test_a_video_sends_evenly_spaced_frames_in_one_request(serve: Callable[[Answer], FakeJudge]) -> None:
    server = serve(lambda body, n: (200, completion("Yes", [("Yes", -0.1), ("No", -2.3)]), 0.0))
    video = torch.stack([torch.full((3, 4, 4), k / 255) for k in range(9)], dim=1)[None]  # [1, 3, 9, 4, 4]
    judge(server, max_frames=3).score(video, ["p"])
    (body,) = server.requests
    firsts = [decode(u)[0, 0, 0] for u in images_of(body)]
    assert firsts == [0, 4, 8]


def test_at_most_concurrency_requests_are_in_flight(serve: Callable[[Answer], FakeJudge]) -> None:
    server = serve(lambda body, n: (200, completion("Yes", [("Yes", -0.1), ("No", -2.3)]), 0.1))
    scores = judge(server, concurrency=3).score(batch(8, 2, 2), ["p"] * 8)
    assert len(server.requests) == 8 and scores.shape == (8,)
    assert server.max_in_flight == 3


@pytest.mark.parametrize(("mode", "answer", "quoted"), [
    ("yesno", completion("Maybe", [("Maybe", -0.1), ("Perhaps", -1.0)]), "'Maybe'"),
    ("yesno", completion("Yes"), "'Yes'"),  # a server that ignores logprobs
    ("rating", completion("eleven out of ten"), "'eleven out of ten'"),
    ("rating", completion("11"), "11 is not in 1..10"),
    ("rating", completion("7.5"), "'7.5'"),
])
def test_a_malformed_answer_is_a_reward_error_naming_the_table_and_the_answer(
        serve: Callable[[Answer], FakeJudge], mode: str, answer: dict[str, Any], quoted: str) -> None:
    server = serve(lambda body, n: (200, answer, 0.0))
    with pytest.raises(RewardError) as info:
        judge(server, mode=mode, retries=1).score(batch(1), ["p"])
    msg = str(info.value)
    assert "reward.models.vlm_judge" in msg and quoted in msg and "failed after 2 attempts" in msg
    assert len(server.requests) == 2


def test_the_first_failure_stops_the_batch(serve: Callable[[Answer], FakeJudge]) -> None:
    ok = completion("Yes", [("Yes", -0.1), ("No", -2.3)])
    server = serve(lambda body, n: (400, {"error": {"message": "bad"}}, 0.0) if text_of(body) == "bad"
                   else (200, ok, 0.2))
    with pytest.raises(RewardError, match=r"sample 0: HTTP 400: bad"):
        judge(server, concurrency=2, prompt_template="{prompt}").score(batch(6, 2, 2), ["bad"] + ["p"] * 5)
    assert len(server.requests) < 6  # the samples not yet sent were cancelled


def test_a_timeout_fails_after_retries_plus_one_attempts(serve: Callable[[Answer], FakeJudge]) -> None:
    server = serve(lambda body, n: (200, completion("Yes", [("Yes", -0.1)]), 1.0))
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        judge(server, timeout=0.2, retries=2).score(batch(1), ["p"])
    assert len(server.requests) == 3
    assert "failed after 3 attempts" in str(info.value) and "timeout = 0.2 s" in str(info.value)
    assert time.monotonic() - start < 3


def test_http_500_then_success_is_retried(serve: Callable[[Answer], FakeJudge]) -> None:
    ok = completion("Yes", [("Yes", -0.1), ("No", -2.3)])
    server = serve(lambda body, n: (500, {"error": {"message": "overloaded"}}, 0.0) if n == 1 else (200, ok, 0.0))
    score = judge(server, retries=1).score(batch(1), ["p"])
    assert score.item() == pytest.approx(math.exp(-0.1) / (math.exp(-0.1) + math.exp(-2.3)))
    assert len(server.requests) == 2


def test_http_500_past_the_retries_is_an_error_and_a_400_is_not_retried(serve: Callable[[Answer], FakeJudge]) -> None:
    server = serve(lambda body, n: (500, {"error": {"message": "overloaded"}}, 0.0))
    with pytest.raises(RewardError, match=r"failed after 1 attempt: HTTP 500: overloaded"):
        judge(server, retries=0).score(batch(1), ["p"])
    bad = serve(lambda body, n: (400, {"error": {"message": "model does not take images"}}, 0.0))
    with pytest.raises(RewardError, match=r"HTTP 400: model does not take images"):
        judge(bad, retries=3).score(batch(1), ["p"])
    assert len(bad.requests) == 1


def test_the_failure_policy_turns_a_failure_into_the_penalty(serve: Callable[[Answer], FakeJudge]) -> None:
    server = serve(lambda body, n: (503, {"error": {"message": "down"}}, 0.0))
    guarded = GuardedReward(judge(server, retries=0), on_error="penalty", penalty=-1.0)
    assert guarded.score(batch(2), ["p", "q"]).tolist() == [-1.0, -1.0]
    assert guarded.failures == 1 and "HTTP 503" in guarded.last_error


def test_a_dead_server_says_is_the_server_running() -> None:
    reward = vlm_judge({"base_url": "http://127.0.0.1:9/v1", "model": "judge", "retries": 0, "timeout": 2})
    with pytest.raises(RewardError, match="cannot connect.*is the server running at http://127.0.0.1:9/v1"):
        reward.score(batch(1), ["p"])


def test_the_probe_checks_the_model_is_served(serve: Callable[[Answer], FakeJudge]) -> None:
    server = serve(lambda body, n: (200, completion("Yes"), 0.0))
    judge(server).probe()
    with pytest.raises(RewardError, match=r"does not serve model 'other'; it serves \['judge'\]"):
        judge(server, model="other").probe()
    assert server.requests == []  # nothing scored


@pytest.mark.parametrize(("table", "match"), [
    ({"model": "m", "api_key": "sk-123"}, r"api_key: never put the key in a config file"),
    ({"model": "m", "temprature": 0}, r"reward.models.vlm_judge.temprature: unknown key; allowed: model, base_url"),
    ({}, r"reward.models.vlm_judge.model: must be the served model name"),
    ({"model": "m", "mode": "score"}, r"reward.models.vlm_judge.mode: must be one of"),
    ({"model": "m", "max_rating": 1}, r"max_rating: must be an integer >= 2"),
    ({"model": "m", "prompt_template": "{promt}"}, r"prompt_template: cannot be filled in \(KeyError"),
    ({"model": "m", "api_key_env": "sk-123"}, r"api_key_env: must be the NAME of an environment variable"),
    ({"model": "m", "api_key_env": "DIGENRL_SURELY_UNSET"}, r"variable DIGENRL_SURELY_UNSET is unset or empty"),
    ({"model": "m", "base_url": "127.0.0.1:8000"}, r"base_url: must be an http"),
])
def test_config_errors_name_the_key(table: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        vlm_judge(table)


def test_the_parsers() -> None:
    assert yes_probability([("\u2581Yes", 0.0), ("\u0120no", 0.0)]) == 0.5
    assert yes_probability([("yes", -1.0)]) == 1.0
    with pytest.raises(ValueError, match="neither yes nor no"):
        yes_probability([("yeah", 0.0)], answer="yeah")
    assert rating_score("8/10", 10) == pytest.approx(7 / 9)
    assert rating_score("Score: 3.", 5) == 0.5
    for bad in ("0", "-", "3.5", ""):
        with pytest.raises(ValueError):
            rating_score(bad, 5)


def test_validate_refuses_a_judge_that_does_not_serve_the_model_in_one_line(
        serve: Callable[[Answer], FakeJudge]) -> None:
    """`digenrl validate` (and run) probes the judge before anything starts: the model must be served."""
    from pathlib import Path

    from typer.testing import CliRunner

    from digenrl_cli.main import app

    server = serve(lambda body, n: (200, completion("Yes"), 0.0))
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
    table = f"{{base_url='{server.base_url}', model='judge', retries=0}}"
    args = ["validate", str(config), "--set", "reward.weights={vlm_judge=1.0}", "--set"]
    ok = CliRunner().invoke(app, [*args, f"reward.models={{vlm_judge={table}}}"])
    assert ok.exit_code == 0, ok.output
    wrong = CliRunner().invoke(app, [*args, f"reward.models={{vlm_judge={table.replace('judge', 'other')}}}"])
    assert wrong.exit_code == 2
    assert "config error: reward.models.vlm_judge:" in wrong.output and "does not serve model 'other'" in wrong.output
    assert "Traceback" not in wrong.output and server.requests == []  # nothing scored
