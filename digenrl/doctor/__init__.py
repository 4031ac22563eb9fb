"""``digenrl doctor``: can this machine run digenrl, and how fast are its links?

:func:`diagnose` returns one JSON-friendly report with three sections:

* ``host`` (always, a few seconds): versions of the stack, cores, RAM, ``/dev/shm``, the host
  lanes' bandwidth beside a memcpy of the same bytes (:mod:`digenrl.doctor.host`) and the header
  round trip between two processes on each event loop beside raw synchronous pyzmq.
* ``cpu_parity`` (always, a few seconds; :mod:`digenrl.doctor.parity`): rollout/train parity of two
  tiny fp32 CPU runs (``colocated``, ``async1``), from their ``parity_*`` metrics.
* ``all_to_all`` (with ``sp``, 10-30 s; :mod:`digenrl.doctor.all_to_all`): the all-to-all of sequence
  parallelism (Ulysses) between 2 local gloo processes beside a memcpy of the same bytes.
* ``gpu`` (only with CUDA devices; :mod:`digenrl.doctor.gpu`): devices, the P2P matrix, torch's and
  cupy's CUDA major (:mod:`digenrl.doctor.cuda`), NCCL broadcast (with 2 GPUs or more: skipped on
  one, with the reason) and CUDA IPC bandwidth beside a device-to-device copy, a tiny bf16 run under
  ``colocated`` and ``async1``, rollout/train parity at the first update, and one transformer block
  per model family at its published width trained once in bf16 (:mod:`digenrl.doctor.blocks`).
  Without a GPU the section lists what it skipped and why, and the report still counts as healthy.

``problems`` lists what stops digenrl from running here (empty: good to go).
"""

from __future__ import annotations

from typing import Any

__all__ = ["diagnose"]


def diagnose(*, gpu: bool = True, sp: bool = False) -> dict[str, Any]:
    """Run every check that applies to this machine; see the module docstring.

    Args:
        gpu: also run the GPU checks when CUDA devices are present.
        sp: also measure the gloo all-to-all of sequence parallelism (2 processes, 10-30 s on 2 busy cores).
    """
    from digenrl.doctor import host, parity
    from digenrl.doctor import gpu as gpu_checks

    from digenrl.doctor.all_to_all import check_gloo

    report: dict[str, Any] = {"host": host.check_host(), "cpu_parity": parity.cpu_parity()}
    if sp:  # sequence parallelism's exchange between 2 gloo processes (their start is most of its time)
        report["all_to_all"] = check_gloo()
    report["gpu"] = gpu_checks.check_gpu() if gpu else {"skipped": ["GPU checks (--no-gpu)"]}
    report["problems"] = (host.problems(report["host"]) + parity.problems(report["cpu_parity"])
                          + gpu_checks.problems(report["gpu"]))
    return report
