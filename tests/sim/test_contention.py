"""Core contention in the simulator: busy single-thread processes sharing a host's cores, by hand."""

from __future__ import annotations

import pytest

from digenrl.errors import ConfigError
from digenrl.schedule.base import Device, Event, Role, Schedule, Token, TokenDone, TokenKind, Workload
from digenrl.sim.contention import Contention
from digenrl.sim.engine import simulate

from tests.sim.test_sim_engine import _FixedCost, _TwoDevices


def test_factor_uses_the_measured_counts_and_time_shares_beyond_them() -> None:
    c = Contention(2, {2: 1.02, 3: 1.56})
    assert c.factor(0) == c.factor(1) == 1.0
    assert c.factor(2) == 1.02 and c.factor(3) == 1.56
    assert c.factor(4) == pytest.approx(1.56 * (4 / 2) / (3 / 2))  # beyond 3: time-shared from the trio
    # nothing measured: pure time-sharing of 2 cores
    bare = Contention(2)
    assert bare.factor(2) == 1.0 and bare.factor(3) == pytest.approx(1.5) and bare.factor(6) == pytest.approx(3.0)
    assert Contention.from_dict(c.to_dict()) == c


def test_a_mix_factor_replaces_its_counts_and_survives_a_round_trip() -> None:
    c = Contention(2, {2: 1.04, 3: 1.5}, {"rollout+train": 1.12, "rollout+rollout": 0.99}, 1.05)
    assert c.mix_factor(["train", "rollout"]) == 1.12 and c.mix_factor(["rollout", "rollout"]) == 0.99
    assert c.mix_factor(["reward", "train"]) == pytest.approx(1.04 * 1.05)  # not fitted: its count's, rescaled
    assert c.mix_factor(["reward", "rollout", "train"]) == pytest.approx(1.5 * 1.05)
    assert c.mix_factor(["train"]) == c.mix_factor([]) == 1.0
    assert Contention.from_dict(c.to_dict()) == c
    assert Contention.from_dict({"cores": 2, "slowdown": {"2": 1.04}}).mix == {}  # reports before mixes


@pytest.mark.parametrize(("args", "field"), [((0,), "cores"), ((2, {2: 0.0}), r"slowdown\[2\]"),
                                             ((2, {}, {"rollout+train": -1.0}), r"mix\['rollout\+train'\]")])
