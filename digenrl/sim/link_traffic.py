"""What crosses the links between sites during a simulated run, when, and who is busy meanwhile (``links.py`` says
what crosses).

The runtime moves data across a link *inside* the token that needs it, so the device that runs the token is busy
(its span) for the transfer, never idle:

- a PUBLISH: the lead trainer sends the version to every rollout actor and awaits each one's reply
  (``TrainerActor.publish``, zmq lane; the gloo / nccl broadcast likewise returns once the far members hold it),
  so the PUBLISH token lasts its own seconds plus the publication's crossing and the reply's way back; the far
  site holds the version from the crossing's arrival on;
- a REWARD on a far device: after scoring, it pushes each fragment's transitions to the trainers' fragment store
  (``store_fragment``, at the home site) and awaits the reply, so the upload is part of the far device's token;
  the trainer then trains rows it already holds (nothing crosses in its TRAIN token);
- a fragment continued or scored on another site takes its latents from the holder at the token's start
  (``take_fragment``); a trainer at a far site fetches its rows from the home store at its TRAIN token's start;
  a trainer group spanning sites all-reduces over its slowest link in its OPTIM token.

``simulate(..., links=LinkTraffic(...))`` asks :meth:`LinkTraffic.carry` at each launch for those seconds (the
token's span grows by them and a driver observes them), :meth:`LinkTraffic.wait` for what a token must wait for
before it runs (a version not yet at its site: a ``link`` span, a bubble; the blocking publication makes this 0
under every shipped schedule) and, before each token completes, :meth:`LinkTraffic.hold` for a later end.

Each direction of each far link is a FIFO of data: a transfer enqueued at ``t`` is served once everything
enqueued before it left, holds the direction for ``bytes / rate`` and arrives ``latency`` later. A transfer's
*reply* (and its TCP acknowledgements) goes the other way, so it leaves only after the data enqueued on that
direction before it: an upload that overlaps a publication completes when the publication has left the home end
(and a publication waits likewise for an upload ahead of its reply). That is what the shaped runs show
(``tests/multihost/test_shaped_link.py``: the far actor's reward token ends with the lead's publication). Because a
token is launched before a later one enqueues ahead of its reply, the engine asks :meth:`hold` again when the
token would end. The cost model's own terms (the trainer's NIC, the home broadcast) still apply: the link comes
on top. Not charged: the coordinator's small control messages (a token's dispatch, a result), which also queue
behind bulk data on a shaped link but carry no bytes to speak of.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from digenrl.errors import ConfigError
from digenrl.schedule.base import Token, TokenKind
from digenrl.schedule.cost import ring_allreduce_seconds
from digenrl.sim.links import HOME, Link
from digenrl.sim.profiles import BF16, ModelProfile

__all__ = ["LinkBytes", "LinkTraffic", "far_links"]

_DOWN, _UP = "down", "up"  # home -> far, far -> home
_BACK = {_DOWN: _UP, _UP: _DOWN}


@dataclass(frozen=True, slots=True)
class LinkBytes:
    """Bytes of one unit of each kind of traffic.

    Attributes:
        publication: one version as sent: the trainable weights' bf16 bytes x the transfer's ratio.
        row: one trained row's latents and scalars.
        sample: one sample's own latents and scalars and its conditioning (sent with its rows).
        latent: one stored latent (a fragment continued on another site moves one per sample).
        gradient: the gradient buffer a trainer group all-reduces each step.
    """

    publication: float
    row: float
    sample: float
    latent: float
    gradient: float

    @classmethod
    def of_profile(cls, prof: ModelProfile, ratio: float = 1.0, grad_bytes: float = BF16) -> LinkBytes:
        """A profile's figures (those ``cost.CostModel`` prices), the publication at compression ``ratio``."""
        rows = prof.rows
        return cls(prof.publish_bytes * ratio, rows.row_latents * prof.latent_bytes + rows.row_scalar_bytes,
                   rows.sample_latents * prof.latent_bytes + rows.sample_scalar_bytes + prof.cond_bytes,
                   prof.latent_bytes, grad_bytes * prof.trainable_params)


def far_links(pools: list[tuple[str, Link | None]]) -> dict[str, Link]:
    """Device type -> its far link, from ``(device type, link or None)`` per pool.

    Raises:
        ConfigError: a device type at two sites (the simulator tells devices apart by type).
    """
    site: dict[str, Link | None] = {}
    for dtype, link in pools:
        if dtype in site and site[dtype] != link:
            where = [str(x) if x else "home" for x in (site[dtype], link)]
            raise ConfigError(f"fleet: {dtype} is at two sites ({where[0]} and {where[1]}); the simulator tells "
                              "devices apart by type, so each type lives at one site")
        site[dtype] = link
    return {t: link for t, link in site.items() if link is not None}


