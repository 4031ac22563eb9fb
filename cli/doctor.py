"""`digenrl doctor [--json OUT]`: can this machine run digenrl, and how fast are its links?"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from digenrl_cli._text import examples

_EPILOG = examples(
    "digenrl doctor                     # the report as tables",
    "digenrl doctor --json doctor.json  # also the figures as JSON",
    "digenrl doctor --no-gpu            # host checks only",
    "digenrl doctor --sp                # also the all-to-all of sequence parallelism on gloo",
) + """

Host checks always run (a few seconds): versions, cores, RAM, /dev/shm, the host lanes' bandwidth
over a memcpy of the same bytes, and the header round trip between two processes on each event
loop over raw synchronous pyzmq, and rollout/train parity (trainer log-probs recomputed with the
sampling weights vs the rollout's) of two tiny fp32 CPU runs, colocated and async1. With CUDA devices the GPU checks follow (devices, P2P, torch's
and cupy's CUDA major, NCCL bandwidth with 2+ GPUs (skipped on one, with the reason) and CUDA IPC
bandwidth, the all-to-all of sequence parallelism over every GPU, a tiny bf16 run under colocated and async1, rollout/train parity, and one transformer
block per model family at its published width, forward and backward in bf16); without them the
report lists what it skipped. Exit code 1 only when something stops digenrl from running.
"""


def register(app: typer.Typer) -> None:
    """Add the ``doctor`` command to ``app``."""
    app.command(epilog=_EPILOG)(doctor)


def doctor(
    json_out: Path = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
    gpu: bool = typer.Option(True, "--gpu/--no-gpu", help="Run the GPU checks when CUDA devices are present."),
    sp: bool = typer.Option(False, "--sp", help="Also measure sequence parallelism's all-to-all between 2 local gloo "
                            "processes beside a memcpy (10-30 s; on GPUs the NCCL one always runs)."),
) -> None:
    """Check this machine: the stack, its host links and (with GPUs) its device links."""
    from digenrl.doctor import diagnose
    from digenrl.doctor.report import render

    report = diagnose(gpu=gpu, sp=sp)
    typer.echo(render(report))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1, default=str))
        typer.echo(f"wrote {json_out}")
    if report["problems"]:
        raise typer.Exit(1)
