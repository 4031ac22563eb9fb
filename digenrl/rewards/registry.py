"""Rewards by name, and the factory that turns a ``[reward]`` config into one reward object.

Every reward but ``remote`` is built by a :data:`RewardFactory` in :data:`_FACTORIES`::

    factory(table, device, dtype) -> Reward

``table`` is the reward's own ``[reward.models.<name>]`` table as a plain dict (``{}`` when the config
has none), ``device`` where it runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``: ``reward.device``, or the
actor's ``model.device`` when that is empty) and ``dtype`` the resolved torch dtype name
(``"float32"``, ``"bfloat16"``, ``"float16"``: ``reward.dtype``, or bf16 on CUDA and fp32 elsewhere).
A name of the user's own, whose table has a ``python`` key, is built by :mod:`digenrl.rewards.user` instead.
A reward that needs neither ignores them. :data:`_TABLES` optionally declares a table's keys (checked
when the config loads; without an entry the factory checks its table itself), :data:`_CHECKS` the
cheap file checks ``digenrl validate`` runs before anything starts (:func:`check_reward_files`).
The rewards layer imports no config: callers pass plain values (``RewardConfig.build_options``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from digenrl.errors import ConfigError
from digenrl.rewards._learned import DTYPES, TableSpec, check_table
from digenrl.rewards.aesthetic import AESTHETIC_TABLE
from digenrl.rewards.base import GuardedReward, Reward, WeightedReward
from digenrl.rewards.clip import CLIP_TABLE
from digenrl.rewards.hps import HPS_TABLE
from digenrl.rewards.user import check_spelling, check_user_reward, is_user_table, load_user_reward

__all__ = ["REWARD_NAMES", "RewardFactory", "make_reward", "build_reward", "check_models", "check_reward_files",
           "resolve_dtype_name"]

RewardFactory = Callable[[Mapping[str, Any], str, str], Reward]
"""``factory(table, device, dtype) -> Reward`` (module docstring)."""


def _jpeg_c(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.jpeg import JpegCompressibility

    return JpegCompressibility()


def _jpeg_i(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.jpeg import JpegIncompressibility

    return JpegIncompressibility()


def _color(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.color import ColorReward

    return ColorReward()


def _edit_consistency(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.edit import EditConsistencyReward

    return EditConsistencyReward()


def _shapes(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.shapes import ShapesReward

    return ShapesReward()


def _ocr(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.ocr import OcrReward

    return OcrReward()


def _clipscore(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.clip import ClipScore

    return ClipScore(table, device, dtype)


def _pickscore(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.clip import PickScore

    return PickScore(table, device, dtype)


def _aesthetic(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.aesthetic import AestheticReward

    return AestheticReward(table, device, dtype)


def _hpsv2(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.hps import HpsV2Reward

    return HpsV2Reward(table, device, dtype)


def _vlm_judge(table: Mapping[str, Any], device: str, dtype: str) -> Reward:
    from digenrl.rewards.vlm import vlm_judge

    return vlm_judge(table, device, dtype)  # (it checks its own table: its server holds the model)


def _check_clipscore(table: Mapping[str, Any]) -> None:
    from digenrl.rewards.clip import check_clipscore

    check_clipscore(table)


def _check_pickscore(table: Mapping[str, Any]) -> None:
    from digenrl.rewards.clip import check_pickscore

    check_pickscore(table)


def _check_aesthetic(table: Mapping[str, Any]) -> None:
    from digenrl.rewards.aesthetic import check_aesthetic

    check_aesthetic(table)


def _check_hpsv2(table: Mapping[str, Any]) -> None:
    from digenrl.rewards.hps import check_hpsv2

    check_hpsv2(table)


_FACTORIES: dict[str, RewardFactory] = {
    "jpeg_compressibility": _jpeg_c,
    "jpeg_incompressibility": _jpeg_i,
    "color": _color,
    "edit_consistency": _edit_consistency,  # an edit model's: the output against its input image
    "shapes": _shapes,
    "ocr": _ocr,
    "clipscore": _clipscore,
    "pickscore": _pickscore,
    "aesthetic": _aesthetic,
    "hpsv2": _hpsv2,
    "vlm_judge": _vlm_judge,
}
_NO_TABLE = TableSpec(keys={})
_TABLES: dict[str, TableSpec] = {
    "jpeg_compressibility": _NO_TABLE,
    "jpeg_incompressibility": _NO_TABLE,
    "color": _NO_TABLE,
    "edit_consistency": _NO_TABLE,
    "shapes": _NO_TABLE,
    "ocr": _NO_TABLE,
    "clipscore": CLIP_TABLE,
    "pickscore": CLIP_TABLE,
    "aesthetic": AESTHETIC_TABLE,
    "hpsv2": HPS_TABLE,
}
_CHECKS: dict[str, Callable[[Mapping[str, Any]], None]] = {
    "clipscore": _check_clipscore,
    "pickscore": _check_pickscore,
    "aesthetic": _check_aesthetic,
    "hpsv2": _check_hpsv2,
}
# "remote" is built from reward.url and its neighbours, so it is not in the factory table.
REWARD_NAMES: tuple[str, ...] = (*_FACTORIES, "remote")


def resolve_dtype_name(dtype: str, device: str) -> str:
    """``reward.dtype`` resolved: ``""`` is ``"bfloat16"`` on CUDA and ``"float32"`` elsewhere.

    Raises:
        ConfigError: an unknown dtype name.
    """
    if not dtype:
        return "bfloat16" if str(device).startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"reward.dtype: {dtype!r} is not allowed; allowed: '', {', '.join(map(repr, DTYPES))}")
    return dtype


def check_models(weights: Mapping[str, float], models: Mapping[str, Any]) -> None:
    """The ``[reward.models.*]`` tables as the config loads (no files read): known names, known keys of the
    right types, and every required key of a weighted reward.

    Raises:
        ConfigError: naming ``reward.models.<name>[.<key>]``.
    """
    for name, table in models.items():
        if name == "remote":
            raise ConfigError("reward.models.remote: the 'remote' reward is set by reward.url (and timeout, retries, "
                              "image_format), not a table")
        if not isinstance(table, Mapping):
            raise ConfigError(f"reward.models.{name}: must be a table, got {table!r}")
        if is_user_table(table):
            if name in _FACTORIES:
                raise ConfigError(f"reward.models.{name}.python: {name!r} is a built-in reward; give your own reward "
                                  "a name of its own (in reward.weights and [reward.models.<name>])")
            check_spelling(name, table["python"])
        elif name not in _FACTORIES:
            raise ConfigError(f"reward.models.{name}: unknown reward {name!r}; allowed: {', '.join(_FACTORIES)}, "
                              f"or your own: python = \"path/to/file.py:ClassName\" (docs/rewards.md)")
    for name in dict.fromkeys([*models, *weights]):
        spec = _TABLES.get(name)
        if spec is not None:
            _check_spec(name, models.get(name, {}), spec, required=name in weights)


def _check_spec(name: str, table: Mapping[str, Any], spec: TableSpec, *, required: bool) -> None:
    if not spec.keys and table:
        raise ConfigError(f"reward.models.{name}: the {name!r} reward takes no settings, got {dict(table)!r}")
    check_table(name, table, spec, required=required)


def check_reward_files(weights: Mapping[str, float], models: Mapping[str, Any]) -> None:
    """The cheap checks of every weighted learned reward's files (``digenrl validate``, before ``digenrl run``
    starts anything): paths, ``config.json``, state-dict headers and the optional extras; no weights loaded.

    Raises:
        ConfigError: naming the key.
    """
    for name in weights:
        if name in _CHECKS:
            _CHECKS[name](models.get(name, {}))
        elif is_user_table(models.get(name)):
            check_user_reward(name, models[name])


def make_reward(name: str, *, table: Mapping[str, Any] | None = None, device: str = "cpu", dtype: str = "",
                url: str | None = None, timeout: float = 30.0, retries: int = 2, image_format: str = "png",
                remote_sources: bool = False) -> Reward:
    """One reward by name, built by its factory from its table on ``device`` in ``dtype`` (a name of the user's
    own: the class its table's ``python`` names, :mod:`digenrl.rewards.user`).

    Raises:
        ConfigError: unknown name, ``remote`` without a URL, or a problem with the reward's table (naming
            ``reward.models.<name>.<key>``), or with a Python reward's file, class or constructor.
    """
    if name == "remote":
        if not url:
            raise ConfigError("reward.url: the 'remote' reward needs a url (e.g. http://127.0.0.1:18085/score)")
        from digenrl.rewards.remote import RemoteReward

        return RemoteReward(url, timeout=timeout, retries=retries, image_format=image_format,
                            send_sources=remote_sources)
    if is_user_table(table) and name not in _FACTORIES:
        return load_user_reward(name, table, device, resolve_dtype_name(dtype, device))  # type: ignore[arg-type]
    if name not in _FACTORIES:
        raise ConfigError(f"reward.weights: unknown reward {name!r}; allowed: {', '.join(REWARD_NAMES)}, or your own: "
                          f"[reward.models.{name}] python = \"path/to/file.py:ClassName\" (docs/rewards.md)")
    table = dict(table or {})
    if name in _TABLES:
        _check_spec(name, table, _TABLES[name], required=True)
    return _FACTORIES[name](table, device, resolve_dtype_name(dtype, device))


def build_reward(
    weights: Mapping[str, float],
    *,
    models: Mapping[str, Mapping[str, Any]] | None = None,
    device: str = "cpu",
    dtype: str = "",
    url: str | None = None,
    timeout: float = 30.0,
    retries: int = 2,
    image_format: str = "png",
    remote_sources: bool = False,
    on_error: str = "raise",
    penalty: float = -1.0,
) -> GuardedReward:
    """The weighted sum of the named rewards, behind the failure policy.

    Args:
        weights: reward name -> weight (``reward.weights``).
        models: reward name -> its ``[reward.models.<name>]`` table (``reward.models``).
        device: where the rewards run (``reward.device`` resolved by the caller: never ``""``).
        dtype: ``reward.dtype`` (``""``: bf16 on CUDA, fp32 elsewhere).
        url, timeout, retries, image_format, remote_sources: the ``remote`` reward's settings
            (``remote_sources``: send the samples' input images, for a served edit reward).
        on_error, penalty: the failure policy (:class:`~digenrl.rewards.base.GuardedReward`).

    Raises:
        ConfigError: empty weights, an unknown name, a non-finite weight, or a reward's table or files.
    """
    if not weights:
        raise ConfigError(f"reward.weights: at least one reward is needed; allowed: {', '.join(REWARD_NAMES)}")
    models = dict(models or {})
    check_models(weights, models)
    parts = {}
    for name, w in weights.items():
        if not isinstance(w, int | float) or w != w or abs(w) == float("inf"):
            raise ConfigError(f"reward.weights.{name}: weight must be a finite number, got {w!r}")
        reward = make_reward(name, table=models.get(name), device=device, dtype=dtype, url=url, timeout=timeout,
                             retries=retries, image_format=image_format, remote_sources=remote_sources)
        parts[name] = (reward, float(w))
    return GuardedReward(WeightedReward(parts), on_error=on_error, penalty=penalty)
