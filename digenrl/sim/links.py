"""Links between sites: the fleet grammar's ``@rate/latency``, and what crossing a link costs.

A fleet is pools of devices. The pools written without a link form the **home site**: one fabric (NVLink or
PCIe inside a node of 8, each device type's NIC across nodes; ``devices.py``). A pool written with ``@`` is a
**far site** of its own, reached from the home site over one link of that rate in each direction (full
duplex) and that one-way latency. Far sites form a star around the home site: two of them talk through it.

Grammar of ``--fleet`` (``user.fleet_pools``; a scenario file's ``[[pools]]`` take ``link = "1gbit/20ms"``)::

    fleet   := pool ("+" pool)*
    pool    := COUNT "x" DEVICE ["@" link]
    link    := RATE ["/" LATENCY]
    RATE    := NUMBER ("kbit" | "mbit" | "gbit")      decimal units, per second: 1gbit = 1e9 bit/s
    LATENCY := NUMBER ("us" | "ms" | "s")             one way; default 0

e.g. ``8xH800+16xL40S@1gbit``, ``32xH100+16xL40S@10gbit/20ms``. A device type lives at one site (the simulator
names devices by type), so ``16xH100+16xH100@1gbit`` is refused.

What crosses a link, and what the simulator charges for it (``link_traffic.LinkTraffic``), each direction a
FIFO in which transfers queue, each transfer ``bytes x 8 / rate + latency`` (:meth:`Link.seconds`):

- every version's **publication**: one copy of the trainable weights (the LoRA adapter, or the full model,
  bf16) times the transfer's compression ratio (:class:`Transfer`), home -> far (a far site re-broadcasts
  it on its own fabric), inside the lead trainer's PUBLISH token (it awaits the far actors' replies); a far
  device starts a trajectory of version ``v`` only once ``v`` arrived;
- the **samples** a far site generates: each trained row's latents and each sample's latent and
  conditioning (``profiles.RowCost``), uploaded far -> home to the trainers' store by the far device's
  REWARD token;
- latents of a fragment continued on another site, and the **gradient all-reduce** of a trainer group that
  spans sites (the planner never places one: it all-reduces every step).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from digenrl.errors import ConfigError
from digenrl.sim.compression import weight_bytes_ratio

__all__ = ["Link", "Transfer", "TRANSFERS", "parse_link", "format_rate", "choose_transfer", "HOME"]

HOME = ""  # the site of the pools written without a link

_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_LATENCY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d+)?)"


@dataclass(frozen=True, slots=True)
class Link:
    """One link between the home site and a far site: ``bits_per_s`` each way, ``latency_s`` one way."""

    bits_per_s: float
    latency_s: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bits_per_s / 8.0

    def seconds(self, nbytes: float) -> float:
        """One transfer of ``nbytes`` over the link: serialisation at the line rate plus the latency."""
        return nbytes / self.bytes_per_s + self.latency_s

    def __str__(self) -> str:
        if not self.latency_s:
            return format_rate(self.bits_per_s)
        return f"{format_rate(self.bits_per_s)}/{_format_latency(self.latency_s)}"


def _shortest(value: float) -> str:
    return f"{value:.6g}"


def format_rate(bits_per_s: float) -> str:
    """``1e9`` -> ``"1gbit"``, ``2.5e8`` -> ``"250mbit"``: the largest unit that keeps a number >= 1."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{_shortest(bits_per_s / scale)}{unit}"
    return f"{_shortest(bits_per_s / 1e3)}kbit"


