"""Ulysses sequence parallelism (``digenrl.models.sequence_parallel``) against SP = 1, on real gloo process groups.

Each comparison spawns the members once (``_sp_member.py``: real processes on 127.0.0.1) and runs the same script
without a group for the reference (computed in this process meanwhile); the members' numbers must equal it within
fp32 rounding. The default run's spawn is 4 processes = 2 SP groups of 2 (the world's ``(dp, sp)`` mesh of
data-parallel SP trainers), each group on inputs of its own, against a reference per group: a group whose
collectives crossed into the other's would come out with the other's numbers, or fail. Measured (tiny
presets, fp32, worst over members, relative to the largest entry of the reference tensor): velocities and
log-probs <= 2.6e-7; summed gradients <= 2.6e-6 (HunyuanVideo's NFT rows; a few tensors whose exact gradient is
zero, e.g. a key bias under softmax, are rounding noise around 0, so the bound is on the whole vector, not per
tensor); weights after one AdamW step <= 2.7e-6 (Qwen-Image at SP = 4). Wan2.1 and Wan2.2 come out bit-equal in
the velocity and log-probs.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from digenrl.errors import ConfigError
from digenrl.models._sp_plans import check_sequences
from digenrl.models.sequence_parallel import check_heads, sp_group_size, sync_gradients
from tests.conftest import ROOT, child_env, gpu_test

MEMBER = Path(__file__).with_name("_sp_member.py")
_spec = importlib.util.spec_from_file_location("_sp_member", MEMBER)
member = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(member)  # type: ignore[union-attr]
TOL = 5e-6  # relative to the largest entry of each compared tensor (module docstring)
FLOW_KEYS = ("velocity", "log_prob", "x_final", "train_sums", "grad", "stepped", "parity_sums")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(out: Path, world: int, *args: str) -> list[subprocess.Popen]:
    """``world`` members of one gloo group, started all at once."""
    port = _free_port()
    cmds = [[sys.executable, str(MEMBER), "--rank", str(r), "--world", str(world), "--port", str(port),
             "--out", str(out), *args] for r in range(world)]
    return [subprocess.Popen(c, env=child_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for c in cmds]


def _wait(procs: list[subprocess.Popen], timeout: float = 600) -> None:
    """Wait for the members; fails with their stderr."""
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode:
            errors.append(err[-3000:])
    assert not errors, "\n".join(errors)


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)  # written by our own child processes, not read from a peer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _compare(out: Path, case: str, world: int, keys: tuple[str, ...], groups: int = 1) -> dict[str, float]:
    refs = [_load(out / f"ref{g}" / f"{case}.0.pt") for g in range(groups)]
    worst: dict[str, float] = {}
    for r in range(world):
        ref = refs[r // (world // groups)]  # SP group g ran on the inputs of reference g
        got = _load(out / f"sp{world}" / f"{case}.{r}.pt")
        for k in keys:
            assert got[k].shape == ref[k].shape, (case, k)
            worst[k] = max(worst.get(k, 0.0), _rel(got[k], ref[k]))
    print(f"SP={world // groups} x {groups} groups {case}: worst relative difference to SP=1 {worst}")  # shown with pytest -s
    return worst


def _spawn(tmp: Path, world: int, cases: list[str], *flags: str, groups: int = 1) -> Path:
    """The members' numbers under ``tmp/sp<world>`` (``groups`` SP groups of ``world / groups``); the references',
    computed here meanwhile, under ``tmp/ref<g>``, one for each group's inputs."""
    (tmp / f"sp{world}").mkdir(exist_ok=True)
    procs = _start(tmp / f"sp{world}", world, "--groups", str(groups), *flags, *cases)
    try:
        for g in range(groups):
            (tmp / f"ref{g}").mkdir(exist_ok=True)
            member.main(["--out", str(tmp / f"ref{g}"), "--shift", str(g), *[f for f in flags if f != "--refusals"],
                         *cases])
    finally:
        _wait(procs)
    return tmp


@pytest.fixture(scope="module")
def wan_sp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One spawn for the default run: Wan2.1 tiny (32 latent tokens) at SP = 2, two SP groups of one world (ranks
    [0, 1] and [2, 3], each on its own inputs), with the refused sizes."""
    return _spawn(tmp_path_factory.mktemp("sp"), 4, ["wan21"], "--refusals", groups=2)


def test_wan21_sp2_equals_sp1_velocity_rollout_training_step_and_parity(wan_sp2: Path) -> None:
    """Each of the two SP groups of one world: its velocity, rollout, summed gradients, optimizer step and parity
    recompute are SP = 1's on its own inputs."""
    worst = _compare(wan_sp2, "wan21", 4, FLOW_KEYS, groups=2)
    assert all(v < TOL for v in worst.values()), str(worst)
    refs = [_load(wan_sp2 / f"ref{g}" / "wan21.0.pt") for g in range(2)]
    assert refs[0]["grad"].abs().max() > 0 and refs[0]["log_prob"].numel() > 0  # the comparisons compare something
    for k in ("velocity", "grad"):  # the groups' inputs differ: a group answering with the other's numbers fails
        assert _rel(refs[1][k], refs[0][k]) > 1e-2, k


