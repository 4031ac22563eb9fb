"""Rewards by name, and the factory that turns a ``[reward]`` config into one reward object."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from digenrl.errors import ConfigError
from digenrl.rewards.base import GuardedReward, Reward, WeightedReward

__all__ = ["REWARD_NAMES", "make_reward", "build_reward"]


def _jpeg_c() -> Reward:
    from digenrl.rewards.jpeg import JpegCompressibility

    return JpegCompressibility()


def _jpeg_i() -> Reward:
    from digenrl.rewards.jpeg import JpegIncompressibility

    return JpegIncompressibility()


def _color() -> Reward:
    from digenrl.rewards.color import ColorReward

    return ColorReward()


def _shapes() -> Reward:
    from digenrl.rewards.shapes import ShapesReward

    return ShapesReward()


def _ocr() -> Reward:
    from digenrl.rewards.ocr import OcrReward

    return OcrReward()


_FACTORIES: dict[str, Callable[[], Reward]] = {
    "jpeg_compressibility": _jpeg_c,
    "jpeg_incompressibility": _jpeg_i,
    "color": _color,
    "shapes": _shapes,
    "ocr": _ocr,
}
# "remote" is built from a URL, so it is not in the zero-argument factory table.
REWARD_NAMES: tuple[str, ...] = (*_FACTORIES, "remote")


def make_reward(name: str, *, url: str | None = None, timeout: float = 30.0, retries: int = 2,
                image_format: str = "png") -> Reward:
    """One reward by name.

    Raises:
        ConfigError: unknown name, or ``remote`` without a URL.
    """
    if name == "remote":
        if not url:
            raise ConfigError("reward.url: the 'remote' reward needs a url (e.g. http://127.0.0.1:18085/score)")
        from digenrl.rewards.remote import RemoteReward

        return RemoteReward(url, timeout=timeout, retries=retries, image_format=image_format)
    if name not in _FACTORIES:
        raise ConfigError(f"reward.weights: unknown reward {name!r}; allowed: {', '.join(REWARD_NAMES)}")
    return _FACTORIES[name]()


def build_reward(
    weights: Mapping[str, float],
    *,
    url: str | None = None,
    timeout: float = 30.0,
    retries: int = 2,
    image_format: str = "png",
    on_error: str = "raise",
    penalty: float = -1.0,
) -> GuardedReward:
    """The weighted sum of the named rewards, behind the failure policy.

    Raises:
        ConfigError: empty weights, an unknown name, or a non-finite weight.
    """
    if not weights:
        raise ConfigError(f"reward.weights: at least one reward is needed; allowed: {', '.join(REWARD_NAMES)}")
    parts = {}
    for name, w in weights.items():
        if not isinstance(w, int | float) or w != w or abs(w) == float("inf"):
            raise ConfigError(f"reward.weights.{name}: weight must be a finite number, got {w!r}")
        parts[name] = (make_reward(name, url=url, timeout=timeout, retries=retries, image_format=image_format), float(w))
    return GuardedReward(WeightedReward(parts), on_error=on_error, penalty=penalty)
