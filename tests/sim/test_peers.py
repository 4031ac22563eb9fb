"""The modelled peers: each pays exactly the costs its published behaviour says, nothing else."""

from __future__ import annotations

import math

import pytest

from digenrl.errors import ConfigError
from digenrl.sim.bench import run_bubbles, simulate_pair
from digenrl.sim.calibration import calibrated_params
from digenrl.sim.cost import TRAIN_PASSES
from digenrl.sim.decompose import CHAINS
from digenrl.sim.peers import PEERS, peer
from digenrl.sim.scenarios import scenario
from digenrl.telemetry.stats import summarize

BATCHES = 4


def _train_seconds(res, device: str) -> list[float]:
    return [s.end - s.start for s in res.spans if s.device == device and s.kind == "train"]


def test_flowgrpo_loop_pays_no_switch_and_no_recompute():
    sc = scenario("qwen-16")
    veromni = simulate_pair(sc, "colocated", BATCHES)
    flow = simulate_pair(sc, "colocated-flowgrpo", BATCHES)
    assert summarize(veromni).steady.switch_share > 0.0
    assert summarize(flow).steady.switch_share == 0.0
    dev = veromni.devices[0].name
    # Same train tokens; the hybrid's old-log-prob forward adds old_logprob_passes / TRAIN_PASSES.
    ratio = (TRAIN_PASSES + calibrated_params().old_logprob_passes) / TRAIN_PASSES
    latency = calibrated_params().pass_latency_s
    for a, b in zip(_train_seconds(veromni, dev), _train_seconds(flow, dev), strict=True):
        assert a - latency == pytest.approx((b - latency) * ratio, rel=1e-9)
    assert summarize(flow).steady.samples_per_s > summarize(veromni).steady.samples_per_s


def test_verl_async_aborts_restart_rollouts_at_each_publication():
    res = simulate_pair(scenario("hunyuan-16"), "verl-omni-async", BATCHES)
    publish_ends = {s.end for s in res.spans if s.kind == "publish"}
    aborts = [s for s in res.spans if s.kind == "abort"]
    assert aborts, "rollouts in flight at a weight sync must be thrown away"
    rollout_devices = {d.name for d in res.devices if d.role == "rollout"}
    for a in aborts:
        assert a.end in publish_ends and a.device in rollout_devices and a.end > a.start
        # The token starts over at the publication and runs its whole length again.
        restarted = [s for s in res.spans if s.token == a.token and s.kind == "rollout"]
        assert len(restarted) == 1 and restarted[0].start == a.end
    no_aborts = simulate_pair(scenario("hunyuan-16"), "unirl", BATCHES)
    assert not [s for s in no_aborts.spans if s.kind == "abort"]
    # Each device never runs two spans at once, aborted ones included.
    for dev in rollout_devices:
        spans = sorted((s for s in res.spans if s.device == dev), key=lambda s: s.start)
        for x, y in zip(spans, spans[1:]):
            assert y.start >= x.end - 1e-9


def test_lending_peer_pays_its_measured_switches():
    res = simulate_pair(scenario("qwen-16"), "verl-omni-async-lend", BATCHES)
    switches = [s for s in res.spans if s.kind == "switch"]
    assert switches, "the lending peer must lend an idle trainer at least once on qwen-16"
    for s in switches:
        assert s.end - s.start == pytest.approx(9.1 if s.helper else 3.3)


def test_decomposition_factors_multiply_to_the_measured_ratio():
    report = run_bubbles(["flux-16"], ["colocated", "verl-omni-async", "async1"], BATCHES)
    rows = {r["schedule"]: r["samples_per_s"] for r in report.rows}
    chains = report.decomposition["flux-16"]
    assert set(chains) == set(CHAINS)
    for baseline in ("colocated", "verl-omni-async"):
        chain = chains[baseline]
        assert chain["links"][0]["samples_per_s"] == rows[baseline]
        assert chain["links"][-1]["run"] == "async1" and chain["links"][-1]["samples_per_s"] == rows["async1"]
        assert math.prod(link["factor"] for link in chain["links"]) == pytest.approx(rows["async1"] / rows[baseline])
    # Removing a cost can only help: recompute and aborts are pure waste in the model.
    causes = {link["cause"]: link["factor"] for link in chains["verl-omni-async"]["links"]}
    assert causes["no aborts on weight sync"] >= 1.0
    assert causes["old-log-prob recompute removed"] > 1.0


def test_unknown_peer_names_the_known_ones():
    with pytest.raises(ConfigError, match="verl-omni-async"):
        peer("verl")
    with pytest.raises(ConfigError, match="peers: .*unirl"):
        run_bubbles(["qwen-16"], ["verl"], BATCHES)
    assert set(PEERS) == {"colocated-flowgrpo", "verl-omni-async", "verl-omni-async-lend", "unirl"}