@dataclass
class LinkTraffic:
    """The far links of one run and what has crossed them (see the module docstring).

    Args:
        site_of: device name -> its site (``links.HOME``, or the far pool's device type).
        links: far site -> its link.
        nbytes: what each kind of traffic moves.
        rows_per_sample: trained rows per sample (the workload's ``trained_steps``): a scored fragment sends
            ``samples x (nbytes.sample + rows_per_sample x nbytes.row)``.
    """

    site_of: Mapping[str, str]
    links: Mapping[str, Link]
    nbytes: LinkBytes
    rows_per_sample: float = 0.0
    carried: dict[str, dict[str, float]] = field(default_factory=dict)  # site -> kind -> bytes
    waited: dict[str, float] = field(default_factory=dict)  # device -> seconds spent waiting on a link
    moving: dict[str, float] = field(default_factory=dict)  # device -> seconds its tokens spent moving data
    busy: dict[tuple[str, str], float] = field(default_factory=dict)  # (site, direction) -> seconds it carried
    _free: dict[tuple[str, str], float] = field(default_factory=dict)  # (site, direction) -> data served until
    _queue: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)  # (enqueued, served)
    _arrival: dict[tuple[str, int], float] = field(default_factory=dict)  # (far site, version) -> there at
    _replies: dict[int, list[tuple[str, str, float]]] = field(default_factory=dict)  # token -> (site, way, at)

    def __post_init__(self) -> None:
        unknown = sorted({s for s in self.site_of.values() if s != HOME} - set(self.links))
        if unknown:
            raise ConfigError(f"links: sites {unknown} have devices but no link")

    @classmethod
    def for_devices(cls, types: Mapping[str, str], links: Mapping[str, Link], nbytes: LinkBytes,
                    rows_per_sample: float = 0.0) -> LinkTraffic:
        """``types``: device name -> device type; a type with a link in ``links`` is a far site."""
        return cls({n: t if t in links else HOME for n, t in types.items()}, dict(links), nbytes, rows_per_sample)

    # -- the engine's calls --------------------------------------------------------------------------
    def wait(self, token: Token, device: str, now: float) -> float:
        """Seconds ``token`` on ``device`` idles before it can run, from ``now``: a ROLLOUT at a far site waits
        for its version to arrive there."""
        site = self.site_of.get(device, HOME)
        ready = now
        if token.kind is TokenKind.ROLLOUT and site != HOME:
            ready = max(ready, self._arrival.get((site, token.policy_version), 0.0))
        if ready > now:
            self.waited[device] = self.waited.get(device, 0.0) + ready - now
        return ready - now

    def carry(self, token: Token, device: str, start: float, seconds: float) -> float:
        """Seconds ``token`` (started on ``device`` at ``start``, ``seconds`` of its own work) holds its devices
        beyond that work, moving data across links: what it takes in before the work, what it sends after it
        until the reply is back (see the module docstring)."""
        site = self.site_of.get(device, HOME)
        ready = max([start] + self._take_in(token, site, start))
        sent = ready + seconds
        replies = self._send_out(token, site, sent)
        if replies:
            self._replies[token.id] = replies
        end = max([sent] + [self._reply(*r) for r in replies])
        extra = end - start - seconds
        if extra > 0:
            self.moving[device] = self.moving.get(device, 0.0) + extra
        return extra

    def hold(self, token: Token, now: float) -> float:
        """When ``token``, due to end at ``now``, really ends: later when data enqueued since its launch went ahead
        of a reply it awaits (the engine then keeps it running). Forgets the token once it may end."""
        replies = self._replies.get(token.id)
        if not replies:
            return now
        end = max([now] + [self._reply(*r) for r in replies])
        if end <= now:
            del self._replies[token.id]
        else:
            self.moving[token.device] = self.moving.get(token.device, 0.0) + end - now
        return end

    def done(self, token: Token, now: float) -> None:
        """``token`` ended at ``now``: forget the transfers nothing still running can queue behind."""
        self._prune(now)

    # -- what a token moves ----------------------------------------------------------------------------
    def _take_in(self, token: Token, site: str, start: float) -> list[float]:
        """Arrivals of what ``token`` fetches at its start: latents held on another site, a far trainer's rows."""
        out = []
        for fragment, source in zip(token.fragments, token.sources):
            there = self.site_of.get(source, site) if source else site
            if there != site:
                out.append(self._move(there, site, fragment.num_samples * self.nbytes.latent, start, "latents"))
        if token.kind is TokenKind.TRAIN and site != HOME:
            nbytes = sum((end - begin) * self.nbytes.row for begin, end in token.rows)
            nbytes += token.num_samples * self.nbytes.sample
            out.append(self._move(HOME, site, nbytes, start, "samples"))
        if token.kind is TokenKind.OPTIM:
            out.append(self._allreduce(token, start))
        return out

    def _send_out(self, token: Token, site: str, at: float) -> list[tuple[str, str, float]]:
        """What ``token`` sends at ``at``, after its work: a PUBLISH the version down every far link, a far
        REWARD its scored fragments up to the trainers' store. Returns the replies it awaits: (site, the way
        the reply goes, when the data arrives)."""
        if token.kind is TokenKind.PUBLISH and site == HOME:
            out = []
            for far in self.links:
                arrival = self._send(far, _DOWN, self.nbytes.publication, at, "publication")
                self._arrival[(far, token.policy_version)] = arrival
                out.append((far, _UP, arrival))
            return out
        if token.kind is TokenKind.REWARD and site != HOME:
            per_sample = self.nbytes.sample + self.rows_per_sample * self.nbytes.row
            return [(site, _DOWN, self._send(site, _UP, token.num_samples * per_sample, at, "samples"))]
        return []

    # -- the links ----------------------------------------------------------------------------------
    def _send(self, site: str, direction: str, nbytes: float, at: float, kind: str) -> float:
        """One FIFO transfer enqueued at ``at`` on ``site``'s link in ``direction``; returns its arrival time."""
        link, key = self.links[site], (site, direction)
        start = max(at, self._free.get(key, 0.0))
        self._free[key] = start + nbytes / link.bytes_per_s
        self._queue.setdefault(key, []).append((at, self._free[key]))
        self.busy[key] = self.busy.get(key, 0.0) + nbytes / link.bytes_per_s
        by_kind = self.carried.setdefault(site, {})
        by_kind[kind] = by_kind.get(kind, 0.0) + nbytes
        return start + link.seconds(nbytes)

    def _reply(self, site: str, direction: str, at: float) -> float:
        """Arrival of a reply (no bytes to speak of) enqueued at ``at`` on ``site``'s ``direction``: it leaves once
        the data enqueued there before it has."""
        ahead = [served for enqueued, served in self._queue.get((site, direction), ()) if enqueued <= at]
        return max([at] + ahead) + self.links[site].latency_s

    def _prune(self, now: float) -> None:
        """Forget transfers whose data left (and whose latency passed) before ``now``: every token still awaiting a
        reply is due at ``now`` or later, which such a transfer can no longer push back."""
        for (site, direction), queue in self._queue.items():
            latency = self.links[site].latency_s
            if queue and queue[0][1] + latency <= now:
                self._queue[(site, direction)] = [q for q in queue if q[1] + latency > now]

    def _move(self, src: str, dst: str, nbytes: float, at: float, kind: str) -> float:
        """Bytes from site ``src`` to ``dst``: up the source's link, then down the destination's (a star)."""
        t = at
        if src != HOME:
            t = self._send(src, _UP, nbytes, t, kind)
        if dst != HOME:
            t = self._send(dst, _DOWN, nbytes, t, kind)
        return t

    def _allreduce(self, token: Token, at: float) -> float:
        """A trainer group spanning sites all-reduces over its slowest link (both directions held)."""
        sites = {self.site_of.get(n, HOME) for n in token.devices}
        far = [s for s in sites if s != HOME]
        if len(sites) < 2:
            return at
        slowest = min((self.links[s] for s in far), key=lambda link: link.bits_per_s)
        seconds = ring_allreduce_seconds(self.nbytes.gradient, len(token.devices), slowest.bytes_per_s,
                                         slowest.latency_s)
        keys = [(s, d) for s in far for d in (_DOWN, _UP)]
        start = max([at] + [self._free.get(k, 0.0) for k in keys])
        for k in keys:
            self._free[k] = start + seconds
            self._queue.setdefault(k, []).append((at, start + seconds))
            self.busy[k] = self.busy.get(k, 0.0) + seconds
        for s in far:
            self.carried.setdefault(s, {})["gradients"] = self.carried[s].get("gradients", 0.0) + self.nbytes.gradient
        return start + seconds

    def report(self, num_batches: int, wall: float) -> dict[str, dict[str, object]]:
        """Per far site over a run of ``num_batches`` steps and ``wall`` seconds: its link, one publication's bytes
        and seconds, the bytes each kind moved per step, the share of the run each direction carried data, the
        share its devices waited on it (idle) and the share their tokens spent moving data (busy)."""
        out: dict[str, dict[str, object]] = {}
        for site, link in self.links.items():
            devices = [n for n, s in self.site_of.items() if s == site]
            share = wall * len(devices)
            waited = sum(self.waited.get(n, 0.0) for n in devices)
            moving = sum(self.moving.get(n, 0.0) for n in devices)
            out[site] = {"link": str(link), "publication_bytes": self.nbytes.publication,
                         "publication_s": link.seconds(self.nbytes.publication),
                         "bytes_per_step": {k: v / num_batches for k, v in self.carried.get(site, {}).items()},
                         "busy": {d: self.busy.get((site, d), 0.0) / wall if wall else 0.0 for d in (_DOWN, _UP)},
                         "wait_share": waited / share if share else 0.0,
                         "moving_share": moving / share if share else 0.0}
        return out
