"""Settings of the disaggregated recipe that ``digenrl.config`` does not have yet.

A disaggregated config file is an ordinary run config (``[model] [rollout] [train] ...``) plus these
keys, which :func:`load_disagg_config` takes out before the rest is validated by
:func:`digenrl.config.config_from_dict` (so unknown keys stay errors everywhere)::

    [schedule]   name = "tag"            colocated | disaggregated | gap | tsp | tag | async1
                 fragment_groups, fragment_members, step_chunk, rollout_batch, train_pack, tag_steps
                 (optional ScheduleOptions overrides; staleness stays in ScheduleConfig)
    [placement]  rollout = 1, trainer = 1, reward = 0, actor_threads = 1,
                 workers = 0             > 0: wait for that many `digenrl worker --join` processes (one
                                         per GPU, any host) and place one actor on each
    [transport]  actors = "zmq"          zmq (one process per actor) | inproc (all in this process)
                 weights = "zmq"         zmq | torchdist (gloo on CPU, NCCL on GPU) | cuda_ipc
                 bucket_mb = 64.0        weight buckets
                 address = ""            the driver's bind address (default: a private ipc path)
    [log]        checkpoint_every = 1, keep_checkpoints = 2, trace = true, gantt = true,
                 tensorboard = false, live = false

The lead merges these fields into ``digenrl.config`` (see the module's report); until then the
recipe reads them from here.
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from digenrl.config import Config, apply_overrides, config_from_dict
from digenrl.errors import ConfigError

__all__ = ["DisaggSettings", "load_disagg_config", "split_disagg", "ACTOR_SCHEDULES"]

ACTOR_SCHEDULES = ("disaggregated", "gap", "tsp", "tag", "async1")
_OPTION_KEYS = ("fragment_groups", "fragment_members", "step_chunk", "rollout_batch", "train_pack", "tag_steps")
_KEYS: dict[str, tuple[str, ...]] = {
    "schedule": ("name", *_OPTION_KEYS),
    "placement": ("rollout", "trainer", "reward", "actor_threads", "workers"),
    "transport": ("actors", "weights", "bucket_mb", "address"),
    "log": ("checkpoint_every", "keep_checkpoints", "trace", "gantt", "tensorboard", "live"),
}


@dataclass(frozen=True)
class DisaggSettings:
    """The disaggregated recipe's own settings (see the module docstring for the TOML keys)."""

    schedule: str = "colocated"  # as digenrl.config.ScheduleConfig.mode; actor schedules are named
    options: dict[str, int] = field(default_factory=dict)
    rollout: int = 1
    trainer: int = 1
    reward: int = 0
    actor_threads: int = 1
    workers: int = 0
    actors: str = "zmq"
    weights: str = "zmq"
    bucket_mb: float = 64.0
    address: str = ""
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    trace: bool = True
    gantt: bool = True
    tensorboard: bool = False
    live: bool = False

    def __post_init__(self) -> None:
        allowed = ("colocated", *ACTOR_SCHEDULES)
        if self.schedule not in allowed:
            raise ConfigError(f"schedule.name: {self.schedule!r} is not allowed; allowed: {', '.join(allowed)}")
        for key, value in self.options.items():
            if key not in _OPTION_KEYS or not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"schedule.{key}: must be a positive integer, got {value!r}")
        for key, low in (("rollout", 0), ("trainer", 1), ("reward", 0), ("actor_threads", 1), ("workers", 0),
                         ("checkpoint_every", 0), ("keep_checkpoints", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                table = "log" if key in ("checkpoint_every", "keep_checkpoints") else "placement"
                raise ConfigError(f"{table}.{key}: must be an integer >= {low}, got {value!r}")
        if self.actors not in ("zmq", "inproc"):
            raise ConfigError(f"transport.actors: {self.actors!r} is not allowed; allowed: 'zmq', 'inproc'")
        if self.weights not in ("zmq", "torchdist", "cuda_ipc"):
            raise ConfigError(f"transport.weights: {self.weights!r} is not allowed; allowed: 'zmq', 'torchdist', 'cuda_ipc'")
        if self.actors == "inproc" and self.weights != "zmq":
            raise ConfigError("transport.weights must be 'zmq' (actor messages) when transport.actors = 'inproc'")
        if self.workers and self.workers < self.rollout + self.trainer + self.reward:
            raise ConfigError(f"placement.workers = {self.workers}: one actor per joined worker needs at least "
                              f"{self.rollout + self.trainer + self.reward} (rollout + trainer + reward)")
        if self.workers and (self.actors != "zmq" or not self.address.startswith("tcp://")):
            raise ConfigError("placement.workers > 0 needs transport.actors = 'zmq' and transport.address = "
                              "'tcp://<this host>:<port>' for the workers to join")
        if not self.bucket_mb > 0:
            raise ConfigError(f"transport.bucket_mb: must be > 0, got {self.bucket_mb!r}")
        if self.rollout == 0 and self.schedule not in ("tag", "async1", "colocated"):
            raise ConfigError(f"placement.rollout = 0 needs a schedule with TAG (tag, async1), not {self.schedule!r}")

    @property
    def disaggregated(self) -> bool:
        """True when the run uses actors (every schedule except ``colocated``)."""
        return self.schedule != "colocated"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DisaggSettings:
        return cls(**data)


def split_disagg(data: dict[str, Any]) -> tuple[dict[str, Any], DisaggSettings]:
    """Take this module's keys out of nested config tables; returns (rest, settings).

    Raises:
        ConfigError: a value of the wrong type or outside its allowed set (names the key).
    """
    rest = copy.deepcopy(data)
    found: dict[str, Any] = {}
    options: dict[str, int] = {}
    for table, keys in _KEYS.items():
        section = rest.get(table)
        if not isinstance(section, dict):
            continue
        for key in keys:
            if key not in section:
                continue
            value = section.pop(key)
            if table == "schedule" and key in _OPTION_KEYS:
                options[key] = value
            else:
                found["schedule" if (table, key) == ("schedule", "name") else key] = value
    # The base ScheduleConfig only knows mode = "colocated"; the name above decides the recipe.
    if isinstance(rest.get("schedule"), dict):
        rest["schedule"].pop("mode", None)
    types = {f.name: f.type for f in dataclasses.fields(DisaggSettings)}
    for key, value in found.items():
        want = types[key]
        ok = (isinstance(value, bool) if want == "bool" else
              isinstance(value, int | float) and not isinstance(value, bool) if want == "float" else
              isinstance(value, int) and not isinstance(value, bool) if want == "int" else
              isinstance(value, str))
        if not ok:
            raise ConfigError(f"{key}: must be of type {want}, got {value!r}")
        if want == "float":
            found[key] = float(value)
    return rest, DisaggSettings(options=options, **found)


def load_disagg_config(path: str | Path, overrides: list[str] | None = None) -> tuple[Config, DisaggSettings]:
    """Read a TOML config with ``--set`` overrides into the base :class:`Config` and the settings here.

    Raises:
        ConfigError: missing file, invalid TOML, or any invalid key or value (named).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from exc
    rest, settings = split_disagg(apply_overrides(data, overrides or []))
    return config_from_dict(rest), settings
