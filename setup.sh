#!/usr/bin/env bash
# Sets up .venv with digenrl and its test tools. Idempotent: a second run installs nothing new.
# On a machine without an NVIDIA GPU it installs the CPU build of torch, never a multi-GB CUDA one.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install "torch==2.13.0"
  # A CPU wheel on local disk (pip's find-links) first, its dependencies from the usual index;
  # else the CPU index of the PyTorch project, which also serves torch's dependencies.
  elif pip install --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
    pip install "torch==2.13.0"
  else
    pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
pip install -e ".[dev]"
# With a GPU, cupy (the nccl weight lane) must be the build for torch's CUDA major: cupy-cuda12x beside
# a CUDA 13 torch loads no runtime of its own. The plan (digenrl.doctor.cuda, the rule `digenrl doctor`
# checks) is the matching wheel, then the other cupy wheels installed; it is empty for a torch without
# CUDA. Two builds share the files of the `cupy` module, so with another one present all go before the
# matching one is installed afresh. A CPU machine (CI) never gets here.
if command -v nvidia-smi >/dev/null 2>&1; then
  plan=$(.venv/bin/python -m digenrl.doctor.cuda)  # an assignment, so that a failure stops setup (set -e)
  read -ra plan <<<"$plan"
  if [ "${#plan[@]}" -gt 0 ]; then
    [ "${#plan[@]}" -eq 1 ] || pip uninstall -y "${plan[@]}"
    pip install "${plan[0]}>=13"
  fi
fi