def test_indivisible_sequences_are_refused_with_the_numbers(wan_sp2: Path) -> None:
    for r in range(4):
        msgs = _load(wan_sp2 / "sp4" / f"refusals.{r}.pt")
        assert "5 text tokens (model.text_len) over SP degree 2" in msgs["text_len"]
        assert "'qwenimage' (4 heads)" in msgs["text_len"]
        assert "splits 9 latent tokens over SP degree 2" in msgs["forward"] and "'wan21' (2 heads)" in msgs["forward"]


def test_ulysses_attention_backward_is_the_inverse_all_to_all(wan_sp2: Path) -> None:
    """diffusers' Ulysses attention (all-to-all, attention over H/N heads, all-to-all back) on each member's shard:
    the output shards are the full attention's rows, and the q/k/v gradients summed over the members are the
    full attention's: its backward sends each gradient back where its tensor came from."""
    gen = torch.Generator().manual_seed(11)  # as _sp_member.attention
    q, k, v, w = (torch.randn(2, 8, 4, 6, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves)).transpose(1, 2)
    (out * w).sum().backward()
    for r in range(4):  # ranks 0, 1 and 2, 3: the two groups
        got = _load(wan_sp2 / "sp4" / f"attention.{r}.pt")
        assert _rel(got["out"], out.detach().chunk(2, dim=1)[r % 2]) < 1e-6
        for name, leaf in zip(("dq", "dk", "dv"), leaves, strict=True):
            assert _rel(got[name], leaf.grad) < 1e-6, name
    assert leaves[1].grad.abs().max() > 0


def test_heads_the_degree_does_not_divide_are_refused() -> None:
    from digenrl.models import load_model

    tr = load_model("wan21", "tiny").transformer
    with pytest.raises(ConfigError, match="has 2 attention heads, not divisible by the SP degree 4"):
        check_heads("wan21", tr, 4)
    check_heads("wan21", tr, 2)
    with pytest.raises(ConfigError, match="splits 32760 latent tokens over SP degree 16"):
        check_sequences("wan21", {"latent tokens": 32760}, 16, 12)  # Wan2.1 480x832x81 at SP 16
    check_sequences("wan21", {"latent tokens": 32760}, 8, 12)


def test_a_model_not_parallelized_has_degree_one_and_sync_without_group_is_a_noop() -> None:
    from digenrl.models import load_model

    model = load_model("wan21", "tiny")
    assert sp_group_size(model) == 1
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    sync_gradients([p], None)
    assert torch.equal(p.grad, torch.full((3,), 2.0))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["wan22", "hunyuanvideo", "qwenimage", "wan21_full"])
def test_each_family_at_sp2_equals_sp1_with_nft_rows(case: str, tmp_path: Path) -> None:
    out = _spawn(tmp_path, 2, [case], "--nft")
    worst = _compare(out, case, 2, (*FLOW_KEYS, "nft_sums", "nft_grad"))
    assert all(v < TOL for v in worst.values()), str(worst)
    parallel = {"wan22": 2, "wan21_full": 2}.get(case, 1)  # both experts; the transformer and its reference copy
    assert int(_load(out / "sp2" / f"{case}.0.pt")["parallel_modules"]) == parallel


@pytest.mark.slow
def test_wan21_nft_rows_at_sp2(tmp_path: Path) -> None:
    out = _spawn(tmp_path, 2, ["wan21"], "--nft")
    worst = _compare(out, "wan21", 2, ("nft_sums", "nft_grad"))
    assert all(v < TOL for v in worst.values()), str(worst)


@pytest.mark.slow
def test_qwenimage_at_sp4_equals_sp1(tmp_path: Path) -> None:
    """SP = 4: Qwen-Image tiny has 4 heads, 16 image and 8 text tokens (Wan/Hunyuan tiny have 2 heads)."""
    out = _spawn(tmp_path, 4, ["qwenimage"])
    worst = _compare(out, "qwenimage", 4, FLOW_KEYS)
    assert all(v < TOL for v in worst.values()), str(worst)


@gpu_test(2)
def test_wan21_sp2_on_two_gpus_with_nccl_equals_one_gpu(tmp_path: Path) -> None:
    """The same comparison on two CUDA devices over NCCL (member r on cuda:r, the reference on cuda:0). The bound is
    looser than on CPU: the attention kernels differ with the sequence length each device sees."""
    (tmp_path / "ref0").mkdir()
    (tmp_path / "sp2").mkdir()
    procs = _start(tmp_path / "sp2", 2, "--device", "cuda", "wan21")
    try:
        member.main(["--out", str(tmp_path / "ref0"), "--device", "cuda", "wan21"])
    finally:
        _wait(procs)
    worst = _compare(tmp_path, "wan21", 2, FLOW_KEYS)
    assert all(v < 1e-4 for v in worst.values()), worst