def test_bad_contention_is_named(args: tuple, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        Contention(*args)
    with pytest.raises(ConfigError, match="contention"):
        Contention.from_dict({"cores": 2})


def test_two_devices_on_one_core_share_it() -> None:
    """The engine test's schedule on 1 core: a runs alone [0,3); a's 5 s and b's 4 s token share the core,
    b done at 3 + 2x4 = 11 (a has 1 s left), a alone to 12; the optimizer step on both, 1 s at half speed."""
    devices = [Device("a", Role.ROLLOUT), Device("b", Role.TRAINER)]
    seen: list[tuple[int, float]] = []

    class Observed(_TwoDevices):
        def on_event(self, event: Event) -> list[Token]:
            assert isinstance(event, TokenDone)
            seen.append((event.token.id, event.observed_seconds))
            return super().on_event(event)

    res = simulate(Observed(), devices, Workload(1, 1, 1, 1, 1), _FixedCost(),  # type: ignore[arg-type]
                   contention=Contention(1))
    spans = {(s.device, s.token): (s.start, s.end) for s in res.spans}
    assert spans[("a", 1)] == (0.0, 3.0) and spans[("b", 3)] == (3.0, 11.0) and spans[("a", 2)] == (3.0, 12.0)
    assert spans[("a", 5)] == spans[("b", 5)] == (12.0, 14.0) and res.wall == 14.0 and res.optim_end == {0: 14.0}
    assert dict(seen) == {1: 3.0, 3: 8.0, 2: 9.0, 5: 2.0}  # schedules learn the wall seconds, as from a real run
    # with a core each nothing changes: the engine test's 9 s
    assert simulate(_TwoDevices(), devices, Workload(1, 1, 1, 1, 1), _FixedCost(),  # type: ignore[arg-type]
                    contention=Contention(2)).wall == 9.0


class _Alongside(Schedule):
    """a and b each run ``n`` 1-s tokens back to back; c runs a 1-s token beside every ``every``-th token of a."""

    name = "alongside"

    def __init__(self, n: int, every: int) -> None:
        self.n, self.every, self.count, self.c_running, self.c_due = n, every, {"a": 0, "b": 0}, False, False
        self.ids = iter(range(1, 10_000))

    def _tok(self, d: str) -> Token:
        self.c_running = self.c_running or d == "c"
        return Token(next(self.ids), TokenKind.ROLLOUT, d, 0, num_samples=1, step_end=1, meta={"s": 1.0})

    def start(self) -> list[Token]:
        return [self._tok("a"), self._tok("b"), self._tok("c")]

    def on_event(self, event: Event) -> list[Token]:
        assert isinstance(event, TokenDone)
        d = event.token.device
        if d == "c":
            self.c_running = False
        else:
            self.count[d] += 1
            self.c_due = self.c_due or (d == "a" and self.count["a"] % self.every == 0 and self.count["a"] < self.n)
        out = [self._tok(d)] if d != "c" and self.count[d] < self.n else []
        if self.c_due and not self.c_running:  # c starts with a's next token (at the same instant on a tie)
            self.c_due = False
            out.append(self._tok("c"))
        return out

    @property
    def done(self) -> bool:
        return self.count == {"a": self.n, "b": self.n} and not self.c_running


_ABC = [Device(d, Role.ROLLOUT) for d in ("a", "b", "c")]


def test_three_always_busy_devices_on_two_cores_run_at_two_thirds_speed() -> None:
    res = simulate(_Alongside(8, 1), _ABC, Workload(1, 1, 1, 1, 1), _FixedCost(), contention=Contention(2))  # type: ignore[arg-type]
    assert res.wall == pytest.approx(8 * 1.5)
    assert simulate(_Alongside(8, 1), _ABC, Workload(1, 1, 1, 1, 1), _FixedCost()).wall == 8.0  # type: ignore[arg-type]


def test_a_device_idle_part_of_the_time_contends_less() -> None:
    """c works beside every second token of a: those take 1.5 s (three share 2 cores), the others 1 s, so a's 8
    tokens take 4 x 2.5 = 10 s, not the 12 a constant 3-on-2 slowdown would charge (nor the 8 of no sharing)."""
    res = simulate(_Alongside(8, 2), _ABC, Workload(1, 1, 1, 1, 1), _FixedCost(), contention=Contention(2))  # type: ignore[arg-type]
    a = sorted((s.start, s.end) for s in res.spans if s.device == "a")
    assert [round(e - s, 9) for s, e in a] == [1.5, 1.0] * 4
    assert res.wall == pytest.approx(10.0)
    # a measured trio factor replaces the pure 3/2 while three run (each of them, beside a's odd tokens)
    measured = simulate(_Alongside(8, 2), _ABC, Workload(1, 1, 1, 1, 1), _FixedCost(),  # type: ignore[arg-type]
                        contention=Contention(2, {2: 1.1, 3: 1.6}))
    assert measured.wall == pytest.approx(4 * (1.6 + 1.1))


def test_alone_seconds_divides_each_token_by_its_mean_slowdown() -> None:
    """Spans a [0,4), b [0,2), c [1,3) on 2 cores: 3 busy (x1.5) only over [1,2). a: mean (1+1.5+1+1)/4 = 1.125,
    b and c: (1+1.5)/2 = 1.25; a token the trace lacks keeps its seconds."""
    from digenrl.sim.contention import alone_seconds
    from digenrl.telemetry.spans import Span

    toks = {d: Token(i, TokenKind.ROLLOUT, d, 0) for i, d in enumerate("abcd")}
    spans = [Span("a", "rollout", 0, 0, 0, 0.0, 4.0, token=0), Span("b", "rollout", 0, 0, 0, 0.0, 2.0, token=1),
             Span("c", "train", 0, 0, 0, 1.0, 3.0, token=2)]
    got = dict((t.device, s) for t, s in alone_seconds([(toks[d], s) for d, s in zip("abcd", (4.0, 2.0, 2.0, 7.0))],
                                                       spans, Contention(2)))
    assert got == pytest.approx({"a": 4.0 / 1.125, "b": 2.0 / 1.25, "c": 2.0 / 1.25, "d": 7.0})


def test_measured_costs_carry_the_contention_to_the_planner() -> None:
    from digenrl.sim.measured import AllReduce, MeasuredCost

    fits = {k: (0.001, 0.002) for k in ("rollout", "reward", "train", "optim", "publish")}
    cost = MeasuredCost(fits, 0.0005, AllReduce(1e6, 1e9, 1e-4), Contention(2, {2: 1.01, 3: 1.55}))
    cal = cost.to_calibration()
    assert cal["contention"] == {"cores": 2, "slowdown": {"2": 1.01, "3": 1.55}}
    assert MeasuredCost.from_calibration(cal) == cost
    del cal["contention"]  # a report from before the contention model: each device owns its compute
    assert MeasuredCost.from_calibration(cal).contention is None
    with pytest.raises(ConfigError, match="calibration.contention"):
        MeasuredCost.from_calibration({**cal, "contention": {"slowdown": {}}})


def test_bench_contention_is_a_lone_run_over_the_mean_of_k_at_once() -> None:
    from digenrl.recipes.bench_real import _contention

    c = _contention(220.0, {2: [110.0, 106.0], 3: [70.0, 75.0, 75.0]})
    assert c.slowdown == pytest.approx({2: 220.0 / 108.0, 3: 220.0 / 73.333333333})
    assert c.cores >= 1
    assert _contention(220.0, {2: [0.0, 100.0]}).slowdown == {}  # a run that measured nothing gives no factor


def test_bench_contention_takes_each_counts_median_over_rounds() -> None:
    """Rounds (pair, trio) 0.97/1.47, 0.98/1.68 (a disturbed trio), 1.31/1.50 (a disturbed pair): 0.98 and 1.50."""
    from digenrl.recipes.bench_real import _median_contention

    rounds = [Contention(2, {2: 0.97, 3: 1.47}), Contention(2, {2: 0.98, 3: 1.68}), Contention(2, {2: 1.31, 3: 1.50})]
    assert _median_contention(rounds) == Contention(2, {2: 0.98, 3: 1.50})
    assert _median_contention([Contention(2, {2: 1.0}), Contention(2, {})]) == Contention(2, {2: 1.0})
    assert _median_contention([]) is None


class _AlongsideTrain(_Alongside):
    """As :class:`_Alongside`, c's tokens are TRAIN: the mixes are rollout+rollout and rollout+rollout+train."""

    def _tok(self, d: str) -> Token:
        token = super()._tok(d)
        return Token(token.id, TokenKind.TRAIN, d, 0, meta={"s": 1.0}) if d == "c" else token


def test_the_engine_slows_each_moment_by_its_mix() -> None:
    """a and b always busy, c beside every second token of a: (pair 1.1, trio with c's train 1.9) -> a's 8
    tokens take 4 x (1.9 + 1.1); the counted factors (1.0, 1.5) alone give 4 x 2.5."""
    counted = Contention(2, {2: 1.0, 3: 1.5})
    mixed = Contention(2, {2: 1.0, 3: 1.5}, {"rollout+rollout": 1.1, "rollout+rollout+train": 1.9})
    w = Workload(1, 1, 1, 1, 1)
    assert simulate(_AlongsideTrain(8, 2), _ABC, w, _FixedCost(), contention=counted).wall == pytest.approx(10.0)  # type: ignore[arg-type]
    assert simulate(_AlongsideTrain(8, 2), _ABC, w, _FixedCost(), contention=mixed).wall == pytest.approx(12.0)  # type: ignore[arg-type]


def test_fit_mix_recovers_the_mix_factors_a_run_had() -> None:
    """Tokens whose seconds the engine stretched by known mix factors (1 s each alone): the fit gets the factors
    back from the spans alone."""
    from digenrl.sim.contention import fit_mix

    counted = Contention(2, {2: 1.0, 3: 1.5})
    truth = Contention(2, {2: 1.0, 3: 1.5}, {"rollout+rollout": 1.1, "rollout+rollout+train": 1.9})
    res = simulate(_AlongsideTrain(12, 3), _ABC, Workload(1, 1, 1, 1, 1), _FixedCost(), contention=truth)  # type: ignore[arg-type]
    kinds = {"a": TokenKind.ROLLOUT, "b": TokenKind.ROLLOUT, "c": TokenKind.TRAIN}
    tokens = [(Token(s.token, kinds[s.device], s.device, 0), s.end - s.start) for s in res.spans]
    fitted = fit_mix([(tokens, res.spans)], lambda token: 1.0, counted, prior_weight=1e-9)
    assert fitted.mix == pytest.approx(truth.mix, rel=1e-6)
    assert fitted.slowdown == counted.slowdown
    # other mixes on the fit's scale: its factors' time-weighted mean over their counts' (1.0 and 1.5)
    # (a and b are busy throughout, c only beside them: every token counts the time of each mix it ran in)
    trio = sum(s.end - s.start for s in res.spans if s.device == "c")
    pair = res.wall - trio
    expected = (2 * pair * 1.1 / 1.0 + 3 * trio * 1.9 / 1.5) / (2 * pair + 3 * trio)
    assert fitted.mix_scale == pytest.approx(expected, rel=1e-6)
    # no mix holds 99% of the tokens' time: nothing fitted, the counted factors stand
    assert fit_mix([(tokens, res.spans)], lambda token: 1.0, counted, min_share=0.99) == counted
