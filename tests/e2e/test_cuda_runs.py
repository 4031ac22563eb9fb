"""What a user runs on a GPU: the main job on CUDA in bf16, its weight lanes, and checkpoints across devices.

The main job is ``configs/tiny-qwenimage.toml`` with ``model.device=cuda`` and ``model.dtype=bfloat16``
(as ``../shared/gpu/run.sh`` runs it), for three iterations:

* under ``colocated`` (one process) and ``async1`` (a rollout and a trainer process), every step keeps the
  rollout/trainer parity within ``train.parity_tolerance``, has a finite, non-zero gradient norm and trains
  the whole batch, and the reward is not the same at every step;
* under ``async1`` over both weight lanes one GPU has, ``zmq`` (host buffers) and ``cuda_ipc`` (device
  handles), each version the rollout actor is asked to sample with has the digest the trainer's weights had
  at that version;
* a checkpoint written on one device (async1, a quarter of the batch) resumes on the other (``cuda -> cpu``
  with the GPU hidden from the resuming processes, as on a machine without one) at step 2, from exactly
  the weights it holds. (``cpu -> cuda`` is left out to keep ``pytest -m gpu`` short: loading host
  tensors into CUDA parameters is what every rollout actor does at each publication.)

The CUDA cases have never run on a GPU (written without one); ``pytest -m gpu`` runs them. Their CPU twins
run here: ``cpu-zmq`` of the async1 test and ``cpu-cpu`` of the checkpoint test (the colocated loop's checks
on CPU are in tests/e2e/test_metrics_schema.py).
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from digenrl.actors import ActorSystem
from digenrl.config import Config, load_config
from digenrl.data.prompts import load_prompts
from digenrl.policy import trained_steps
from digenrl.recipes.checkpoint import find_checkpoint, load_state
from digenrl.recipes.colocated import train
from digenrl.recipes.disaggregated import arun_disaggregated, start_cluster, tiny_cpu_cost
from digenrl.roles.coordinator import Coordinator
from tests.conftest import gpu_marks, gpu_test

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
ON = {"cuda": ("model.device=cuda", "model.dtype=bfloat16"), "cpu": ("model.device=cpu", "model.dtype=float32")}
# Nothing but the steps: no pictures, checkpoints, trace or Gantt chart.
QUIET = ("log.image_every=0", "log.checkpoint_every=0", "log.trace=false", "log.gantt=false")


def _main_job(device: str, *overrides: str) -> Config:
    return load_config(CONFIG, [*ON[device], "train.iterations=3", *QUIET, *overrides])


def _assert_step(m: dict[str, Any], cfg: Config) -> None:
    """One optimizer step as a user needs it: parity within tolerance, a finite gradient, the whole batch trained."""
    ro = cfg.rollout
    assert m["parity_rows"] > 0, m
    assert m["parity_logp_diff_max"] <= cfg.train.parity_tolerance, m
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0, m
    assert m["rows_trained"] == ro.prompts_per_batch * ro.group_size * trained_steps(cfg), m
    assert math.isfinite(m["reward_mean"]) and 0.0 <= m["reward_mean"] <= 1.0, m


def _assert_run(history: list[dict[str, Any]], cfg: Config, staleness: list[int]) -> None:
    assert [m["step"] for m in history] == list(range(cfg.train.iterations))
    for m in history:
        _assert_step(m, cfg)
    assert len({m["reward_mean"] for m in history}) > 1, "the same reward at every step: nothing is sampled anew"
    assert [m["max_staleness"] for m in history] == staleness


def _cuda_allocations() -> int:
    """CUDA allocations this process has made so far (no stats before CUDA is initialised)."""
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


@gpu_test()
def test_main_job_under_colocated_on_cuda_in_bf16() -> None:
    cfg = _main_job("cuda", "schedule.name=colocated", "placement.threads=1")  # one torch thread, as every test
    before = _cuda_allocations()
    history = train(cfg, write_files=False)
    assert _cuda_allocations() > before, "the run made no CUDA allocation: it did not run on the GPU"
    _assert_run(history, cfg, [0, 0, 0])


async def _run_watching_weights(cfg: Config) -> tuple[list[dict[str, Any]], dict[int, str], dict[int, str], str]:
    """The recipe's actors and coordinator, wired as ``arun_disaggregated`` wires them, watched through the
    coordinator's dispatch hook: the trainer's digest just before each optimizer step (it holds version
    ``batch`` until then), the rollout actor's digest of each version a token asks it to sample with, and
    of each version it holds at the end.

    Returns the metrics, both digests by version, and the device a tensor computed by the rollout actor
    (its probe velocity) arrives on in this process.
    """
    trained: dict[int, str] = {}
    sampled: dict[int, str] = {}
    # as arun_disaggregated: on the cuda_ipc lane every actor message (weights too) rides that transport
    kind = "cuda_ipc" if cfg.transport.weights == "cuda_ipc" else cfg.transport.actors
    async with ActorSystem(transport=kind, name="coordinator") as system:
        cluster = await start_cluster(system, cfg)
        trainer, rollout = cluster.refs["trainer-0"], cluster.refs["rollout-0"]

        async def watch(device: str, token: dict[str, Any]) -> None:
            if token["kind"] == "optim":
                info = await trainer.weights_info.call()
                assert info["version"] == token["batch"], info
                trained[info["version"]] = info["digest"]
            elif token["kind"] == "rollout" and device == "rollout-0" and token["version"] not in sampled:
                sampled[token["version"]] = (await rollout.weights_info.call(token["version"]))["digest"]

        coordinator = Coordinator(cfg, cfg.schedule.name, cluster.devices, cluster.refs,
                                  load_prompts(cfg.data.prompt_set, cfg.data.prompts, cfg.data.prompt_file),
                                  options=dict(cfg.schedule_options), cost=tiny_cpu_cost(), is_dead=cluster.is_dead,
                                  weights_lane="zmq", bucket_mb=cfg.transport.bucket_mb, on_dispatch=watch,
                                  shard=cfg.shard)  # zmq and cuda_ipc: buckets as actor messages
        history = await coordinator.run()
        final = await trainer.weights_info.call()
        trained[final["version"]] = final["digest"]
        held = await rollout.weights_info.call()
        for v in held["versions"]:  # what it holds at the end (the last publication included)
            sampled.setdefault(v, (await rollout.weights_info.call(v))["digest"])
        probe = await rollout.probe_velocity.call(held["versions"][-1])
        assert torch.isfinite(probe).all()
        arrived_on = probe.device.type
        del probe  # unmapped (a cuda_ipc handle) before its producer shuts down
        gc.collect()
    return history, trained, sampled, arrived_on


@pytest.mark.parametrize(("device", "lane"), [
    pytest.param("cpu", "zmq", id="cpu-zmq"),  # the CPU twin
    pytest.param("cuda", "zmq", marks=gpu_marks(), id="cuda-zmq"),
    pytest.param("cuda", "cuda_ipc", marks=gpu_marks(), id="cuda-cuda_ipc"),
])
async def test_main_job_under_async1_samples_with_the_trainers_weights(device: str, lane: str) -> None:
    cfg = _main_job(device, "schedule.name=async1", f"transport.weights={lane}")
    history, trained, sampled, arrived_on = await _run_watching_weights(cfg)
    _assert_run(history, cfg, [0, 1, 1])  # batch k >= 1 is sampled by version k - 1
    assert max(sampled) >= 1, f"the rollout actor never sampled with a trained version: {sorted(sampled)}"
    assert trained[1] != trained[0], "the first step left the weights as they were: equal digests prove nothing"
    for v in sorted(sampled):
        assert v in trained and sampled[v] == trained[v], (
            f"{lane}: the rollout actor holds version {v} as {sampled[v]}, the trainer had {trained.get(v)}")
    # zmq decodes what crosses an actor boundary on the host; cuda_ipc hands device memory over by handle
    assert arrived_on == {"zmq": "cpu", "cuda_ipc": "cuda"}[lane]


async def _run_on(device: str, monkeypatch: pytest.MonkeyPatch, cfg: Config, out: Path,
                  **kw: Any) -> list[dict[str, Any]]:
    with monkeypatch.context() as env:
        if device == "cpu":
            env.setenv("CUDA_VISIBLE_DEVICES", "")  # the actor processes run as on a machine without a GPU
        return await arun_disaggregated(cfg, out, **kw)


@pytest.mark.parametrize(("written", "resumed"), [
    pytest.param("cpu", "cpu", id="cpu-cpu"),
    pytest.param("cuda", "cpu", marks=gpu_marks(), id="cuda-cpu"),
])
async def test_a_checkpoint_resumes_on_another_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str,
                                                      resumed: str) -> None:
    """``digenrl run`` 2 iterations on one device with a checkpoint each, then ``--resume`` on the other for a
    third: it continues at step 2 from exactly the checkpoint's weights (async1: and batch 2 from version 1)."""
    common = ("schedule.name=async1", "rollout.prompts_per_batch=8", "schedule.fragment_groups=4",
              "schedule.train_pack=32", *QUIET, "log.checkpoint_every=1")
    first = await _run_on(written, monkeypatch, load_config(CONFIG, [*ON[written], "train.iterations=2", *common]),
                          tmp_path / "written")
    ckpt = find_checkpoint(tmp_path / "written")
    assert ckpt.name == "step-000002" and load_state(ckpt)["version"] == 2
    assert (ckpt / "previous.safetensors").is_file()  # version 1, which batch 2 is sampled with
    weights = load_file(str(ckpt / "trainable.safetensors"))

    cfg = load_config(CONFIG, [*ON[resumed], "train.iterations=3", *common])
    history = await _run_on(resumed, monkeypatch, cfg, tmp_path / "resumed", resume=tmp_path / "written")
    assert [m["step"] for m in history] == [0, 1, 2]
    keys = ("reward_mean", "grad_norm", "policy_loss", "version")
    assert [{k: m[k] for k in keys} for m in history[:2]] == [{k: m[k] for k in keys} for m in first]
    assert history[2]["version"] == 3 and history[2]["max_staleness"] == 1
    _assert_step(history[2], cfg)
    # The resumed trainer stepped from the checkpoint's weights, bit for bit: its own checkpoint keeps the
    # weights it held before that step (previous.safetensors, version 2) and the ones after it.
    after = find_checkpoint(tmp_path / "resumed")
    assert after.name == "step-000003" and load_state(after)["version"] == 3
    before_step = load_file(str(after / "previous.safetensors"))
    stepped = load_file(str(after / "trainable.safetensors"))
    assert before_step.keys() == stepped.keys() == weights.keys()
    assert all(before_step[k].dtype == weights[k].dtype and torch.equal(before_step[k], weights[k]) for k in weights)
    assert any(not torch.equal(stepped[k], weights[k]) for k in weights), "the resumed step changed nothing"