def _format_latency(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{_shortest(seconds / scale)}{unit}"
    return f"{_shortest(seconds / 1e-6)}us"


def parse_link(text: str, where: str = "link") -> Link:
    """``"1gbit"``, ``"100mbit/20ms"`` -> a :class:`Link` (see the module docstring's grammar).

    Raises:
        ConfigError: a rate or latency that does not parse or is not positive, naming ``where`` and the part.
    """
    rate_text, _, latency_text = text.strip().partition("/")
    rate = re.fullmatch(_NUMBER + r"\s*(kbit|mbit|gbit)", rate_text.strip(), re.IGNORECASE)
    if rate is None or float(rate.group(1)) <= 0:
        raise ConfigError(f"{where}: rate {rate_text.strip()!r} is not a positive NUMBER with a unit "
                          f"({', '.join(_RATE_UNITS)}; e.g. 1gbit, 100mbit/20ms)")
    latency = 0.0
    if latency_text or text.strip().endswith("/"):
        lat = re.fullmatch(_NUMBER + r"\s*(us|ms|s)", latency_text.strip(), re.IGNORECASE)
        if lat is None:
            raise ConfigError(f"{where}: latency {latency_text.strip()!r} is not a NUMBER with a unit "
                              f"({', '.join(_LATENCY_UNITS)}; e.g. 20ms)")
        latency = float(lat.group(1)) * _LATENCY_UNITS[lat.group(2).lower()]
    return Link(float(rate.group(1)) * _RATE_UNITS[rate.group(2).lower()], latency)


@dataclass(frozen=True, slots=True)
class Transfer:
    """How a publication crosses a link: ``ratio`` = bytes sent / the bf16 weights' bytes.

    The hook for compressed publications: :func:`choose_transfer` picks among any such options, and the
    simulator and planner price a publication at ``ratio`` (``LinkBytes.publication``).
    """

    name: str
    ratio: float
    lossless: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ConfigError(f"transfer {self.name!r}: ratio {self.ratio!r} must be in (0, 1]")


# The options, least lossy first: the publication encodings of ``transport.weights_compression``, at their bytes
# over a bf16 publication (``compression.weight_bytes_ratio``: int8 deltas with a scale per block, top-1% deltas
# with an int32 index and an int8 value each).
TRANSFERS: tuple[Transfer, ...] = (
    Transfer("none", 1.0, lossless=True),
    Transfer("int8", weight_bytes_ratio("int8")),
    Transfer("topk", weight_bytes_ratio("topk")),
)


def choose_transfer(link_bps: float, publication_bytes: float, step_s: float, *, latency_s: float = 0.0,
                    share: float = 0.5, options: tuple[Transfer, ...] = TRANSFERS) -> tuple[Transfer, str]:
    """The least compressed of ``options`` (in their order) whose publication of ``publication_bytes`` (bf16)
    crosses a ``link_bps`` link within ``share`` of a step of ``step_s`` seconds, and why, in one line.

    One-step-stale async hides a publication that arrives within a step; ``share`` leaves the rest of the
    link's time to everything else that crosses it (and to the schedule's jitter). None fits: the most
    compressed, and the line says it still does not fit. Advice only (``plan/links.admit_far_pool``'s hint for
    a refused pool): a run's ``transport.weights_compression = "auto"`` is resolved when its config loads, before
    any step was timed, by the link's rate alone (``compression.choose_weights_compression``), and the planner
    prices that (``plan/links.config_transfer``).

    Raises:
        ConfigError: a non-positive rate or step, or no options.
    """
    if link_bps <= 0 or step_s <= 0 or not options:
        raise ConfigError(f"choose_transfer: link_bps={link_bps!r} and step_s={step_s!r} must be positive, "
                          "with at least one option")
    link = Link(link_bps, latency_s)
    budget = share * step_s
    for option in options:
        seconds = link.seconds(publication_bytes * option.ratio)
        if seconds <= budget:
            return option, (f"{option.name}: {publication_bytes * option.ratio / 1e9:.3g} GB a publication takes "
                            f"{seconds:.3g} s over {link}, within {share:.0%} of a {step_s:.3g} s step")
    last = options[-1]
    seconds = link.seconds(publication_bytes * last.ratio)
    return last, (f"{last.name}: even so {publication_bytes * last.ratio / 1e9:.3g} GB a publication takes "
                  f"{seconds:.3g} s over {link}, more than {share:.0%} of a {step_s:.3g} s step"
                  + (" (more than the whole step)" if seconds > step_s else ""))

