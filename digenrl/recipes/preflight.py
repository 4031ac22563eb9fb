"""What ``digenrl validate`` and ``digenrl run`` check before anything starts: one list for both.

::

    preflight(load_config("configs/tiny-qwenimage.toml"))   # the first problem as a ConfigError, else None

Each check is a refusal the run makes anyway, made early: without it the same problem stops the run
later, deeper, or inside an actor process as a remote traceback. In the run's order:

1. this machine can run the config (:func:`~digenrl.config.check_runnable`: a CUDA device, the
   weights directory);
2. the actors' transport (actor schedules): ``transport.address`` is one of this host's interfaces,
   Ray is installed for ``cluster.launcher = "ray"``, the ``transport.keys`` directory can be read and
   is its owner's alone, and an address reachable from other hosts has keys;
3. ``model.init`` fits ``model.preset``;
4. the rewards: ``reward.device`` exists here, every weighted learned reward's files (the paths of its
   ``[reward.models.<name>]`` table, their ``config.json`` and state-dict headers: the architecture, never
   the weights) and its optional extra, every Python reward's file (it imports, names a class with
   ``score``, whose constructor takes the table's settings; the constructor is not run), and the remote
   reward answers at ``reward.url``;
5. ``log.wandb`` finds W&B installed.

Not here: the memory plan (``digenrl.plan.memory.check_memory``, the CLI's second call: the planner
sits above the recipes), and what needs the spawned processes (a free port, workers that join, the
Ray cluster's resources), which the run checks as it starts them.

``digenrl validate`` runs :func:`validation` instead: the same checks, every problem listed rather than the
first, and on a host that cannot run the config (a login node without the CUDA device it names) the checks
that only the host that runs it can make are left for that host and listed as such: its devices, the
weights and reward files it reads (checked here where they are present), the address it binds and the
served rewards it reaches. ``digenrl run`` still refuses on the host that runs it, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from digenrl.config import Config, check_runnable
from digenrl.errors import ConfigError
from digenrl.transport.curve import ClusterKeys, load_keys, require_keys
from digenrl.transport.hosts import check_bind_address

__all__ = ["preflight", "validation", "Validation", "cluster_keys", "check_transport", "check_init", "check_reward",
           "check_logging", "gloo_interfaces", "untrusted_links"]


def preflight(cfg: Config, collect: Callable[[Callable[[], None]], None] | None = None) -> None:
    """Refuse ``cfg`` now if the run would refuse it later (see the module docstring).

    ``collect(check)``: runs each check instead (:func:`validation` lists every problem).

    Raises:
        ConfigError: the first problem, naming its config key.
    """
    run = collect or (lambda check: check())
    run(lambda: check_runnable(cfg))
    if cfg.disaggregated:
        run(lambda: check_transport(cfg))
    run(lambda: check_init(cfg))
    run(lambda: check_reward(cfg))
    run(lambda: check_logging(cfg))


def cluster_keys(cfg: Config) -> ClusterKeys | None:
    """The run's CURVE keys (``transport.keys``), or None; without them no endpoint may bind off loopback.

    Raises:
        ConfigError: the keys cannot be read, or a secret file is readable by others (the message
            says how to create or fix them).
    """
    return load_keys(Path(cfg.transport.keys).expanduser()) if cfg.transport.keys else None


def check_transport(cfg: Config) -> None:
    """The driver's endpoint as the actor run opens it: address, launcher, keys, and keys where needed.

    Raises:
        ConfigError: naming ``transport.address``, ``cluster.launcher`` or ``transport.keys``.
    """
    transport = cfg.transport
    check_bind_address(transport.address, "transport.address")
    if cfg.cluster.launcher == "ray":
        from digenrl.recipes.ray_launcher import check_ray

        check_ray()
    keys = cluster_keys(cfg)
    if transport.actors == "zmq" and transport.address:
        require_keys(transport.address, keys, "transport.address")


def check_init(cfg: Config) -> None:
    """``model.init`` loads into ``model.preset``: the run's own check, on the bare random preset.

    :func:`~digenrl.models.init.load_init` (sha256 against ``recipe.json``, every key and shape of
    every component) into the preset's pipeline built on the CPU in float32: the presets that take
    an init have a few million parameters at most and build in tens of milliseconds. Not the meta
    device (Wan's scheduler cannot be built there), and never the policy (LoRA, devices, dtype).

    Raises:
        ConfigError: naming ``model.init`` (missing file, sha256, a component that does not fit).
    """
    m = cfg.model
    if not m.init:
        return
    from digenrl.models import load_model
    from digenrl.models.init import load_init

    load_init(load_model(m.name, m.preset, seed=m.seed), m.init)


def check_reward(cfg: Config) -> None:
    """The rewards can be built here: ``reward.device``, the learned rewards' files, the remote reward.

    A CUDA ``reward.device`` needs a CUDA device on this host (unless Ray places the actors). Each weighted learned reward checks its
    ``[reward.models.<name>]`` paths, what their headers say about the architecture and its optional extra
    (``digenrl.rewards.registry.check_reward_files``; cheap: no weights are read). The remote reward must
    answer at ``reward.url`` (an empty batch: nothing is scored) and the ``vlm_judge`` server must list its
    model; those probes are skipped when their failures can never stop the run (``on_error = "penalty"``
    with ``max_failure_fraction = 1``: every failed sample is penalised).

    Raises:
        ConfigError: naming ``reward.device``, ``reward.models.<name>.<key>`` / ``reward.weights.<name>``, or
            ``reward.url`` with the reward's own message (nothing answers, HTTP 404, not a URL).
    """
    import torch

    from digenrl.rewards import RewardError
    from digenrl.rewards.registry import check_reward_files
    from digenrl.rewards.remote import RemoteReward

    from digenrl.rewards.user import allow_user_rewards

    r = cfg.reward
    allow_user_rewards(r.models)  # this process's own config: its Python rewards are imported to be checked
    placed = cfg.cluster.launcher == "ray"  # Ray places the actors on its GPU nodes: the driver may have none
    if r.device.startswith("cuda") and not placed and not torch.cuda.is_available():
        raise ConfigError(f"reward.device = {r.device!r}, but this host has no CUDA device; use 'cpu' or '' (the "
                          f"actor's model.device, {cfg.model.device!r})")
    check_reward_files(r.weights, r.models)
    if r.on_error == "penalty" and r.max_failure_fraction >= 1:
        return  # a served reward's failures can never stop this run: nothing to probe
    if "remote" in r.weights:
        try:
            RemoteReward(r.url, timeout=r.timeout, retries=r.retries, image_format=r.image_format,
                         send_sources=r.remote_sources).probe()
        except (RewardError, ValueError) as exc:
            raise ConfigError(f"reward.url: {exc}") from None
    if "vlm_judge" in r.weights:
        from digenrl.rewards.vlm import vlm_judge

        try:  # (a bad table is a ConfigError of its own, naming the key)
            vlm_judge(r.models.get("vlm_judge", {})).probe()  # the model is served at base_url; nothing scored
        except (RewardError, ValueError) as exc:
            raise ConfigError(f"reward.models.vlm_judge: {exc}") from None



@dataclass
class Validation:
    """What :func:`validation` found.

    Attributes:
        problems: each refusal the run would make, in the run's order (every one, not the first).
        left: the checks only the host that runs the config can make, with why (empty on that host).
    """

    problems: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the run will do, worth knowing (the gloo interfaces)
    warnings: list[str] = field(default_factory=list)  # allowed, but not what you may assume (plain-TCP links)


def validation(cfg: Config) -> Validation:
    """Every check of :func:`preflight` this host can make, each problem listed; the rest left for the run's host.

    This host runs the config unless it names a CUDA device this host lacks (and Ray does not place it). Off
    that host, the weights directory and the learned rewards' files are checked where they are present here.
    """
    import torch

    from digenrl.rewards.registry import check_reward_files
    from digenrl.rewards.user import allow_user_rewards, user_reward_paths

    out = Validation(notes=gloo_interfaces(cfg) + sp_notes(cfg), warnings=untrusted_links(cfg))

    def attempt(check: Callable[[], None]) -> None:
        try:
            check()
        except ConfigError as exc:
            out.problems.append(str(exc))

    def where_present(paths: list[str], key: str, check: Callable[[], None]) -> None:
        missing = [p for p in paths if not Path(p).expanduser().exists()]
        if missing:
            out.left.append(f"{key}: {', '.join(missing)} is not on this host (the host that runs it reads it)")
        else:
            attempt(check)

    placed = cfg.cluster.launcher == "ray"  # Ray places the actors on its GPU nodes: the driver may have none
    if placed or not cfg.model.device.startswith("cuda") or torch.cuda.is_available():
        preflight(cfg, collect=attempt)
        return out
    out.left.append(f"model.device = {cfg.model.device!r} on {cfg.placement.gpus} GPU(s): this host has no CUDA device")
    if cfg.model.preset == "pretrained":
        where_present([cfg.model.path], "model.path", lambda: check_runnable(_on_cpu(cfg)))
    if cfg.disaggregated:
        if cfg.transport.address.startswith("tcp://"):
            out.left.append(f"transport.address = {cfg.transport.address!r}: an interface of the host that binds it")
        if cfg.transport.keys:  # copied to the run's hosts (README: Security), not necessarily to this one
            where_present([cfg.transport.keys], "transport.keys", lambda: _launcher_and_keys(cfg))
        else:
            attempt(lambda: _launcher_and_keys(cfg))
    attempt(lambda: check_init(cfg))
    attempt(lambda: check_logging(cfg))
    r = cfg.reward
    if r.device.startswith("cuda"):
        out.left.append(f"reward.device = {r.device!r}: a CUDA device of the hosts that score")
    paths = [str(v) for t in r.models.values() for k, v in t.items() if k.endswith("path") and isinstance(v, str) and v]
    allow_user_rewards(r.models)  # this process's own config: its Python rewards are imported to be checked
    paths += user_reward_paths(r.models)
    where_present(paths, "reward.models", lambda: check_reward_files(r.weights, r.models))
    if "remote" in r.weights or "vlm_judge" in r.weights:
        out.left.append("reward.url / reward.models.vlm_judge: the served reward, as the run's hosts reach it")
    return out


def sp_notes(cfg: Config) -> list[str]:
    """Each role's sequence-parallel degree and the processes it takes, when any role is above 1."""
    from digenrl.roles.sp_group import sp_summary

    place = cfg.placement
    return [sp_summary(place)] if max(place.sp_of("rollout"), place.sp_of("trainer")) > 1 else []


def gloo_interfaces(cfg: Config) -> list[str]:
    """Which interface each role's gloo groups will listen on (docs/machines.md, "The gloo interface").

    Roles this host starts are decided here (``GLOO_SOCKET_IFNAME``, else the route to the lead trainer,
    on this host); roles on joined workers or Ray nodes are decided on their hosts, by the same rule.
    """
    from digenrl.transport.gloo_iface import ENV, gloo_interface

    p, t = cfg.placement, cfg.transport
    groups: list[tuple[str, list[str]]] = []
    if t.actors == "zmq" and p.trainer > 1 and not cfg.model.device.startswith("cuda"):  # (NCCL on CUDA)
        groups.append((f"the trainer group (placement.trainer = {p.trainer})",
                       [f"trainer-{i}" for i in range(p.trainer)]))
    if t.weights == "gloo":
        late = ["late rollout actors"] if p.late_rollout else []
        groups.append(("the weight lane (transport.weights = 'gloo')",
                       ["trainer-0", *(f"rollout-{i}" for i in range(p.rollout)), *late]))
    lines = []
    for what, roles in groups:
        if cfg.cluster.launcher == "ray" or p.workers:
            where = ("Ray nodes" if cfg.cluster.launcher == "ray"
                     else f"joined workers (placement.workers = {p.workers})")
            lines.append(f"gloo: {what}: {', '.join(roles)} run on {where}; each decides on its own host: {ENV} "
                         "there, else the interface on its route to trainer-0 (its --listen address's when the hosts "
                         "share a network)")
        else:
            here = gloo_interface("127.0.0.1")
            lines.append(f"gloo: {what}: {', '.join(roles)} run on this host and listen on {here}")
    return lines


def untrusted_links(cfg: Config) -> list[str]:
    """A warning when torch.distributed links (plain TCP) may cross hosts: docs/machines.md, "Security"."""
    p, t = cfg.placement, cfg.transport
    from digenrl.transport.curve import is_loopback

    if t.actors != "zmq" or not t.address or is_loopback(t.address):
        return []
    uses = [f"placement.trainer = {p.trainer} (gradients)"] if p.trainer > 1 else []
    if t.weights in ("gloo", "nccl"):
        uses.append(f"transport.weights = {t.weights!r} (the weights)")
    if not uses:
        return []
    return [f"{' and '.join(uses)} with transport.address = {t.address!r} off loopback: these torch.distributed "
            "links are plain TCP, neither encrypted nor authenticated (CURVE covers only the ZeroMQ sockets); run "
            "them across hosts only on a network you trust, or keep one trainer and transport.weights = 'zmq' "
            "(docs/machines.md, Security)"]


def check_logging(cfg: Config) -> None:
    """``log.wandb = true`` where W&B is installed (found, not imported: ``digenrl.telemetry.wandb_log``).

    Raises:
        ConfigError: naming ``log.wandb`` and the install command.
    """
    if cfg.log.wandb:
        from digenrl.telemetry.wandb_log import check_wandb

        check_wandb()


def _launcher_and_keys(cfg: Config) -> None:
    """:func:`check_transport` but the bind address: Ray for its launcher, the keys where an address needs them."""
    if cfg.cluster.launcher == "ray":
        from digenrl.recipes.ray_launcher import check_ray

        check_ray()
    keys = cluster_keys(cfg)
    if cfg.transport.actors == "zmq" and cfg.transport.address:
        require_keys(cfg.transport.address, keys, "transport.address")


def _on_cpu(cfg: Config) -> Config:
    """``cfg`` with its model on the CPU: the checks of its weights directory alone."""
    import dataclasses

    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device="cpu"))
