"""A vision-language judge behind any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, TGI).

Serve a judge the usual way, then point ``[reward.models.vlm_judge]`` at it::

    vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8000

    [reward]
    weights = {vlm_judge = 1.0}
    [reward.models.vlm_judge]
    base_url = "http://127.0.0.1:8000/v1"
    model = "Qwen/Qwen2.5-VL-7B-Instruct"
    mode = "yesno"                      # or "rating" (with max_rating = N)
    prompt_template = 'Does this image show "{prompt}"? Answer yes or no.'
    api_key_env = "JUDGE_API_KEY"       # the NAME of a variable holding the key; never the key itself

Each sample is one request (through the ``openai`` client): its frames as base64 data URLs (PNG, or
JPEG at quality 95 without chroma subsampling; the decoded pixels rounded to 8 bits, never resized)
followed by the rendered template (``{prompt}`` and ``{max_rating}`` are filled in). Requests are
deterministic: temperature 0 and a fixed ``seed``. The score in ``[0, 1]`` is read from the answer:

* ``yesno``: ``P(yes) / (P(yes) + P(no))`` over the first token's ``top_logprobs`` (variants differing
  in case or surrounding space summed); no yes or no among them is a parse failure.
* ``rating``: the first integer in the answer text, ``r`` in ``1..max_rating``, gives
  ``(r - 1) / (max_rating - 1)``; no integer, a decimal or one out of range is a parse failure.

At most ``concurrency`` requests are in flight. A request that times out, cannot connect, gets HTTP
408/409/429/5xx or a malformed answer is tried again, ``retries`` times after the first (the client's
own retries are off, so the count is ours); any other HTTP error is raised at once. The final failure
is a :class:`~digenrl.rewards.base.RewardError`, which ``reward.on_error`` turns into the penalty or a
stopped run (:class:`~digenrl.rewards.base.GuardedReward`). ``openai`` is an optional extra
(``pip install 'digenrl[judge]'``), imported on first use.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import logging
import math
import os
import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from digenrl.errors import ConfigError
from digenrl.rewards.base import RewardError, as_frames, check_batch, to_uint8_hwc

__all__ = ["VlmJudgeOptions", "VlmJudge", "vlm_judge", "yes_probability", "rating_score", "data_url"]

log = logging.getLogger(__name__)

TABLE = "reward.models.vlm_judge"
MODES = ("yesno", "rating")
IMAGE_FORMATS = ("png", "jpeg")
DEFAULT_TEMPLATES = {
    "yesno": 'Does this image match the description "{prompt}"? Answer yes or no.',
    "rating": 'Rate from 1 to {max_rating} how well this image matches the description "{prompt}". '
              "Answer with the number only.",
}
_TRANSIENT_STATUS = (408, 409, 429)  # plus every 5xx: what the client itself would have retried
_INTEGER = re.compile(r"(?<![\d.])\d+(?!\d|\.\d)")  # "7", "7." and "8/10" -> 7, 8; never a decimal's digits


class _Unparsable(ValueError):
    """The server answered, but not in a form the mode can score."""


@dataclass(frozen=True)
class VlmJudgeOptions:
    """``[reward.models.vlm_judge]``, validated on construction.

    Raises:
        ConfigError: a value of the wrong type or out of range, naming ``reward.models.vlm_judge.<key>``.
    """

    model: str = ""  # the served model name (required): what GET {base_url}/models lists
    base_url: str = "http://127.0.0.1:8000/v1"  # the API root, ending in /v1 (vllm serve's default port)
    mode: str = "yesno"
    prompt_template: str = ""  # str.format with {prompt} (and optionally {max_rating}); "" = the mode's default
    max_rating: int = 10
    top_logprobs: int = 20  # yesno: how many first-token alternatives to ask for (OpenAI allows up to 20)
    max_tokens: int = 8  # rating: answer length (yesno always asks for 1 token)
    image_format: str = "png"
    max_frames: int = 8  # videos: at most this many evenly spaced frames per request
    api_key_env: str = ""  # the NAME of an environment variable holding the key; "" sends "EMPTY" (vLLM's default)
    concurrency: int = 8
    retries: int = 2
    timeout: float = 60.0  # seconds per request
    backoff: float = 0.5  # first retry delay in seconds, doubling
    seed: int = 0

    def __post_init__(self) -> None:
        _need("model", isinstance(self.model, str) and bool(self.model.strip()),
              "the served model name (what GET <base_url>/models lists)", self.model)
        _need("base_url", isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://")),
              "an http:// or https:// URL of the API root, e.g. http://127.0.0.1:8000/v1", self.base_url)
        _need("mode", self.mode in MODES, f"one of {MODES}", self.mode)
        _need("image_format", self.image_format in IMAGE_FORMATS, f"one of {IMAGE_FORMATS}", self.image_format)
        for key, low in (("max_rating", 2), ("top_logprobs", 1), ("max_tokens", 1), ("max_frames", 1),
                         ("concurrency", 1), ("retries", 0), ("seed", 0)):
            value = getattr(self, key)
            _need(key, _is_int(value) and value >= low, f"an integer >= {low}", value)
        for key in ("timeout", "backoff"):
            value = getattr(self, key)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            _need(key, ok and (value > 0 if key == "timeout" else value >= 0), "a number > 0" if key == "timeout"
                  else "a number >= 0", value)
        _need("api_key_env", isinstance(self.api_key_env, str) and re.fullmatch(r"[A-Za-z_]\w*|", self.api_key_env),
              "the NAME of an environment variable (e.g. JUDGE_API_KEY), or empty", self.api_key_env)
        _need("prompt_template", isinstance(self.prompt_template, str), "a string", self.prompt_template)
        try:
            self.render("x")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"{TABLE}.prompt_template: cannot be filled in ({type(exc).__name__}: {exc}); it is a "
                              f"Python format string whose only fields are {{prompt}} and {{max_rating}} "
                              f"(write {{{{ and }}}} for literal braces), got {self.prompt_template!r}") from None

    @classmethod
    def from_table(cls, table: Mapping[str, Any] | None) -> VlmJudgeOptions:
        """Options from the plain ``[reward.models.vlm_judge]`` table.

        Raises:
            ConfigError: an unknown key (a key itself gets its own message), or a bad value.
        """
        table = dict(table or {})
        if "api_key" in table:
            raise ConfigError(f"{TABLE}.api_key: never put the key in a config file; set {TABLE}.api_key_env "
                              "to the NAME of an environment variable that holds it")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(table) - set(allowed))
        if unknown:
            raise ConfigError(f"{TABLE}.{unknown[0]}: unknown key; allowed: {', '.join(allowed)}")
        return cls(**table)

    def render(self, prompt: str) -> str:
        """The text sent after the images for ``prompt``."""
        template = self.prompt_template or DEFAULT_TEMPLATES[self.mode]
        return template.format(prompt=prompt, max_rating=self.max_rating)

    def api_key(self) -> str:
        """The key from ``api_key_env``'s variable, or ``"EMPTY"`` when no variable is named.

        Raises:
            ConfigError: the named variable is unset or empty.
        """
        if not self.api_key_env:
            return "EMPTY"
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise ConfigError(f"{TABLE}.api_key_env: the environment variable {self.api_key_env} is unset or empty; "
                              f"export it in the reward process's environment (or set api_key_env = \"\" for a "
                              f"server without a key)")
        return key


def vlm_judge(options: Mapping[str, Any] | None = None, device: str | None = None,
              dtype: str | None = None) -> VlmJudge:
    """The registry's factory: a judge from the ``[reward.models.vlm_judge]`` table.

    ``device`` and ``dtype`` are accepted for the registry's uniform call and ignored: the judge runs on
    its server.

    Raises:
        ConfigError: an unknown key, a bad value, or ``api_key_env`` naming an unset variable.
    """
    del device, dtype
    return VlmJudge(VlmJudgeOptions.from_table(options))


class VlmJudge:
    """Scores each sample with one chat-completions request to a vision-language model.

    Args:
        options: the validated ``[reward.models.vlm_judge]`` table.

    Raises:
        ConfigError: ``api_key_env`` names an unset variable.
    """

    name = "vlm_judge"

    def __init__(self, options: VlmJudgeOptions) -> None:
        self.options = options
        self._api_key = options.api_key()  # resolved here so a missing key fails before any scoring
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._finalizer: Callable[[], Any] | None = None

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """One request per sample, at most ``concurrency`` in flight.

        Raises:
            RewardError: a malformed batch, ``openai`` not installed, or a sample whose request failed
                after its retries (HTTP error, timeout, unparsable answer); the message names the table,
                the server, the sample and the cause.
        """
        check_batch(images, prompts, self.name)
        b = images.shape[0]
        if b == 0:
            return torch.zeros(0, dtype=torch.float32)
        client = self._openai_client()
        frames, f = as_frames(images)
        pixels = to_uint8_hwc(frames).reshape(b, f, *frames.shape[2:], 3)
        keep = _spread(f, self.options.max_frames)
        stop = threading.Event()  # set on the first failure: the other samples give up instead of retrying
        with ThreadPoolExecutor(max_workers=min(self.options.concurrency, b), thread_name_prefix="vlm-judge") as pool:
            futures = [pool.submit(self._judge, client, k, [pixels[k, i].numpy() for i in keep], prompts[k], stop)
                       for k in range(b)]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            errors = [exc for fut in futures if fut in done and (exc := fut.exception()) is not None]
            if errors:
                stop.set()
                for fut in futures:
                    fut.cancel()
                raise errors[0]
        return torch.tensor([fut.result() for fut in futures], dtype=torch.float32)

    def probe(self) -> None:
        """Check, scoring nothing, that ``base_url`` answers and serves ``model`` (``GET /models``).

        Raises:
            RewardError: ``openai`` is not installed, nothing answers after the retries, or the server
                does not list ``model`` (the message lists what it serves).
        """
        client = self._openai_client()
        served = self._with_retries("probe", lambda: [m.id for m in client.models.list()], threading.Event())
        if self.options.model not in served:
            raise RewardError(f"{self._who}: the server does not serve model {self.options.model!r}; it serves "
                              f"{served}; set {TABLE}.model to one of them")

    def close(self) -> None:
        """Close the HTTP client (idempotent; also run when the judge is garbage-collected)."""
        if self._finalizer is not None:
            self._finalizer()

    @property
    def _who(self) -> str:
        return f"reward {self.name!r} ({TABLE}: model {self.options.model!r} at {self.options.base_url})"

    def _openai_client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                try:
                    import openai
                except ImportError as exc:
                    raise RewardError(f"{self._who} needs the optional extra: pip install 'digenrl[judge]' "
                                      "(openai>=2,<4)") from exc
                # max_retries=0: the retries are ours (counted, logged, and the same for every failure kind).
                self._client = openai.OpenAI(base_url=self.options.base_url, api_key=self._api_key,
                                             timeout=self.options.timeout, max_retries=0)
                self._finalizer = weakref.finalize(self, self._client.close)
            return self._client

    def _judge(self, client: Any, k: int, frames: list[Any], prompt: str, stop: threading.Event) -> float:
        o = self.options
        content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(im, o.image_format)}}
                                         for im in frames]
        content.append({"type": "text", "text": o.render(prompt)})
        request: dict[str, Any] = {"model": o.model, "messages": [{"role": "user", "content": content}],
                                   "temperature": 0.0, "seed": o.seed, "n": 1}
        if o.mode == "yesno":
            request.update(max_tokens=1, logprobs=True, top_logprobs=o.top_logprobs)
        else:
            request.update(max_tokens=o.max_tokens)
        return float(self._with_retries(f"sample {k}", lambda: self._parse(client.chat.completions.create(**request)),
                                        stop))

    def _parse(self, reply: Any) -> float:
        try:
            choice = reply.choices[0]
            text = choice.message.content or ""
        except (AttributeError, IndexError, TypeError):
            raise _Unparsable(f"the answer has no choices[0].message: {str(reply)[:300]}") from None
        if self.options.mode == "rating":
            return rating_score(text, self.options.max_rating)
        try:
            top = [(t.token, t.logprob) for t in choice.logprobs.content[0].top_logprobs]
        except (AttributeError, IndexError, TypeError):
            raise _Unparsable(f"answer {text!r} came without choices[0].logprobs.content[0].top_logprobs (does the "
                              f"server return logprobs? otherwise use mode = \"rating\")") from None
        return yes_probability(top, answer=text)

    def _with_retries(self, what: str, attempt: Callable[[], Any], stop: threading.Event) -> Any:
        import openai

        o, delay, last = self.options, self.options.backoff, "no attempt"
        for n in range(o.retries + 1):
            try:
                return attempt()
            except openai.APIStatusError as exc:
                last = f"HTTP {exc.status_code}: {_detail(exc)}"
                if exc.status_code not in _TRANSIENT_STATUS and exc.status_code < 500:
                    hint = (f" (is {TABLE}.base_url the API root, ending in /v1, and {TABLE}.model a served model?)"
                            if exc.status_code == 404 else "")
                    raise RewardError(f"{self._who}: {what}: {last}{hint}") from None
            except openai.APITimeoutError:  # before APIConnectionError, its base class
                last = f"no answer within timeout = {o.timeout:g} s"
            except openai.APIConnectionError as exc:
                last = f"cannot connect ({exc.__cause__ or exc}); is the server running at {o.base_url}?"
            except (openai.OpenAIError, _Unparsable) as exc:
                last = str(exc)
            if n < o.retries and not stop.is_set():
                log.warning("%s: %s: attempt %d failed (%s); retrying in %.2fs", self._who, what, n + 1, last, delay)
                stop.wait(delay)  # a sleep that another sample's failure cuts short
                delay *= 2
            if stop.is_set():
                raise RewardError(f"{self._who}: {what}: abandoned after another sample failed; last: {last}")
        tries = f"{o.retries + 1} attempt{'s' if o.retries else ''}"
        raise RewardError(f"{self._who}: {what}: failed after {tries}: {last}")


def yes_probability(top_logprobs: Sequence[tuple[str, float]], *, answer: str = "") -> float:
    """``P(yes) / (P(yes) + P(no))`` from ``(token, logprob)`` pairs of one position.

    Tokens are compared lower-cased without surrounding space (or the ``Ġ``/``▁`` word markers some
    servers leave), and the probabilities of all variants of a word are summed.

    Raises:
        ValueError: neither yes nor no among the tokens (the message quotes ``answer`` and the tokens).
    """
    mass = {"yes": 0.0, "no": 0.0}
    for token, logprob in top_logprobs:
        word = str(token).strip().strip("Ġ▁").strip().lower()
        if word in mass:
            mass[word] += math.exp(float(logprob))
    total = mass["yes"] + mass["no"]
    if not total > 0:
        tokens = [t for t, _ in top_logprobs][:20]
        raise _Unparsable(f"answer {answer!r}: neither yes nor no among the first token's top logprobs {tokens}")
    return mass["yes"] / total


def rating_score(text: str, max_rating: int) -> float:
    """``(r - 1) / (max_rating - 1)`` for the first integer ``r`` in ``text``.

    Raises:
        ValueError: no integer in the text, or the first one outside ``1..max_rating``.
    """
    m = _INTEGER.search(text)
    if m is None or not 1 <= int(m.group()) <= max_rating:
        found = "no integer" if m is None else f"{m.group()} is not"
        raise _Unparsable(f"answer {text[:300]!r}: {found} in 1..{max_rating}")
    return (int(m.group()) - 1) / (max_rating - 1)


def data_url(pixels: Any, fmt: str = "png") -> str:
    """An ``[H, W, 3]`` uint8 array as a ``data:image/...;base64,`` URL, pixels as they are (no resize).

    JPEG is written at quality 95 with 4:4:4 chroma (PIL's default 4:2:0 would halve the colour resolution).

    Raises:
        ValueError: an unknown format.
    """
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"image format must be one of {IMAGE_FORMATS}, got {fmt!r}")
    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(pixels).save(buf, format="PNG")
    else:
        Image.fromarray(pixels).save(buf, format="JPEG", quality=95, subsampling=0)
    return f"data:image/{fmt};base64,{base64.b64encode(buf.getvalue()).decode()}"


def _spread(frames: int, most: int) -> list[int]:
    """At most ``most`` evenly spaced frame indices, first and last included."""
    if frames <= most:
        return list(range(frames))
    if most == 1:
        return [0]
    return [round(i * (frames - 1) / (most - 1)) for i in range(most)]


def _detail(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        return str(body.get("message", body))[:300]
    return str(getattr(exc, "message", exc))[:300]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _need(key: str, ok: object, what: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"{TABLE}.{key}: must be {what}, got {value!r}")
