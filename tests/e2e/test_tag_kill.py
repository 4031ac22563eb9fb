"""kill -9 of the only rollout actor of a TAG run on tests/e2e/_tiny.py's config (``train.adv_std = "global"``).

It once hung for good: the lone trainer held a TRAIN token waiting for the batch's advantages, which needed
fragments only that trainer could still generate (the schedule now trains a batch-wide-advantage batch only
once all of it is scored, ``batch_advantages``; tests/roles/test_lone_trainer.py is the short version).
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e._tiny import run_schedule, tiny_config
from tests.e2e.test_disaggregated import _pid_of

ROWS = 2 * 2 * 3  # prompts x group x trained steps (all but the last of 4) of one logical batch


@pytest.mark.slow  # two actor processes and a kill: ~30 s on 2 CPU cores
@pytest.mark.timeout(180)
async def test_tag_run_whose_only_rollout_actor_dies_finishes_every_step(tmp_path: Path) -> None:
    cfg = tiny_config("flow_grpo", "tag", transport={"actors": "zmq"})
    killed: list[int] = []  # the batch of the token the rollout actor was given

    def on_dispatch(device: str, token: dict) -> None:
        if not killed and device == "rollout-0" and token["kind"] == "rollout" and token["batch"] >= 1:
            pid = _pid_of("digenrl-rollout-0")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed.append(token["batch"])

    history = await run_schedule(cfg, tmp_path, on_dispatch=on_dispatch)
    assert killed == [1]
    assert [m["step"] for m in history] == [0, 1]
    assert all(m["rows_trained"] == ROWS for m in history)  # every row once: the ledger refuses a second time
    assert json.loads((tmp_path / "summary.json").read_text())["lost_devices"] == ["rollout-0"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    tids = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    batch_1 = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["batch"] == 1]
    scored = Counter(e["args"]["fragment"] for e in batch_1 if e["cat"] == "reward")
    assert scored == {0: 1, 1: 1, 2: 1, 3: 1}  # every fragment of the batch scored once: none lost or doubled
    assert {e["tid"] for e in batch_1 if e["cat"] in ("rollout", "reward")} == {tids["trainer-0"]}  # TAG
