"""The failure budget of a reward (issue 11 item 2): a reward that fails on every sample stops the run
with a message naming it, its URL and the last failure; an occasional failure is only penalised."""

from __future__ import annotations

import pytest

from digenrl.config import RewardConfig
from digenrl.errors import ConfigError
from digenrl.rewards.failures import FailureBudget, RewardFailing

URL = "http://127.0.0.1:9/score"


def test_a_batch_that_fails_entirely_at_the_start_stops_at_once() -> None:
    budget = FailureBudget(["remote"], URL, max_fraction=0.5, window=4)
    with pytest.raises(RewardFailing) as info:
        budget.add(0, 64, 64, "URLError: [Errno 111] Connection refused")
    msg = str(info.value)
    assert f"reward 'remote' at {URL} failed on 64 of 64 samples of batch 0" in msg
    assert "reward.max_failure_fraction = 0.5" in msg and "reward.failure_window = 4" in msg
    assert msg.endswith("Last failure: URLError: [Errno 111] Connection refused")


def test_occasional_failures_pass_and_a_reward_that_dies_mid_run_stops_within_the_window() -> None:
    budget = FailureBudget(["color", "remote"], URL, max_fraction=0.5, window=4)
    for batch, failed in enumerate([0, 16, 0, 64, 16, 0, 0, 64, 64]):  # shares 1/4 .. 1/2 of the window
        budget.add(batch, failed, 64, "HTTP 500")
    with pytest.raises(RewardFailing, match=r"reward 'color\+remote' at .* failed on 192 of 256 samples of "
                                            r"batches 6\.\.9: .*Last failure: timeout"):
        budget.add(9, 64, 64, "timeout")


def test_the_budget_can_be_opened_or_closed() -> None:
    FailureBudget(["remote"], "", max_fraction=1.0, window=1).add(0, 64, 64)  # 1 never stops
    with pytest.raises(RewardFailing, match="reward 'color' failed on 1 of 64"):  # no URL: none named
        FailureBudget(["color"], "", max_fraction=0.0, window=1).add(0, 1, 64)
    with pytest.raises(ValueError, match="max_fraction"):
        FailureBudget(["color"], "", max_fraction=1.5, window=1)


@pytest.mark.parametrize(("key", "value", "what"), [("max_failure_fraction", 1.5, "a fraction in [0, 1]"),
                                                    ("max_failure_fraction", "half", "a fraction in [0, 1]"),
                                                    ("failure_window", 0, "an integer >= 1"),
                                                    ("failure_window", 2.5, "an integer >= 1")])
def test_config_errors_name_the_key(key: str, value: object, what: str) -> None:
    with pytest.raises(ConfigError, match=rf"reward\.{key}: must be {what.replace('[', '.').replace(']', '.')}"):
        RewardConfig(**{key: value})  # type: ignore[arg-type]
