"""User scenarios: a fleet and a workload from a small TOML file, for `digenrl bench bubbles` and `digenrl plan`.

::

    name = "my-cluster"           # optional; default: the file name
    model = "flux"                # qwen-image | flux | wan | hunyuan-video | sd3 | wan2.2 | qwen-image-edit (or
                                  # qwenimage, wan21, hunyuanvideo, wan22, qwenimage_edit)
    variant = ""                  # optional: the model's size (wan: "1.3B" | "14B"; sd3: "medium" | "large");
                                  # "" = the largest
    prompts = 32                  # prompts per optimizer step
    group_size = 12
    num_steps = 16
    trained_steps = 9             # trained transitions per sample
    rollout_pool = "L40S"         # optional: the device type that generates in disaggregated schedules

    [[pools]]                     # one table per device type
    device = "H800"               # a digenrl.sim.devices catalog name
    count = 8
    roles = ["trainer"]           # optional: the roles `digenrl plan --fleet` may give this pool

    [[pools]]
    device = "L40S"
    count = 16
    roles = ["rollout"]
    link = "1gbit/20ms"           # optional: this pool is a far site behind a link of that rate (and latency)

The model is priced with its paper recipe (``profiles.PROFILES``: resolution, CFG, LoRA or full
fine-tuning) at ``variant``'s size. Links come with the device type (NVLink / PCIe inside a node of 8,
the type's NIC across nodes; see ``devices.py``); a pool with a ``link`` is a site of its own behind it
(``links.py``). ``fleet_pools`` parses the short form of the command line, ``16xH800``, ``8xH800+16xL40S``
or ``8xH800+16xL40S@1gbit/20ms`` (the grammar: ``links.py``); ``format_fleet`` writes it back.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from digenrl.errors import ConfigError
from digenrl.sim.devices import device_spec
from digenrl.sim.flops import VARIANTS
from digenrl.sim.link_traffic import far_links
from digenrl.sim.links import Link, parse_link
from digenrl.sim.profiles import ARCH_OF_MODEL
from digenrl.sim.scenarios import Scenario

__all__ = ["Pool", "ROLES", "UserScenario", "load_scenario", "fleet_pools", "format_fleet", "ARCH_OF_MODEL"]

ROLES = ("rollout", "trainer")
_ARCHS = ("qwen-image", "flux", "wan", "hunyuan-video", "sd3", "wan2.2", "qwen-image-edit")


@dataclass(frozen=True, slots=True)
class Pool:
    """``count`` devices of one catalog type, the roles a planner may give them, and the link that reaches them
    (``None``: the home site's fabric)."""

    device: str
    count: int
    roles: tuple[str, ...] = ROLES
    link: Link | None = None


@dataclass(frozen=True, slots=True)
class UserScenario:
    """A scenario read from a file, with its pools' role restrictions."""

    scenario: Scenario
    pools: tuple[Pool, ...]


def _pool(item: Any, where: str) -> Pool:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: must be a table with device and count")
    unknown = sorted(set(item) - {"device", "count", "roles", "link"})
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; allowed: device, count, roles, link")
    device = item.get("device")
    if not isinstance(device, str):
        raise ConfigError(f"{where}.device: a device type name is required")
    spec = device_spec(device)  # raises naming the catalog
    count = item.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"{where}.count: must be a positive integer, got {count!r}")
    roles = item.get("roles", list(ROLES))
    if not isinstance(roles, list) or not roles or any(r not in ROLES for r in roles):
        raise ConfigError(f"{where}.roles: must be a non-empty list of {', '.join(ROLES)}, got {roles!r}")
    link = item.get("link")
    if link is not None and not isinstance(link, str):
        raise ConfigError(f"{where}.link: must be a string such as \"1gbit/20ms\", got {link!r}")
    return Pool(spec.name, count, tuple(roles), parse_link(link, f"{where}.link") if link else None)


def fleet_pools(spec: str) -> tuple[Pool, ...]:
    """``"8xH800+16xL40S@1gbit/20ms"`` -> two pools (any role), the second a far site behind its link.

    Raises:
        ConfigError: a part that is not ``<count>x<device>[@<rate>[/<latency>]]``, an unknown device type, a bad
            rate or latency, or a device type at two sites; the message names the part.
    """
    pools = []
    for part in spec.split("+"):
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*([A-Za-z0-9_-]+)\s*(?:@(.*))?", part)
        if not match or int(match.group(1)) < 1:
            raise ConfigError(f"--fleet {spec!r}: {part!r} is not <count>x<device>[@<rate>[/<latency>]] "
                              "(e.g. 16xH800+8xL40S@1gbit/20ms)")
        try:
            device = device_spec(match.group(2)).name
        except ConfigError as exc:
            raise ConfigError(f"--fleet {spec!r}: {part.strip()!r}: {exc}") from exc
        link = parse_link(match.group(3), f"--fleet {spec!r}: {part.strip()!r}") if match.group(3) is not None else None
        pools.append(Pool(device, int(match.group(1)), link=link))
    far_links([(p.device, p.link) for p in pools])  # one site per device type
    return tuple(pools)


def format_fleet(pools: tuple[Pool, ...]) -> str:
    """The short form of ``pools`` (their roles are not part of it): ``fleet_pools(format_fleet(p))`` gives
    back their devices, counts and links."""
    return "+".join(f"{p.count}x{p.device}" + (f"@{p.link}" if p.link else "") for p in pools)


def load_scenario(path: str | Path) -> UserScenario:
    """Read a user scenario file (see the module docstring).

    Raises:
        ConfigError: a missing file, invalid TOML, or a bad key, naming it.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"scenario file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from exc
    allowed = {"name", "model", "variant", "prompts", "group_size", "num_steps", "trained_steps", "rollout_pool",
               "pools"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{p}: {unknown[0]}: unknown key; allowed: {', '.join(sorted(allowed))}")
    model = ARCH_OF_MODEL.get(data.get("model", ""), data.get("model", ""))
    if model not in _ARCHS:
        raise ConfigError(f"{p}: model: {data.get('model')!r} is not one of {', '.join(_ARCHS)}")
    variant = data.get("variant", "")
    if variant and variant not in VARIANTS[model]:
        raise ConfigError(f"{p}: variant: {model} has no variant {variant!r}; allowed: {', '.join(VARIANTS[model])}")
    numbers = {}
    for key, default in (("prompts", None), ("group_size", None), ("num_steps", None), ("trained_steps", None)):
        value = data.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{p}: {key}: must be a positive integer, got {value!r}")
        numbers[key] = value
    if numbers["trained_steps"] > numbers["num_steps"]:
        raise ConfigError(f"{p}: trained_steps: {numbers['trained_steps']} exceeds num_steps {numbers['num_steps']}")
    raw = data.get("pools")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{p}: pools: at least one [[pools]] table (device, count) is required")
    pools = tuple(_pool(item, f"{p}: pools[{i}]") for i, item in enumerate(raw))
    rollout_pool = data.get("rollout_pool", "")
    if rollout_pool:
        rollout_pool = device_spec(rollout_pool).name
        if rollout_pool not in {pl.device for pl in pools}:
            raise ConfigError(f"{p}: rollout_pool: {rollout_pool!r} is not one of the pools' devices")
    sc = Scenario(str(data.get("name", p.stem)), model, numbers["prompts"], numbers["group_size"], numbers["num_steps"],
                  numbers["trained_steps"], tuple((pl.device, pl.count) for pl in pools), rollout_pool, kind="user",
                  variant=str(variant), links=tuple(far_links([(pl.device, pl.link) for pl in pools]).items()))
    return UserScenario(sc, pools)
