"""torch and cupy must be built for the same CUDA major: which cupy to install, and whether the one here fits.

cupy carries the nccl weight lane (``transport.weights = 'nccl'``, :mod:`digenrl.transport.nccl`) and
ships one wheel per CUDA major (``cupy-cuda12x``, ``cupy-cuda13x``); a build for another major than
torch's loads a second CUDA runtime beside torch's, or none. Seen on an H200: torch 2.11 on CUDA 13 with
the ``cupy-cuda12x`` that the ``gpu`` extra used to name for everyone.

The comparison is pure (:func:`cupy_verdict`, on version strings); :func:`check_cupy` reads this
machine. ``python -m digenrl.doctor.cuda`` prints :func:`install_plan` for this torch, which ``setup.sh``
follows on a machine with a GPU: the matching wheel, then the other cupy wheels installed (nothing for a
CPU torch).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from typing import Any

__all__ = ["cuda_major", "cupy_package_for", "cupy_major_of_package", "installed_cupy_packages", "cupy_verdict",
           "check_cupy", "install_plan"]

_CUPY_WHEEL = re.compile(r"^cupy-cuda(\d+?)(x|\d)$")


def cuda_major(version: str | None) -> int | None:
    """``"13.0"`` -> 13; ``None`` (a CPU build) stays ``None``."""
    if not version:
        return None
    head = version.strip().split(".")[0]
    return int(head) if head.isdigit() else None


def cupy_package_for(torch_cuda: str | None) -> str | None:
    """The cupy wheel built for the CUDA major of ``torch.version.cuda`` (``None`` for a CPU torch)."""
    major = cuda_major(torch_cuda)
    return None if major is None else f"cupy-cuda{major}x"


def cupy_major_of_package(name: str) -> int | None:
    """The CUDA major a cupy distribution is built for: ``cupy-cuda12x`` -> 12, ``cupy-cuda117`` -> 11;
    ``None`` for a source build (``cupy``), which compiles against whatever CUDA it found."""
    m = _CUPY_WHEEL.match(name.lower().replace("_", "-"))
    if m is None:
        return None
    return int(m.group(1))  # the last character is "x" or the minor: cuda117 -> "11" + "7"


def installed_cupy_packages() -> list[str]:
    """The cupy distributions installed here (normally none or one; two fight over the ``cupy`` module)."""
    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    return sorted(n for n in names if n == "cupy" or n.startswith("cupy-cuda"))


def cupy_verdict(torch_cuda: str | None, cupy_cuda: int | None, *, installed: bool,
                 packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """Does cupy's CUDA major match torch's?

    Args:
        torch_cuda: ``torch.version.cuda`` (``None``: a CPU build of torch).
        cupy_cuda: the CUDA major cupy was built for (its runtime, else its package name); ``None``: unknown.
        installed: cupy is importable here.
        packages: the cupy distributions installed (named in the advice).

    Returns:
        ``ok`` (True / False / None when nothing can be compared), with ``problem`` when they differ and
        ``note`` when there is nothing to compare (cupy absent: the nccl weight lane needs it).
    """
    want = cupy_package_for(torch_cuda)
    out: dict[str, Any] = {"torch_cuda": torch_cuda, "cupy_cuda": cupy_cuda, "cupy_packages": list(packages),
                           "wanted": want}
    if want is None:
        return {**out, "ok": None, "note": "torch is a CPU build: no CUDA to match cupy to"}
    if not installed:
        return {**out, "ok": None, "note": f"cupy is not installed: transport.weights = 'nccl' needs it "
                                           f"(pip install {want}; the other weight lanes work without it)"}
    if cupy_cuda is None:
        return {**out, "ok": None, "note": f"cannot tell which CUDA cupy ({', '.join(packages) or 'cupy'}) is built "
                                           f"for; torch is on CUDA {torch_cuda}, whose cupy is {want}"}
    if cupy_cuda != cuda_major(torch_cuda):
        have = ", ".join(packages) or f"a cupy for CUDA {cupy_cuda}"
        fix = f"pip uninstall -y {' '.join(packages)} && pip install {want}" if packages else f"pip install {want}"
        return {**out, "ok": False, "problem": f"torch is built for CUDA {torch_cuda} but cupy for CUDA {cupy_cuda} "
                                               f"({have}): the nccl weight lane needs cupy's build for CUDA "
                                               f"{cuda_major(torch_cuda)}: {fix}"}
    return {**out, "ok": True}


def _cupy_runtime_major() -> tuple[int | None, str | None]:
    """cupy's CUDA runtime major and, when it cannot say, why (an import or runtime error)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.runtimeGetVersion()) // 1000, None
    except Exception as exc:  # a cupy for another CUDA may fail to load its runtime at all: that is the finding
        return None, f"{type(exc).__name__}: {exc}"


def check_cupy() -> dict[str, Any]:
    """:func:`cupy_verdict` for this machine: torch's CUDA against cupy's runtime (else its package name)."""
    import torch

    installed = importlib.util.find_spec("cupy") is not None
    packages = tuple(installed_cupy_packages())
    major, why = _cupy_runtime_major() if installed else (None, None)
    if major is None:
        majors = {m for m in map(cupy_major_of_package, packages) if m is not None}
        major = majors.pop() if len(majors) == 1 else None
    out = cupy_verdict(torch.version.cuda, major, installed=installed, packages=packages)
    return {**out, "cupy_runtime_error": why} if why else out


def install_plan(torch_cuda: str | None, packages: list[str]) -> list[str]:
    """What ``setup.sh`` installs on a GPU machine: ``[wanted, *the other cupy wheels installed]``, ``[]`` for a
    CPU torch. With others present setup removes them all, then installs the wanted one afresh (two wheels
    share the ``cupy`` module's files). A source build (``cupy``) is left alone: someone built it on purpose."""
    want = cupy_package_for(torch_cuda)
    return [] if want is None else [want, *(p for p in packages if p != want and p.startswith("cupy-cuda"))]


if __name__ == "__main__":
    import torch

    print(" ".join(install_plan(torch.version.cuda, installed_cupy_packages())))
