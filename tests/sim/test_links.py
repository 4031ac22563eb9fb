"""Links between sites: the fleet grammar, what a link costs by hand, and the cross-site bench scenarios."""

from __future__ import annotations

import pytest

from digenrl.errors import ConfigError
from digenrl.schedule.base import Fragment, Token, TokenKind
from digenrl.sim.bench import run_bubbles, simulate_pair
from digenrl.sim.link_traffic import LinkBytes, LinkTraffic
from digenrl.sim.links import HOME, TRANSFERS, Link, choose_transfer, parse_link
from digenrl.sim.scenarios import SCENARIOS
from digenrl.sim.user import fleet_pools, format_fleet, load_scenario


@pytest.mark.parametrize("fleet", ["16xH800", "8xH800+16xL40S@1gbit", "32xH100+16xL40S@10gbit/20ms",
                                   "4xA100@2.5gbit/500us+8xH800", "8xH800+4xL40S@100mbit/1.5s+2xRTX4090@64kbit"])
def test_fleet_round_trips(fleet: str) -> None:
    pools = fleet_pools(fleet)
    assert format_fleet(pools) == fleet
    assert fleet_pools(format_fleet(pools)) == pools


def test_fleet_units_are_decimal_bits_and_one_way_latency() -> None:
    home, far = fleet_pools("8xH800+16xl40s@100Mbit/20ms")
    assert home.link is None and (far.device, far.count) == ("L40S", 16)
    assert far.link == Link(100e6, 0.020)
    assert parse_link("2.5gbit").bytes_per_s == 2.5e9 / 8
    assert parse_link("64kbit/250us") == Link(64e3, 250e-6)


