"""The virtual-clock engine's accounting, the calibration, and the cost model's scaling laws."""

from __future__ import annotations

import math

import pytest

from digenrl.schedule import make_schedule
from digenrl.schedule.base import Device, Event, Role, Schedule, Token, TokenDone, TokenKind, Workload
from digenrl.sim.calibration import PUBLISHED, calibrate, calibrated_params
from digenrl.sim.engine import SimulationError, simulate
from digenrl.telemetry.spans import COMPUTE_KINDS, busy_seconds
from digenrl.telemetry.stats import summarize
from digenrl.sim.scenarios import Scenario, placement, scenario


class _FixedCost:
    """Seconds stored in each token's meta: a cost whose answers the test can add up by hand."""

    def seconds(self, token: Token, device: Device) -> float:
        return float(token.meta["s"])

    def tag_switch_seconds(self, name: str, to_helper: bool = True) -> float:
        return 0.0


class _TwoDevices(Schedule):
    """A rolls 3 s then 5 s; B trains 4 s once A's first token is done; then a 1 s OPTIM on both."""

    name = "hand"

    def __init__(self) -> None:
        self._done: set[int] = set()

    def start(self) -> list[Token]:
        return [Token(1, TokenKind.ROLLOUT, "a", 0, num_samples=1, step_end=1, meta={"s": 3})]

    def on_event(self, event: Event) -> list[Token]:
        assert isinstance(event, TokenDone)
        self._done.add(event.token.id)
        if event.token.id == 1:
            return [Token(2, TokenKind.ROLLOUT, "a", 0, num_samples=1, step_end=1, meta={"s": 5}),
                    Token(3, TokenKind.TRAIN, "b", 0, transitions=1, meta={"s": 4})]
        if {2, 3} <= self._done and 4 not in self._done and event.token.id in (2, 3):
            self._done.add(4)
            return [Token(5, TokenKind.OPTIM, "a", 0, group=("a", "b"), meta={"s": 1})]
        return []

    @property
    def done(self) -> bool:
        return 5 in self._done


def test_hand_computable_two_device_makespan() -> None:
    devices = [Device("a", Role.ROLLOUT), Device("b", Role.TRAINER)]
    res = simulate(_TwoDevices(), devices, Workload(1, 1, 1, 1, 1), _FixedCost())  # type: ignore[arg-type]
    # a: [0,3) [3,8) optim [8,9); b: [3,7) idle [7,8) optim [8,9)
    assert res.wall == 9.0
    spans = {(s.device, s.token): (s.start, s.end) for s in res.spans}
    assert spans[("b", 3)] == (3.0, 7.0) and spans[("a", 5)] == (8.0, 9.0) and spans[("b", 5)] == (8.0, 9.0)
    stats = summarize(res)
    assert stats.per_device_bubble["a"] == 0.0
    assert math.isclose(stats.per_device_bubble["b"], 4.0 / 9.0)


def test_busy_device_is_a_contract_violation() -> None:
    class Bad(_TwoDevices):
        def start(self) -> list[Token]:
            return [Token(1, TokenKind.ROLLOUT, "a", 0, meta={"s": 1}), Token(9, TokenKind.ROLLOUT, "a", 0, meta={"s": 1})]

    with pytest.raises(SimulationError, match="busy device 'a'"):
        simulate(Bad(), [Device("a", Role.ROLLOUT), Device("b", Role.TRAINER)], Workload(1, 1, 1, 1, 1), _FixedCost())  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["colocated", "disaggregated", "gap", "tsp", "tag", "async1"])
def test_accounting_on_a_real_schedule(name: str) -> None:
    sc = scenario("qwen-16")
    devices, cost = placement(sc, colocated=name == "colocated")
    workload = sc.workload(3)
    res = simulate(make_schedule(name, devices, workload, cost), devices, workload, cost)
    stats = summarize(res)
    assert stats.samples_scored == workload.num_batches * workload.samples_per_batch
    assert sorted(res.optim_end) == [0, 1, 2]
    assert stats.max_staleness <= (1 if name == "async1" else 0)
    for d in devices:
        own = sorted((s for s in res.spans if s.device == d.name), key=lambda s: s.start)
        for prev, nxt in zip(own, own[1:]):
            assert nxt.start >= prev.end - 1e-9, f"{d.name}: overlapping spans"
        busy = busy_seconds(own, 0.0, res.wall, COMPUTE_KINDS | {TokenKind.PUBLISH, TokenKind.SWITCH})
        idle = res.wall - busy
        assert idle >= -1e-9 and math.isclose(busy + idle, res.wall)
        assert math.isclose(1.0 - busy_seconds(own, 0.0, res.wall) / res.wall, stats.per_device_bubble[d.name])


