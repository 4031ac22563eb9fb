"""`digenrl doctor`: the CPU part runs here for real; the GPU part is the first-GPU-day checklist."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from digenrl.doctor import gpu as gpu_checks
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


def test_cpu_parity_problems_name_the_run_and_the_tolerance() -> None:
    from digenrl.doctor import parity

    good = {"schedule": "colocated", "rows": 96, "ratio": 1.0, "ratio_dev_max": 1.2e-7, "logp_diff_max": 1.2e-7,
            "tolerance": 1e-3}
    off = {**good, "schedule": "async1", "ratio_dev_max": 2e-3}
    assert parity.problems([good]) == []
    assert parity.problems([good, off, {"schedule": "tag", "error": "RemoteError: boom"}]) == [
        "rollout/train parity on CPU (async1): max |ratio - 1| 0.002, max |dlog-prob| 1.2e-07 > "
        "train.parity_tolerance 0.001", "tiny CPU tag run failed: RemoteError: boom"]
