"""A reward written in Python in whole runs of the tiny default (issue 37 item 7): the colocated loop and async1
over real actor processes train 2 steps with the example reward (examples/rewards/brightness.py), and every
step's reward is the example's score of the decoded images, recomputed here; a joined worker imports the file
only when its own command line allows it."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from digenrl.actors import ActorSystem
from digenrl.config import load_config
from digenrl.errors import RemoteError
from digenrl.roles.reward import RewardActor
from tests.conftest import child_env, digenrl_command

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-qwenimage.toml"
EXAMPLE = ROOT / "examples" / "rewards" / "brightness.py"
SMALL = ["rollout.prompts_per_batch=2", "rollout.group_size=4", "schedule.fragment_groups=1", "log.image_every=0",
         "train.iterations=2"]

# The example, scored as the run scores it, each batch's images and scores kept for this test to recompute.
RECORDING = f'''
import importlib.util, itertools, os
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("brightness_example", {str(EXAMPLE)!r})
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
_calls = itertools.count()


class RecordingBrightness(_example.Brightness):
    def __init__(self, record, target=None):
        super().__init__(target)
        self.record = Path(record)

    def score(self, images, prompts):
        scores = super().score(images, prompts)
        torch.save({{"images": images.cpu(), "scores": scores.cpu()}}, self.record / f"{{os.getpid()}}-{{next(_calls)}}.pt")
        return scores
'''


def _luminance(images: torch.Tensor) -> np.ndarray:
    """Rec. 709 luminance averaged per image, in float64 numpy (not the example's code)."""
    x = images.double().numpy()
    return (0.2126 * x[:, 0] + 0.7152 * x[:, 1] + 0.0722 * x[:, 2]).reshape(len(x), -1).mean(axis=1)


def _run(tmp_path: Path, schedule: str) -> tuple[list[dict], list[np.ndarray]]:
    """`digenrl run` of the tiny default with the recording example; its metrics and each scored batch's scores."""
    from digenrl_cli.main import app

    record = tmp_path / "record"
    record.mkdir()
    (tmp_path / "recording.py").write_text(RECORDING)
    sets = [*SMALL, f"schedule.name={schedule}", "reward.weights={brightness = 1.0}",
            f'reward.models.brightness.python="{tmp_path / "recording.py"}:RecordingBrightness"',
            f'reward.models.brightness.record="{record}"']
    res = CliRunner().invoke(app, ["run", str(TINY), "--out", str(tmp_path / "run"), *(a for s in sets for a in ("--set", s))])
    assert res.exit_code == 0, res.output
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    batches = []
    for path in sorted(record.iterdir(), key=lambda p: tuple(map(int, p.stem.split("-")))):
        kept = torch.load(path)
        np.testing.assert_allclose(kept["scores"].numpy(), _luminance(kept["images"]), atol=1e-6)  # the example's score
        batches.append(kept["scores"].double().numpy())
    return metrics, batches


def test_the_colocated_loop_trains_with_the_example_reward(tmp_path: Path) -> None:
    metrics, batches = _run(tmp_path, "colocated")
    assert [m["step"] for m in metrics] == [0, 1] and len(batches) == 2  # one scoring call per iteration
    for m, scores in zip(metrics, batches, strict=True):
        assert len(scores) == 8
        assert m["reward_mean"] == pytest.approx(scores.mean(), abs=1e-6)
        assert m["reward/brightness"] == pytest.approx(scores.mean(), abs=1e-6)
        assert "reward/shapes" not in m  # the shipped config's own reward is gone


@pytest.mark.slow  # real actor processes: ~40 s here
def test_async1_actor_processes_train_with_the_example_reward(tmp_path: Path) -> None:
    metrics, batches = _run(tmp_path, "async1")
    assert [m["step"] for m in metrics] == [0, 1]
    # The actor processes scored fragments in their own order: some split of them is each step's batch.
    scores = [s for s in batches if len(s)]
    assert sum(map(len, scores)) == 16
    splits = [set(c) for k in range(1, len(scores)) for c in itertools.combinations(range(len(scores)), k)]
    matching = [c for c in splits
                if sum(len(scores[i]) for i in c) == 8
                and np.concatenate([scores[i] for i in c]).mean() == pytest.approx(metrics[0]["reward_mean"], abs=1e-6)
                and np.concatenate([scores[i] for i in range(len(scores)) if i not in c]).mean()
                == pytest.approx(metrics[1]["reward_mean"], abs=1e-6)]
    assert matching, (metrics, batches)
    assert all("reward/brightness" in m and "reward/shapes" not in m for m in metrics)


@pytest.mark.slow  # two worker processes: ~30 s here
async def test_a_joined_worker_imports_a_reward_file_only_when_its_command_line_allows_it(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    path = tmp_path / "mine.py"
    path.write_text(f"open({str(marker)!r}, 'a').write('x')\n\n\nclass Mine:\n    def score(self, images, prompts):\n"
                    "        return images.mean((1, 2, 3))\n")
    cfg = load_config(TINY, ["schedule.name=async1", "reward.weights={mine = 1.0}",
                             f'reward.models.mine.python="{path}:Mine"', "transport.address=tcp://127.0.0.1:0"])
    async with ActorSystem(address=cfg.transport.address, heartbeat_interval=0.2, heartbeat_timeout=30.0) as system:
        procs = [await asyncio.create_subprocess_exec(
            *digenrl_command("worker", "--join", system.address, "--name", name, *allow), env=child_env(),
            stdin=subprocess.DEVNULL, cwd=tmp_path)
            for name, allow in (("plain", []), ("allows", ["--allow-reward", f"{path}:Mine"]))]
        try:
            workers = {w.name: w for w in await system.wait_for_workers(2, timeout=120)}
            # The spawn message names the file; the plain worker refuses before running a line of it.
            with pytest.raises(RemoteError, match=r"reward\.models\.mine\.python: this process was not started with "
                                                  r".*mine\.py:Mine, so it does not import it"):
                await system.spawn(RewardActor, cfg.to_dict(), 1, name="reward-plain", on=workers["plain"])
            assert not marker.exists()
            await system.spawn(RewardActor, cfg.to_dict(), 1, name="reward-allows", on=workers["allows"])
            assert marker.read_text() == "x"  # imported once, by the worker whose command line allows it
        finally:
            for proc in procs:
                if proc.returncode is None and system.node is None:
                    proc.kill()
    for proc in procs:
        assert await asyncio.wait_for(proc.wait(), 30) == 0  # both let go when the system closed