def test_calibration_reproduces_the_published_colocated_run() -> None:
    cal = calibrate()
    assert 0.0 < cal.params.mfu_train < cal.params.mfu_rollout < 1.0
    assert math.isclose(cal.step, PUBLISHED.step_seconds)
    # The real colocated schedule on the simulator, not just the fit's arithmetic: 4 H800, 512 images/step.
    sc = Scenario("calib", PUBLISHED.model, PUBLISHED.prompts, PUBLISHED.group_size, PUBLISHED.num_steps,
                  PUBLISHED.trained_steps, ((PUBLISHED.device, PUBLISHED.gpus),))
    devices, cost = placement(sc, colocated=True)
    workload = sc.workload(4)
    res = simulate(make_schedule("colocated", devices, workload, cost), devices, workload, cost)
    per_step = (res.optim_end[3] - res.optim_end[0]) / 3
    assert per_step == pytest.approx(PUBLISHED.step_seconds, rel=0.03)
    assert summarize(res).steady.samples_per_s / PUBLISHED.gpus == pytest.approx(0.305, rel=0.03)


def test_cost_scales_with_work_and_tsp_saves_its_share() -> None:
    sc = scenario("qwen-16")
    devices, cost = placement(sc, colocated=False)
    trainer = next(d for d in devices if d.role is Role.TRAINER)
    one = cost.seconds(Token(0, TokenKind.TRAIN, trainer.name, 0, transitions=64), trainer)
    two = cost.seconds(Token(0, TokenKind.TRAIN, trainer.name, 0, transitions=128), trainer)
    packed = cost.seconds(Token(0, TokenKind.TRAIN, trainer.name, 0, transitions=128, packed=True), trainer)
    lat = calibrated_params().pass_latency_s
    assert (two - lat) == pytest.approx(2 * (one - lat), rel=1e-6)
    assert packed < two and (two - packed) / two == pytest.approx(calibrated_params().tsp_train_saving, rel=0.05)


def test_colocated_pays_the_old_logprob_recompute_and_reward_matches_the_async_delta() -> None:
    params = calibrated_params()
    sc = scenario("qwen-16")
    co_devices, co_cost = placement(sc, colocated=True)
    dis_devices, dis_cost = placement(sc, colocated=False)
    hybrid = co_devices[0]
    trainer = next(d for d in dis_devices if d.role is Role.TRAINER)
    rows = 256
    co = co_cost.seconds(Token(0, TokenKind.TRAIN, hybrid.name, 0, transitions=rows), hybrid)
    dis = dis_cost._train(Token(0, TokenKind.TRAIN, trainer.name, 0, transitions=rows), trainer,
                          dis_cost.specs[trainer.name])
    net = rows * 2 * dis_cost.profile.latent_bytes / dis_cost.specs[trainer.name].net_bytes_per_s
    lat = params.pass_latency_s
    # 4 training passes + 1 recompute forward on the hybrid engine vs 4 on a dedicated trainer.
    assert (co - lat) / (dis - net - lat) == pytest.approx(5 / 4, rel=1e-9)
    # Scoring the published batch on the 4 reference GPUs costs the 60 s that async reward saved.
    ref = Scenario("calib", PUBLISHED.model, PUBLISHED.prompts, PUBLISHED.group_size, PUBLISHED.num_steps,
                   PUBLISHED.trained_steps, ((PUBLISHED.device, PUBLISHED.gpus),))
    devices, cost = placement(ref, colocated=True)
    per_gpu = PUBLISHED.samples // PUBLISHED.gpus
    reward = cost.seconds(Token(0, TokenKind.REWARD, devices[0].name, 0, num_samples=per_gpu), devices[0])
    decode = per_gpu * cost.profile.decode_flops / (cost.specs[devices[0].name].peak_bf16_flops * params.mfu_rollout)
    assert reward - decode - lat == pytest.approx(420.0 - 360.0, rel=1e-6)


def test_ring_allreduce_cost_matches_a_hand_computation() -> None:
    from digenrl.schedule.cost import ring_allreduce_seconds

    # 100 MB over 8 ranks at 450 GB/s (NVLink), 64 MiB buckets -> 2 buckets, 14 ring steps each.
    hand = 2 * 7 / 8 * 100e6 / 450e9 + 2 * 14 * 10e-6
    assert ring_allreduce_seconds(100e6, 8, 450e9, 10e-6) == pytest.approx(hand, rel=1e-12)
    assert ring_allreduce_seconds(100e6, 1, 450e9, 10e-6) == 0.0
    # In the cost model: a multi-node trainer group (qwen-64: trainers across nodes) pays the NIC.
    sc = scenario("scale-128")
    devices, cost = placement(sc, colocated=False)
    trainers = tuple(d.name for d in devices if d.role is Role.TRAINER)
    n = len(trainers)
    nbytes = cost.params.grad_bytes * cost.profile.trainable_params
    bw = min(cost.specs[t].net_bytes_per_s for t in trainers) if n > 8 else min(
        cost.specs[t].intra_node_bytes_per_s for t in trainers)
    buckets = math.ceil(nbytes / 2**26)
    expected = 2 * (n - 1) / n * nbytes / bw + buckets * 2 * (n - 1) * cost.params.collective_latency_s
    assert n > 1 and cost.allreduce_seconds(trainers) == pytest.approx(expected, rel=1e-9)
    optim = cost.seconds(Token(0, TokenKind.OPTIM, trainers[0], 0, group=trainers), devices[0])
    alone = cost.seconds(Token(0, TokenKind.OPTIM, trainers[0], 0, group=trainers[:1]), devices[0])
    assert optim - alone / n == pytest.approx(expected, rel=1e-9)
