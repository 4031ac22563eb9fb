"""Issue 37: a run never overwrites another, says what it does outside a terminal, and stops in order on SIGINT
and SIGTERM. Every test runs the real CLI in a process of its own, with stdout and stderr pipes as under Slurm."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from digenrl.errors import ConfigError
from digenrl.recipes.outputs import claim_out_dir
from digenrl.roles.stop import StopRequest
from tests.conftest import ROOT, child_env, digenrl_command

TINY = "configs/tiny-qwenimage.toml"
SMALL = ["--set", "rollout.prompts_per_batch=8", "--set", "log.image_every=0", "--set", "train.iterations=500"]
STEP_LINE = re.compile(r"^step (\d+)/500 reward \d\.\d{4} \+- \d\.\d{4} \| [\d.]+ samples/s \| parity \S+ "
                       r"\(max \|dlogp\| \S+\) \| bubbles overall \d+%.* \| staleness \d \| [\d.]+ s$")


def _earlier_run(out: Path) -> None:
    """What an 8-step run leaves: metrics, a checkpoint that latest names (and a log that is not the run's)."""
    ckpt = out / "checkpoints" / "step-000008"
    ckpt.mkdir(parents=True)
    for name in ("trainable.safetensors", "optimizer.pt", "coordinator.json"):
        (ckpt / name).write_text("{}")
    (out / "checkpoints" / "latest").write_text("step-000008\n")
    (out / "checkpoints" / "step-000007").mkdir()  # a checkpoint cut short
    (out / "metrics.jsonl").write_text("{}\n" * 8)
    (out / "slurm-1.out").write_text("not a run's")


@pytest.mark.parametrize("args, shown", [
    (["--out", "{out}"], "config error: --out {out} holds an earlier run (metrics.jsonl, checkpoints/); continue it "
                         "with --resume {out}, replace it with --overwrite, or choose another --out"),
    (["--resume", "{out}", "--overwrite"], "config error: --overwrite with --resume {out}: it would delete"),
    (["--resume", "{out}/nope"], "config error: --resume '{out}/nope': no such file or directory"),
    (["--resume", "{out}/checkpoints/step-000007"], "is incomplete, missing ['trainable.safetensors'"),
    (["--resume", "{plain}"], "config error: --resume '{plain}': not a run directory"),
])
def test_what_run_refuses_it_says_in_one_line_before_building_anything(tmp_path: Path, args: list[str],
                                                                      shown: str) -> None:
    out, plain = tmp_path / "coloc_copy", tmp_path / "notes"
    _earlier_run(out)
    plain.mkdir()
    fill = {"out": str(out), "plain": str(plain)}
    t0 = time.monotonic()
    proc = subprocess.run([*digenrl_command("run", TINY, *(a.format(**fill) for a in args)), *SMALL], cwd=ROOT,
                          env=child_env(COLUMNS="400"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [next(ln for ln in proc.stderr.splitlines() if ln)], proc.stderr
    assert shown.format(**fill) in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 60  # no model built, no checkpoint read past its name (was 16-25 s later)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 8 and (out / "checkpoints/step-000008").is_dir()


def test_overwrite_removes_the_earlier_runs_outputs_and_nothing_else(tmp_path: Path) -> None:
    _earlier_run(tmp_path)
    with pytest.raises(ConfigError, match="holds an earlier run"):
        claim_out_dir(tmp_path)
    claim_out_dir(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slurm-1.out"]
    claim_out_dir(tmp_path)  # nothing of a run left: taken as it is


def test_sigterm_waits_for_the_step_boundary_and_sigint_does_not() -> None:
    stop = StopRequest(grace=60.0)
    stop.request(signal.SIGTERM)
    assert stop.requested and stop.checkpoint_due and not stop.now
    with stop.interruptible():  # the step under way goes on
        pass
    stop.request(signal.SIGINT)  # a Ctrl-C while it waits: at once
    assert stop.now and not stop.checkpoint_due and stop.signum == signal.SIGTERM
    with pytest.raises(stop.stopped()), stop.interruptible():
        pass
    late = StopRequest(grace=0.05)
    late.request(signal.SIGTERM)
    time.sleep(0.1)
    assert late.now and not late.checkpoint_due  # the grace is spent: no boundary to wait for


class _Run:
    """``digenrl run`` with stdout and stderr pipes (not a terminal), read line by line as it goes."""

    def __init__(self, out: Path, *overrides: str, group: bool = False) -> None:
        sets = [a for o in overrides for a in ("--set", o)]
        self.command = [*digenrl_command("run", TINY, "--out", str(out), *SMALL, *sets)]
        # start_new_session: a group of its own to signal as a terminal does (os.killpg); SIGINT as at a terminal
        # even where this test runs as a background job (SIG_IGN would be inherited).
        self.proc = subprocess.Popen(self.command, cwd=ROOT, env=child_env(COLUMNS="400"), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=group,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.group = group
        self.lines: list[tuple[float, str]] = []
        self.err: list[str] = []
        self._new = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr or []), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or []:
            with self._new:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._new.notify_all()
        with self._new:
            self._new.notify_all()

    def wait_for_steps(self, n: int, timeout: float = 150.0) -> None:
        with self._new:
            ok = self._new.wait_for(lambda: len(self.lines) >= n or self.proc.poll() is not None, timeout)
        assert ok and len(self.lines) >= n, (self.lines, "".join(self.err)[-3000:])
        assert self.proc.poll() is None, "the lines came only at the end"

    def signal(self, sig: signal.Signals, group: bool = False) -> tuple[int, str]:
        (os.killpg if group else os.kill)(self.proc.pid, sig)
        code = self.proc.wait(timeout=150)
        time.sleep(0.2)  # the readers' last lines
        return code, "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            (os.killpg if self.group else os.kill)(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _stopped(err: str, code: int, sig: signal.Signals, out: Path, step: int, command: list[str]) -> None:
    """The one line a signal leaves, its exit code, and the run's artifacts."""
    assert code == 128 + sig, err[-3000:]
    sets = " ".join(command[command.index(TINY) + 1:]).replace(f"--out {out} ", "")
    assert (f"interrupted at step {step}; last checkpoint step-{step:06d}; resume with: digenrl run {TINY} {sets} "
            f"--resume {out}") in err, err[-3000:]
    assert not [ln for ln in err.splitlines() if ln.startswith(("ERROR", "WARNING", "Traceback"))], err[-3000:]
    assert all((out / name).is_file() for name in ("summary.json", "trace.json", "gantt.png", "metrics.jsonl"))
    assert len((out / "metrics.jsonl").read_text().splitlines()) == step
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{step:06d}"
    assert json.loads((out / "checkpoints" / f"step-{step:06d}" / "coordinator.json").read_text())["version"] == step


def test_outside_a_terminal_each_step_is_a_line_and_sigterm_checkpoints_the_next_step(tmp_path: Path) -> None:
    """Colocated, no checkpoint due for 100 steps: the one SIGTERM wrote is at the step after the signal."""
    run = _Run(tmp_path, "schedule.name=colocated", "log.checkpoint_every=100", "placement.threads=1")
    try:
        run.wait_for_steps(1)
        code, err = run.signal(signal.SIGTERM)
    finally:
        run.kill()
    lines = [line for _, line in run.lines]
    assert all(STEP_LINE.match(line) for line in lines), lines
    steps = [int(m.group(1)) for m in map(STEP_LINE.match, lines) if m]
    assert steps == list(range(1, len(lines) + 1))  # one line per step, each as it ends
    assert f"digenrl run: colocated, 500 steps; outputs in {tmp_path}\n" in err, err[:500]
    _stopped(err, code, signal.SIGTERM, tmp_path, len(lines), run.command)


@pytest.mark.slow
def test_ctrl_c_of_an_actor_run_stops_it_in_order(tmp_path: Path) -> None:
    """SIGINT to the whole process group, as a terminal sends it: the actors leave it to the driver."""
    run = _Run(tmp_path, "log.checkpoint_every=1", "schedule.fragment_groups=4", "schedule.train_pack=32", group=True)
    try:
        run.wait_for_steps(2)
        code, err = run.signal(signal.SIGINT, group=True)
    finally:
        run.kill()
    _stopped(err, code, signal.SIGINT, tmp_path, len(run.lines), run.command)


@pytest.mark.slow
def test_scancel_of_an_actor_run_checkpoints_the_next_step_and_stops(tmp_path: Path) -> None:
    """SIGTERM to every process, as Slurm sends it: the actors keep working until the driver's checkpoint."""
    run = _Run(tmp_path, "log.checkpoint_every=100", "schedule.fragment_groups=4", "schedule.train_pack=32",
               group=True)
    try:
        run.wait_for_steps(1)
        code, err = run.signal(signal.SIGTERM, group=True)
    finally:
        run.kill()
    assert len(run.lines) >= 2  # the step after the signal, checkpointed
    _stopped(err, code, signal.SIGTERM, tmp_path, len(run.lines), run.command)
    assert (tmp_path / "checkpoints" / f"step-{len(run.lines):06d}" / "previous.safetensors").is_file()
