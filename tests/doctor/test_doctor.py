"""`digenrl doctor`: the CPU part runs here for real; the GPU part is the first-GPU-day checklist."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from digenrl.doctor import gpu as gpu_checks
from digenrl.doctor.blocks import FAMILIES, BlockShape
from digenrl_cli.main import app
from tests.conftest import gpu_test

pytestmark = pytest.mark.timeout(300)


def test_doctor_reports_this_machine(tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    result = CliRunner().invoke(app, ["doctor", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "host lanes" in result.output and "ready: nothing stops digenrl here" in result.output
    report = json.loads(out.read_text())
    host = report["host"]
    assert host["versions"]["torch"] == torch.__version__
    import msgpack
    import zmq

    assert host["versions"]["libzmq"] == zmq.zmq_version() and host["versions"]["msgpack"] == msgpack.__version__
    m = host["machine"]
    assert m["cpu_count"] == os.cpu_count() and 0 < m["ram_available_bytes"] <= m["ram_bytes"]
    assert m["shm_bytes"] == os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    for lane in ("inproc", "shm"):
        rows = host["lanes"][lane]
        assert [r["size_bytes"] for r in rows] == [16 << 20, 64 << 20]
        for r in rows:  # a real measurement: positive, finite, and consistent with its own parts
            assert r["gbps"] > 0 and r["memcpy_gbps"] > 0
            assert r["ratio"] == pytest.approx(r["gbps"] / r["memcpy_gbps"])
    loops = {r["loop"]: r for r in host["event_loops"]}
    assert set(loops) == {"uvloop", "asyncio"}
    for r in loops.values():
        assert 0 < r["raw_pyzmq_rtt_us"] < 1e6 and r["vs_raw"] == pytest.approx(r["rtt_us"] / r["raw_pyzmq_rtt_us"])
    # Parity of two tiny CPU runs, from their parity_* metrics: every step measured, ratio 1.
    parity = {r["schedule"]: r for r in report["cpu_parity"]}
    assert set(parity) == {"colocated", "async1"} and "rollout/train parity" in result.output
    for r in parity.values():
        assert r["steps"] == 2 and r["rows"] > 0 and r["dtype"] == "float32"
        assert abs(r["ratio"] - 1) <= r["ratio_dev_max"] + 1e-12 and r["ratio_dev_max"] <= r["tolerance"]
        assert 0 <= r["logp_diff_max"] <= r["tolerance"]
    if not torch.cuda.is_available():
        assert report["gpu"]["available"] is False
        assert report["gpu"]["skipped"] == list(gpu_checks.SKIPPED_WITHOUT_GPU)
        assert "gpu: skipped" in result.output
    assert report["problems"] == []


def test_parity_verdict_uses_the_tolerance() -> None:
    run = {"schedule": "async1", "first_update": {"ratio": 1.0004, "ratio_dev": 2e-4}}
    assert gpu_checks._parity([run])["ok"] is True
    off = {"schedule": "colocated", "first_update": {"ratio": 1.003, "ratio_dev": 2e-4}}
    verdict = gpu_checks._parity([run, off])
    assert verdict["ok"] is False and "colocated: ratio 1.003000" in verdict["why"]
    assert gpu_checks.problems({"available": True, "parity": verdict}) == [f"rollout/train parity: {verdict['why']}"]


@pytest.mark.gpu
@gpu_test()
def test_gpu_checklist_passes() -> None:
    report = gpu_checks.check_gpu()
    assert report["available"] and report["count"] == torch.cuda.device_count()
    assert gpu_checks.problems(report) == [], report
    assert report["parity"]["ok"] is True
    for run in report["tiny_runs"]:
        assert run["samples_per_s"] > 0 and all(v > 0 for v in run["peak_memory_bytes"].values())
    # A collective at world size 1 is a skip with its reason, never a bandwidth; otherwise one over every GPU.
    for name, step in gpu_checks.collective_plan(report["count"]).items():
        assert report[name] == step if "skipped" in step else report[name]["gpus"] == step["world"], report[name]
    # Every family's block at its published width trained in bf16 (a failure is a named problem above).
    assert set(report["blocks"]) == set(FAMILIES)
    assert all(r["ok"] and r["train_ms"] > 0 and r["dtype"] == "bfloat16" for r in report["blocks"].values())


def test_cpu_parity_problems_name_the_run_and_the_tolerance() -> None:
    from digenrl.doctor import parity

    good = {"schedule": "colocated", "rows": 96, "ratio": 1.0, "ratio_dev_max": 1.2e-7, "logp_diff_max": 1.2e-7,
            "tolerance": 1e-3}
    off = {**good, "schedule": "async1", "ratio_dev_max": 2e-3}
    assert parity.problems([good]) == []
    assert parity.problems([good, off, {"schedule": "tag", "error": "RemoteError: boom"}]) == [
        "rollout/train parity on CPU (async1): max |ratio - 1| 0.002, max |dlog-prob| 1.2e-07 > "
        "train.parity_tolerance 0.001", "tiny CPU tag run failed: RemoteError: boom"]


# ------------------------------------------------------------------- collectives need two GPUs


@pytest.mark.parametrize("count", [0, 1])
def test_collectives_are_skipped_below_two_gpus(count: int) -> None:
    plan = gpu_checks.collective_plan(count)
    assert plan == {name: {"skipped": f"needs 2 GPUs, found {count}"} for name in gpu_checks.COLLECTIVES}
    assert set(plan) == {"nccl_broadcast", "nccl_communicator", "nccl_all_to_all"}


@pytest.mark.parametrize("count", [2, 8])
def test_collectives_run_once_over_every_gpu(count: int) -> None:
    # World size 1 is never measured: a broadcast to nobody reported 10 TB/s on an H200.
    assert gpu_checks.collective_plan(count) == {name: {"world": count} for name in gpu_checks.COLLECTIVES}


def test_problems_ignore_skips_and_notes_and_name_a_failed_block() -> None:
    ok_block = {"family": "qwenimage", "ok": True, "forward_ms": 3.0, "train_ms": 9.0}
    error = "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasLtMatmul(...)`"
    report = {"available": True, "count": 1, **gpu_checks.collective_plan(1),
              "cupy": {"ok": None, "note": "cupy is not installed: transport.weights = 'nccl' needs it"},
              "blocks": {"qwenimage": ok_block}, "parity": {"ok": True}}
    assert gpu_checks.problems(report) == []
    report["blocks"]["flux"] = {"family": "flux", "ok": False, "phase": "backward", "error": error}
    assert gpu_checks.problems(report) == [
        f"flux: a real-width block cannot train on this stack: backward failed: {error}"]
    report["blocks"] = {"error": "ImportError: no diffusers"}  # the check itself broke: one line, not one per family
    assert gpu_checks.problems(report) == ["gpu check blocks failed: ImportError: no diffusers"]


def test_report_shows_a_skip_as_its_reason() -> None:
    from digenrl.doctor.report import _gpu_result

    assert _gpu_result({"skipped": "needs 2 GPUs, found 1"}) == "skipped: needs 2 GPUs, found 1"
    assert _gpu_result({"ok": False, "problem": "torch is built for CUDA 13.0 but ..."}).startswith("problem: torch")


def test_report_has_a_row_per_block_family() -> None:
    from digenrl.doctor.report import _blocks_section

    shape = {"batch": 2, "frames": 1, "height": 32, "width": 32, "text_tokens": 512}
    _, columns, rows = _blocks_section({
        "qwenimage": {"ok": True, "dim": 3072, "shape": shape, "dtype": "bfloat16", "forward_ms": 3.25,
                      "train_ms": 9.5},
        "flux": {"ok": False, "phase": "backward", "error": "RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED", "dim": 3072,
                 "shape": shape, "dtype": "bfloat16"},
    })
    assert columns[:3] == ["family", "width", "tokens (B x (image + text))"]
    assert rows == [["qwenimage", "3072", "2 x (1024 + 512)", "bfloat16", "3.2 ms", "9.5 ms", "ok"],
                    ["flux", "3072", "2 x (1024 + 512)", "bfloat16", "-", "-",
                     "backward failed: RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED"]]


# --------------------------------------------------------------------- torch and cupy: one CUDA


def test_cupy_built_for_another_cuda_is_a_problem_naming_both_and_the_fix() -> None:
    from digenrl.doctor.cuda import cupy_verdict

    v = cupy_verdict("13.0", 12, installed=True, packages=("cupy-cuda12x",))
    assert v["ok"] is False and v["wanted"] == "cupy-cuda13x"
    assert v["problem"] == ("torch is built for CUDA 13.0 but cupy for CUDA 12 (cupy-cuda12x): the nccl weight lane "
                            "needs cupy's build for CUDA 13: pip uninstall -y cupy-cuda12x && pip install cupy-cuda13x")
    assert gpu_checks.problems({"available": True, "cupy": v}) == [v["problem"]]
    assert cupy_verdict("12.8", 12, installed=True, packages=("cupy-cuda12x",)) == {
        "torch_cuda": "12.8", "cupy_cuda": 12, "cupy_packages": ["cupy-cuda12x"], "wanted": "cupy-cuda12x", "ok": True}


def test_cupy_absent_or_cpu_torch_is_a_note_not_a_problem() -> None:
    from digenrl.doctor.cuda import cupy_verdict

    absent = cupy_verdict("13.0", None, installed=False)
    assert absent["ok"] is None and "problem" not in absent
    assert absent["note"].startswith(
        "cupy is not installed: transport.weights = 'nccl' needs it (pip install cupy-cuda13x")
    assert gpu_checks.problems({"available": True, "cupy": absent}) == []
    assert cupy_verdict(None, 12, installed=True)["ok"] is None  # CPU torch: nothing to match
    unknown = cupy_verdict("12.4", None, installed=True, packages=("cupy",))
    assert unknown["ok"] is None and "cupy-cuda12x" in unknown["note"]


def test_cupy_package_names_and_setup_plan() -> None:
    from digenrl.doctor.cuda import cuda_major, cupy_major_of_package, cupy_package_for, install_plan

    assert [cuda_major(v) for v in ("13.0", "12.8", None, "")] == [13, 12, None, None]
    assert [cupy_package_for(v) for v in ("13.0", "12.4", None)] == ["cupy-cuda13x", "cupy-cuda12x", None]
    assert [cupy_major_of_package(p) for p in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda117", "cupy-cuda80",
                                               "cupy")] == [13, 12, 11, 8, None]
    assert install_plan("13.0", ["cupy-cuda12x"]) == ["cupy-cuda13x", "cupy-cuda12x"]  # install, then remove
    assert install_plan("13.0", ["cupy-cuda13x", "cupy"]) == ["cupy-cuda13x"]  # a source build stays
    assert install_plan(None, ["cupy-cuda12x"]) == []  # a CPU torch gets no cupy


def test_setup_plan_installs_no_cupy_for_this_torch() -> None:
    import subprocess
    import sys

    # What setup.sh runs on a machine with nvidia-smi: empty for a torch without CUDA (this one, and CI's).
    plan = subprocess.run([sys.executable, "-m", "digenrl.doctor.cuda"], capture_output=True, text=True, check=True)
    expected = "" if torch.version.cuda is None else f"cupy-cuda{torch.version.cuda.split('.')[0]}x"
    assert plan.stdout.split()[:1] == expected.split()


# ------------------------------------------------------ one transformer block per family, trained

SMALL = BlockShape(batch=2, frames=1, height=4, width=4, text_tokens=8)  # the CPU twin: milliseconds a family


@pytest.mark.parametrize("family", FAMILIES)
def test_block_check_cpu_twin_trains_each_family(family: str) -> None:
    from digenrl.doctor.blocks import block_check

    r = block_check(family, SMALL, device="cpu", dtype=torch.float32, heads=2, rounds=1)
    assert r["ok"] is True, r.get("traceback")
    head_dim = 64 if family == "sd3" else 128
    assert r["dim"] == 2 * head_dim and r["heads"] == 2 and r["params"] > 0  # published head width, two heads
    assert r["forward_ms"] > 0 and r["train_ms"] > 0 and r["shape"]["text_tokens"] == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_block_backward_reaches_every_parameter(family: str) -> None:
    from digenrl.doctor.blocks import build_block

    case = build_block(family, SMALL, device="cpu", dtype=torch.float32, heads=2)
    outputs = case.run()
    assert len(outputs) == (1 if family == "wan21" else 2)  # Wan's block has one stream, the others two
    sum(o.pow(2).mean() for o in outputs).backward()
    missing = [n for n, p in case.block.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    if family in ("flux", "sd3"):  # the text stream's feed-forward (its gemm failed in cuBLAS for FLUX.1 on an H200)
        assert case.block.ff_context.net[2].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_block_inputs_live_on_the_block_device(family: str) -> None:
    from digenrl.doctor.blocks import build_block

    # On meta, any host tensor (a rope table, a mask, position ids) meeting the block fails as on CUDA.
    case = build_block(family, SMALL, device="meta", dtype=torch.bfloat16, heads=2)
    sum(o.float().pow(2).mean() for o in case.run()).backward()
    assert all(p.device.type == "meta" and p.grad is not None for p in case.block.parameters())


def test_block_check_failure_is_a_finding_with_its_phase() -> None:
    from digenrl.doctor import blocks

    r = blocks.block_check("flux", SMALL, device="cpu", dtype=torch.float32, heads=0, rounds=1)
    assert r["ok"] is False and r["phase"] == "build" and r["error"] == "ValueError: heads must be positive, got 0"
    assert blocks.problems({"flux": r}) == [
        "flux: a real-width block cannot train on this stack: build failed: ValueError: heads must be positive, got 0"]
    with pytest.raises(ValueError, match="unknown model family 'sdxl'"):
        blocks.block_check("sdxl")


def test_check_blocks_runs_in_a_child_and_survives_its_crash() -> None:
    from digenrl.doctor.blocks import check_blocks

    # An unknown family makes block_check raise inside the child, which dies: the doctor reports that
    # family's process and goes on with the next one in a fresh process.
    out = check_blocks(("sdxl", "flux"), device="cpu", dtype=torch.float32, heads=2, shape=SMALL, rounds=1,
                       timeout_s=60)
    assert list(out) == ["sdxl", "flux"]
    assert out["sdxl"] == {"family": "sdxl", "ok": False, "phase": "process",
                          "error": "the check process exited with code 1"}
    assert out["flux"]["ok"] is True and out["flux"]["dim"] == 256


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_published_width_block_trains_on_cpu(family: str) -> None:
    from digenrl.doctor.blocks import block_check

    # The real width (0.34-0.35 B parameters), one block, a few tokens: 6-12 s each on two cores.
    r = block_check(family, SMALL, device="cpu", dtype=torch.float32, rounds=1)
    assert r["ok"] is True, r.get("traceback")
    assert r["dim"] == {"qwenimage": 3072, "flux": 3072, "wan21": 5120, "hunyuanvideo": 3072, "sd3": 2432}[family]


@pytest.mark.slow  # ~25 s on 2 busy cores: spawning the two gloo processes is most of it
def test_sp_all_to_all_on_gloo_beside_a_memcpy(tmp_path: Path) -> None:
    from digenrl.doctor.all_to_all import check_gloo

    r = check_gloo(nbytes=4 << 20, rounds=3)
    assert "error" not in r, r
    assert r["processes"] == 2 and r["size_bytes"] == 4 << 20 and r["gbps"] > 0 and r["memcpy_gbps"] > 0
    # gbps counts what a rank sends to the other (half its buffer); ratio = exchange time / memcpy time
    assert r["gbps"] == pytest.approx(r["size_bytes"] / 2 / r["seconds"] / 1e9)
    assert r["ratio"] == pytest.approx(r["seconds"] * r["memcpy_gbps"] * 1e9 / r["size_bytes"])


@gpu_test(2)
def test_sp_all_to_all_over_every_gpu() -> None:
    from digenrl.doctor.all_to_all import check_nccl

    n = torch.cuda.device_count()
    r = check_nccl(n, nbytes=64 << 20, rounds=5)
    assert r["gpus"] == n and r["gbps"] > 1.0, r  # NVLink or PCIe: well above a gigabyte a second
    assert check_nccl(1) == {"skipped": "needs 2 GPUs, found 1"}
