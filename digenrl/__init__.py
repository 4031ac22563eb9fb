"""digenrl: disaggregated reinforcement learning for diffusion and flow-matching generators."""

from __future__ import annotations

from digenrl.errors import (
    ActorDied,
    ConfigError,
    DigenrlError,
    ProtocolError,
    RemoteError,
    StalenessViolation,
    TransportBroken,
    TransportClosed,
)

__version__ = "0.1.0"

__all__ = [
    "ActorDied",
    "ConfigError",
    "DigenrlError",
    "ProtocolError",
    "RemoteError",
    "StalenessViolation",
    "TransportBroken",
    "TransportClosed",
]