@pytest.mark.parametrize(("device", "algorithm", "schedule"), [
    pytest.param("cpu", "nft", "async1", id="cpu-nft-async1"),  # the CPU twin
    *[pytest.param("cuda", a, s, marks=gpu_marks(), id=f"cuda-{a}-{s}")
      for a in ("nft", "awm") for s in ("colocated", "async1")],
])
async def test_forward_process_algorithms_on_the_main_job(device: str, algorithm: str, schedule: str) -> None:
    """DiffusionNFT and AWM on the main job (bf16 on CUDA): every row trained, a finite gradient, parity (the
    trainer's recompute of the rollout's first-step velocity probe) within bf16's reach. Never run on a GPU yet."""
    small = ("rollout.prompts_per_batch=8", "schedule.fragment_groups=4", "schedule.train_pack=32") if device == "cpu" else ()
    cfg = _main_job(device, f"schedule.name={schedule}", f"train.algorithm={algorithm}", "placement.threads=1", *small)
    history = train(cfg, write_files=False) if schedule == "colocated" else await arun_disaggregated(cfg, write_files=False)
    assert [m["step"] for m in history] == [0, 1, 2]
    ro = cfg.rollout
    for m in history:
        assert m["rows_trained"] == m["rows_kept"] == ro.prompts_per_batch * ro.group_size * trained_steps(cfg), m
        assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0, m
        assert math.isfinite(m["policy_loss"]), m
        if m["parity_rows"]:  # bf16 samples unmerged LoRA as the trainer computes: equal kernels, other batch sizes
            assert m["parity_logp_diff_max"] < (1e-4 if device == "cpu" else 5e-2), m
    assert history[0]["parity_rows"] > 0
    assert len({m["reward_mean"] for m in history}) > 1
