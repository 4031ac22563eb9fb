"""The tiny default across hosts as a user starts it: ``digenrl run`` with ``placement.workers`` on one host,
one ``digenrl worker --join ... --listen tcp://ITS_ADDRESS:0 --keys KEYS`` per actor on the hosts named,
CURVE on (the README's "Several machines", Slurm form).

Workers are started one at a time, each after the driver logged the previous join, because the driver
places actors in join order (trainers first, then rollout): ``[a, b]`` puts trainer-0 on A and
rollout-0 on B.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import child_env, digenrl_command
from tests.multihost.netns import Host, Hosts, Proc

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
PORT = 5555  # each test's hosts are fresh namespaces: nothing else listens there
# A quarter of the default batch (2 fragments of 32 samples), two steps: the suite stays short.
SMALL = ("train.iterations=2", "rollout.prompts_per_batch=8", "schedule.fragment_groups=4", "schedule.train_pack=32",
         "log.image_every=0", "log.checkpoint_every=1")
# What a run computes (no timings): equal across placements of the same seed.
COMPUTED = ("reward_mean", "reward_std", "clipfrac", "approx_kl", "kl", "zero_std_ratio", "grad_norm", "policy_loss",
            "max_staleness", "rows_trained")


def wait_for(proc: Proc, text: str, timeout: float, hosts: Hosts) -> float:
    """Seconds until ``text`` is in ``proc``'s log; AssertionError with every log when it exits or times out."""
    t0 = time.monotonic()
    while text not in proc.log.read_text(errors="replace"):
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.argv[:4]} exited ({proc.popen.returncode}) before logging {text!r}:\n"
                                 f"{hosts.logs()}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"no {text!r} within {timeout:g} s:\n{hosts.logs()}")
        time.sleep(0.2)
    return time.monotonic() - t0


def start_driver(host: Host, out: Path, keys: Path, *sets: str, env: dict[str, str] | None = None) -> Proc:
    """``digenrl run`` of the tiny default on ``host``, listening on ``tcp://HOST:5555`` with CURVE keys."""
    args = ["run", str(CONFIG), "--out", str(out), "--set", f"transport.address=tcp://{host.address}:{PORT}",
            "--set", f"transport.keys='{keys}'"]
    for s in (*SMALL, *sets):
        args += ["--set", s]
    return host.start(digenrl_command(*args), f"{out.name}-driver.log", env=env or child_env())


def start_worker(host: Host, join: str, keys: Path, name: str, *extra: str,
                 env: dict[str, str] | None = None) -> Proc:
    """``digenrl worker --join`` on ``host``, listening on its veth address (its log: ``NAME.log``)."""
    return host.start(digenrl_command("worker", "--join", join, "--listen", f"tcp://{host.address}:0", "--keys",
                                      str(keys), "--name", name, *extra), f"{name}.log", env=env or child_env())


def run_placed(hosts: Hosts, driver: Host, actors: Sequence[Host], out: Path, keys: Path, *sets: str,
               envs: Sequence[dict[str, str] | None] | None = None, timeout: float = 240.0) -> list[dict]:
    """The run with its driver on ``driver`` and actor k (trainers first) on ``actors[k]``; its metrics lines."""
    proc = start_driver(driver, out, keys, f"placement.workers={len(actors)}", *sets)
    join = f"tcp://{driver.address}:{PORT}"
    wait_for(proc, "waiting up to", 120, hosts)
    workers = []
    for k, host in enumerate(actors):
        workers.append(start_worker(host, join, keys, f"{out.name}-w{k}", env=(envs or [None] * len(actors))[k]))
        wait_for(proc, f"worker {k + 1} of {len(actors)} joined", 120, hosts)
    code = proc.wait(timeout)
    assert code == 0, f"the driver exited {code}:\n{hosts.logs()}"
    for worker in workers:
        assert worker.wait(30) == 0, f"{worker.argv[:4]} exited {worker.popen.returncode}:\n{hosts.logs()}"
    return metrics(out)


class Placed:
    """Runs of the tiny default across one pair of hosts, each made once and asked for by placement.

    ``placed("a:ab", "transport.weights=gloo")``: the driver on A, actor 0 (a trainer) on A, actor 1 on B, with
    those settings. Tests that compare placements share the runs (the suite's time is the runs' start-up); each
    is made when first asked for, one at a time, in its own output directory."""

    def __init__(self, hosts: Hosts, keys: Path, root: Path) -> None:
        self.hosts, self.keys, self.root = hosts, keys, root
        self._made: dict[tuple[str, tuple[str, ...]], list[dict]] = {}

    def __call__(self, placement: str, *sets: str) -> list[dict]:
        key = (placement, sets)
        if key not in self._made:
            driver, actors = placement.split(":")
            by_name = {"a": self.hosts.a, "b": self.hosts.b}
            out = self.root / f"run{len(self._made)}-{driver}-{actors}"
            self._made[key] = run_placed(self.hosts, by_name[driver], [by_name[h] for h in actors], out, self.keys,
                                         *sets)
        return self._made[key]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def computed(lines: list[dict]) -> list[dict]:
    return [{k: m[k] for k in COMPUTED} for m in lines]


def assert_close(got: list[dict], want: list[dict], rel: float, abs_: float) -> None:
    """Every step's computed metrics within ``rel`` / ``abs_`` of the other run's."""
    assert len(got) == len(want), (got, want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=rel, abs=abs_), f"step {step}"