@pytest.mark.parametrize("fleet, part, says", [
    ("8xH800+16xL40S@1gbps", "'16xL40S@1gbps'", "rate '1gbps'"),
    ("8xH800+16xL40S@1gbit/20", "'16xL40S@1gbit/20'", "latency '20'"),
    ("8xH800+16xL40S@", "'16xL40S@'", "rate ''"),
    ("8xH800+16xL40S@0mbit", "'16xL40S@0mbit'", "rate '0mbit'"),
    ("8xH800+16xFOO@1gbit", "'16xFOO@1gbit'", "unknown device 'FOO'"),
    ("8xH800+x@1gbit", "'x@1gbit'", "is not <count>x<device>"),
])
def test_fleet_errors_name_the_bad_part(fleet: str, part: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        fleet_pools(fleet)
    assert part in str(err.value) and says in str(err.value)


def test_a_device_type_lives_at_one_site() -> None:
    with pytest.raises(ConfigError, match="H800 is at two sites"):
        fleet_pools("8xH800+8xH800@1gbit")


def test_scenario_file_link(tmp_path) -> None:
    text = ('model = "flux"\nprompts = 8\ngroup_size = 4\nnum_steps = 4\ntrained_steps = 2\n'
            '[[pools]]\ndevice = "H800"\ncount = 8\n[[pools]]\ndevice = "L40S"\ncount = 4\nlink = "{}"\n')
    path = tmp_path / "xs.toml"
    path.write_text(text.format("1gbit/20ms"))
    user = load_scenario(path)
    assert user.pools[1].link == Link(1e9, 0.02)
    assert user.scenario.links == (("L40S", Link(1e9, 0.02)),)
    assert user.scenario.testbed == "8xH800 + 4xL40S@1gbit/20ms"
    path.write_text(text.format("fast"))
    with pytest.raises(ConfigError, match=r"pools\[1\]\.link: rate 'fast'"):
        load_scenario(path)


# -- what a link costs, by hand -------------------------------------------------------------------------------

_FRAG = Fragment(batch=0, index=0, prompt_start=0, prompt_end=1, member_start=0, member_end=4, group_size=4)


def _traffic(link: Link, publication: float = 3e9) -> LinkTraffic:
    nbytes = LinkBytes(publication=publication, row=2e6, sample=1e6, latent=5e5, gradient=0.0)
    return LinkTraffic({"h-0": HOME, "f-0": "far"}, {"far": link}, nbytes, rows_per_sample=2)


def _publish(tid: int, version: int) -> Token:
    return Token(tid, TokenKind.PUBLISH, "h-0", version - 1, policy_version=version)


def test_a_publication_holds_the_lead_trainer_until_it_crossed_and_the_reply_is_back() -> None:
    link = Link(1e9, 0.020)
    traffic = _traffic(link)
    crossing = 3e9 * 8 / 1e9 + 0.020  # 24 s of serialisation + 20 ms
    # the lead packs for 0.5 s, then sends and awaits the far actor's reply (another 20 ms back)
    assert traffic.carry(_publish(1, 1), "h-0", 10.0, 0.5) == pytest.approx(crossing + 0.020)
    rollout = Token(2, TokenKind.ROLLOUT, "f-0", 1, num_samples=4, step_end=1, policy_version=1, fragments=(_FRAG,))
    assert traffic.wait(rollout, "f-0", 11.0) == pytest.approx(10.5 + crossing - 11.0)  # there at 34.52 s
    assert traffic.wait(rollout, "h-0", 11.0) == 0.0  # the home site has it at once
    # the next version queues behind the first on the link's down direction (FIFO): it leaves at 34.5 s
    assert traffic.carry(_publish(3, 2), "h-0", 12.0, 0.5) == pytest.approx(34.5 + crossing + 0.020 - 12.5)


def test_a_far_reward_uploads_its_fragment_inside_its_token_and_the_trainer_pulls_nothing() -> None:
    traffic = _traffic(Link(100e6))
    reward = Token(1, TokenKind.REWARD, "f-0", 0, num_samples=4, fragments=(_FRAG,), sources=("f-0",))
    # 4 samples x (1 MB + 2 rows x 2 MB) = 20 MB at 12.5 MB/s, after its 0.3 s of scoring
    assert traffic.carry(reward, "f-0", 5.0, 0.3) == pytest.approx(20e6 / 12.5e6)
    assert traffic.carried["far"]["samples"] == pytest.approx(20e6)
    train = Token(2, TokenKind.TRAIN, "h-0", 0, num_samples=4, transitions=8, fragments=(_FRAG,), rows=((0, 8),))
    assert traffic.carry(train, "h-0", 7.0, 1.0) == 0.0 and traffic.wait(train, "h-0", 7.0) == 0.0


def test_a_reply_waits_behind_the_data_enqueued_before_it_the_other_way() -> None:
    traffic = _traffic(Link(100e6), publication=50e6)  # a publication of 4 s at 12.5 MB/s
    reward = Token(1, TokenKind.REWARD, "f-0", 0, num_samples=4, fragments=(_FRAG,), sources=("f-0",))
    assert traffic.carry(reward, "f-0", 0.0, 1.0) == pytest.approx(1.6)  # alone, its upload is back at 2.6 s
    # the lead publishes from 0.5 s (0.1 s of packing): down from 0.6 s to 4.6 s
    assert traffic.carry(_publish(2, 1), "h-0", 0.5, 0.1) == pytest.approx(4.0)  # its reply: no upload ahead
    # the upload's reply (and its acknowledgements) leave at 2.6 s behind the publication: the reward ends at 4.6 s
    assert traffic.hold(reward, 2.6) == pytest.approx(4.6)
    assert traffic.hold(reward, 4.6) == pytest.approx(4.6)  # then it may end
    assert traffic.moving["f-0"] == pytest.approx(1.6 + 2.0)


def test_choose_transfer_picks_the_least_compression_that_fits() -> None:
    full = 40.86e9  # Qwen-Image-20B, bf16
    assert choose_transfer(10e9, full, 100.0)[0].name == "none"  # 32.7 s < 50 s
    option, why = choose_transfer(1e9, full, 100.0)  # none 327 s, int8 164 s, top-1% (5 bytes an entry) 8.2 s
    assert option.name == "topk" and "8.17 s over 1gbit" in why
    option, why = choose_transfer(1e9, full, 300.0, share=1.0)  # none 327 s > 300 s, int8 164 s
    assert option.name == "int8"
    assert choose_transfer(1e6, full, 10.0)[0] == TRANSFERS[-1] and "more than the whole step" in \
        choose_transfer(1e6, full, 10.0)[1]


# -- the simulator and the bench -------------------------------------------------------------------------------

def test_far_rollouts_start_only_after_their_version_crossed() -> None:
    sc = SCENARIOS["xs-qwen-full-1g"]
    res = simulate_pair(sc, "async1", 3)
    link = dict(sc.links)["A100"]
    pub_s = 2 * sc.profile.transformer_params * 8 / 1e9  # the whole bf16 transformer over 1 Gbit/s
    assert link.seconds(sc.profile.publish_bytes) == pytest.approx(pub_s)
    publish = {s.version: s for s in res.spans if s.kind == "publish"}
    assert all(s.end - s.start >= pub_s for s in publish.values())  # the lead holds it until it crossed
    far = [s for s in res.spans if s.kind == "rollout" and s.device.startswith("a100") and s.version in publish]
    assert far, "the far site generated with a published version"
    for s in far:
        assert s.start >= publish[s.version].end - 1e-6
    assert not any(s.kind == "link" for s in res.spans)  # so no far device ever waits for a version


def test_cross_site_bench_says_when_the_far_site_is_worth_it() -> None:
    names = ["xs-qwen-lora-10g", "xs-qwen-full-1g"]
    report = run_bubbles(names, ["colocated", "async1"], num_batches=4, decomposition=False)
    rows = {(r["scenario"], r["schedule"]): r for r in report.rows}
    colocated = rows[("xs-qwen-lora-10g", "colocated")]
    assert colocated["split"]["hybrid"] == 32  # the training cluster alone
    lora, full = rows[("xs-qwen-lora-10g", "async1")]["far_site"], rows[("xs-qwen-full-1g", "async1")]["far_site"]
    assert lora["worth_it"] and not full["worth_it"]
    assert full["gain"] < -0.5  # a 41 GB publication every step over 1 Gbit/s starves the pipeline
    lines = [n for n in report.notes if n.startswith("xs-qwen-full-1g")]
    assert lines and "NOT worth it" in lines[0] and "40.9 GB in 327 s" in lines[0]
