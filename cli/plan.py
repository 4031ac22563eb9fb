"""`digenrl plan`: the memory plan of a config at the model's real size (see digenrl/plan)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from digenrl_cli._text import examples

from digenrl.errors import ConfigError

if TYPE_CHECKING:
    from digenrl.plan.memory import MemoryPlan

_SET_HELP = "Override a config value, e.g. --set train.rows_per_pass=8 (repeatable; values are TOML literals)."
GB = 1e9


def format_plan(plan: MemoryPlan) -> str:
    """A readable table: one column per role, one row per kind of memory (GB per device)."""
    roles = list(plan.roles.values())
    rows = [("devices", lambda r: f"{r.devices} x {r.device}" + (f" sp{r.sp}" if r.sp > 1 else "")),  # sp: a group
            ("weights", lambda r: f"{r.weights / GB:.2f}"),
            ("reference", lambda r: f"{r.reference / GB:.2f}"),
            ("slow copy", lambda r: f"{r.slow_copy / GB:.2f}"),
            ("trainable", lambda r: f"{r.trainable / GB:.2f}"),
            ("grads", lambda r: f"{r.grads / GB:.2f}"),
            ("optimizer", lambda r: f"{r.optimizer / GB:.2f}"),
            ("activations", lambda r: f"{r.activations / GB:.2f}"),
            ("VAE", lambda r: f"{r.vae / GB:.2f}"),
            ("text encoders", lambda r: f"{r.text_encoders / GB:.2f}"),
            ("reward models", lambda r: f"{r.reward_models / GB:.2f}"),
            ("total / device", lambda r: f"{r.bytes_per_device / GB:.2f}"),
            ("headroom", lambda r: f"{r.headroom / GB:.2f}"),
            ("fits", lambda r: "yes" if r.fits else "NO"),
            ("host (offloaded)", lambda r: f"{r.host_bytes / GB:.2f}")]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{plan.model} {plan.variant} ({plan.preset}): transformer {plan.transformer_params / 1e9:.2f} B params, "
             f"text encoders {plan.text_encoder_params / 1e9:.2f} B, VAE {plan.vae_params / 1e9:.3f} B; "
             f"trainer shard {plan.shard}, rows_per_pass {plan.rows_per_pass}"
             + (f"; transformer_2 (second expert) {plan.expert_params / 1e9:.2f} B params, "
                + ("idle expert in host memory (model.expert_offload)" if plan.expert_offload else "both resident")
                if plan.expert_params else ""),
             f"device {plan.device}: {plan.capacity / GB:.1f} GB, 2 GB kept for the CUDA context and allocator",
             "GB per device".ljust(width) + "".join(r.role.rjust(12) for r in roles)]
    lines += [name.ljust(width) + "".join(fmt(r).rjust(12) for r in roles) for name, fmt in rows]
    lines[1] = f"device {', '.join(sorted({f'{r.device} {r.capacity / GB:.0f} GB' for r in roles}))}; 2 GB each kept for the CUDA context and allocator"
    lines.append(f"activations: {plan.activations}")
    if plan.boundary is not None:
        lines.append(plan.boundary.describe())
    lines += [f"{r.role}: {note}" for r in roles for note in r.notes]
    lines += [f"GPU {g.gpu} ({g.device}) shared by {' + '.join(g.roles)} (placement.actors_per_gpu): "
              f"{g.bytes / GB:.2f} GB + {len(g.roles)} x 2 GB context of {g.capacity / GB:.0f} GB, headroom "
              f"{g.headroom / GB:.2f} GB, {'fits' if g.fits else 'DOES NOT FIT'}" for g in plan.shared]
    return "\n".join(lines)


def plan(
    config: Annotated[Path, typer.Argument(help="A TOML config, e.g. configs/qwenimage.toml.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help=_SET_HELP)] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the plan as JSON here.")] = None,
    fleet: Annotated[str | None, typer.Option("--fleet", help="Search the split for a fleet: 16xH800, "
                                              "8xH800+16xL40S, 8xH800+16xL40S@1gbit/20ms (a far pool behind a "
                                              "link: refused, limited or used, with what its link costs), or a "
                                              "scenario FILE.toml (its [[pools]]).")] = None,
    write: Annotated[Path | None, typer.Option("--write", help="--fleet: write the best placement as a runnable "
                                               "config here.")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="--fleet: how many placements to show.")] = 5,
    batches: Annotated[int, typer.Option("--batches", min=3, help="--fleet: optimizer steps per simulation.")] = 6,
    costs: Annotated[Path | None, typer.Option("--costs", help="--fleet: price tokens with the costs a `digenrl "
                                               "bench bubbles --real` report measured (its bubbles.json) instead of "
                                               "the fitted utilisations on the config's model profile: a plan for "
                                               "the device type it measured (the fleet must be of that type).")] = None,
    tolerance: Annotated[float | None, typer.Option("--tolerance", min=0.0, help="--fleet: keep the config's own "
                                                    "placement first unless another is predicted this fraction "
                                                    "faster (default: the simulator's measured error the --costs "
                                                    "report states: calibration.placement_error, its error on "
                                                    "the ratio of two splits, else plan_error; 0 without "
                                                    "--costs).")]
    = None,
) -> None:
    """Memory per role and device at the model's real size (built on the meta device, no weights);
    exits 1 when a role does not fit, naming the key to change. With --fleet: the best placements of
    the config on that fleet (the simulator running the real schedule code, every role within memory)."""
    from digenrl.config import load_config
    from digenrl.plan.memory import check_memory, memory_plan

    if fleet is not None:
        _fleet(config, set_ or [], fleet, write, top, batches, json_out, costs, tolerance)
        return
    try:
        cfg = load_config(config, set_ or [])
        result = memory_plan(cfg)
    except ConfigError as exc:
        typer.secho(f"config error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    typer.echo(format_plan(result))
    from digenrl.plan.window import config_window_note

    moving = config_window_note(cfg)  # a moving window: the split it wants at its ends
    if moving:
        typer.echo(moving)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result.to_json(), indent=2))
    try:
        check_memory(cfg, result)
    except ConfigError as exc:
        typer.secho(f"does not fit: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from exc
    typer.echo("fits: every role has headroom on its device")


def _fleet(config: Path, overrides: list[str], fleet: str, write: Path | None, top: int, batches: int,
           json_out: Path | None, costs: Path | None = None, tolerance: float | None = None) -> None:
    import time

    from digenrl.config import load_config
    from digenrl.plan.fleet import write_config
    from digenrl.plan.sequence import plan_fleet_sp
    from digenrl.sim.measured import MeasuredCost
    from digenrl.sim.user import fleet_pools, load_scenario

    start = time.perf_counter()
    try:
        cfg = load_config(config, overrides)
        pools = load_scenario(fleet).pools if fleet.endswith(".toml") else fleet_pools(fleet)
        measured = MeasuredCost.from_report(costs) if costs is not None else None
        if tolerance is None:
            tolerance = (MeasuredCost.report_error(costs) or 0.0) if costs is not None else 0.0
        result = plan_fleet_sp(cfg, pools, top=top, batches=batches, measured=measured, tolerance=tolerance)
    except ConfigError as exc:
        typer.secho(f"plan error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    header = f"{'#':>2}  {'split':44s} {'tag_steps':>9} {'frag_groups':>11} {'train_pack':>10} {'rows/pass':>9} " \
             f"{'samples/s':>10} {'bubble R':>8} {'bubble T':>8} {'stale':>5}  memory GB / device"
    lines = [f"{cfg.model.name} on {fleet}, schedule {cfg.schedule.name}: {result.simulations} simulations in "
             f"{time.perf_counter() - start:.1f} s", f"costs: {result.cost_source}", header]
    for i, c in enumerate(result.candidates, 1):
        mem = ", ".join(f"{role} {m['gb']:.0f}/{m['capacity_gb']:.0f} {m['device']}" for role, m in c.memory.items())
        split = c.split + (" (shipped)" if c.shipped else "")
        lines.append(f"{i:>2}  {split:44s} {c.tag_steps:>9} {c.fragment_groups:>11} {c.train_pack:>10} "
                     f"{c.rows_per_pass:>9} {c.samples_per_s:>10.3f} {c.bubble_rollout:>8.1%} "
                     f"{c.bubble_trainer:>8.1%} {c.staleness:>5}  {mem}")
        if len(c.bubble_by_pool) > 1:
            lines.append("    bubble per pool: " + ", ".join(f"{t} {b:.1%}" for t, b in c.bubble_by_pool.items()))
    lines += [f"unused: {u}" for u in result.unused] + [f"note: {n}" for n in result.notes]
    typer.echo("\n".join(lines))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result.to_json(), indent=2))
    if write is not None:
        write_config(config, overrides, result.best, write, result.cost_source)
        typer.echo(f"wrote {write}: digenrl run {write}")


def register(app: typer.Typer) -> None:
    """Add `plan` to `app`."""
    app.command("plan", epilog=examples(
        "digenrl plan configs/qwenimage.toml",
        "digenrl plan configs/wan21.toml --set model.variant=14B --json runs/plan-wan14b.json",
        "digenrl plan configs/qwenimage.toml --set schedule.name=colocated   # the baseline on one GPU",
        "digenrl plan configs/qwenimage.toml --fleet 32xH800 --write runs/qwen-32.toml",
        "digenrl plan configs/flux.toml --fleet 8xH800+16xL40S",
        "digenrl plan configs/flux.toml --fleet my-cluster.toml   # [[pools]] device, count, roles",
        "digenrl plan configs/tiny-qwenimage.toml --fleet 2xmeasured --costs runs/real/bubbles.json"))(plan)
