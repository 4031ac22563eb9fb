"""An orderly stop on SIGINT and SIGTERM, for the colocated loop and the coordinator alike.

State machine of one run's :class:`StopRequest`::

    RUNNING ──SIGINT────────────────────────────▶ NOW          stop where it is (the step under way is lost)
       │                                           ▲
       └──SIGTERM──▶ DRAINING ──step boundary──────┼──▶ STOP   a checkpoint of that step, then stop
                        └──grace spent, SIGINT, ───┘
                           or SIGTERM again

SIGTERM is what ``scancel``, a Slurm preemption and Kubernetes send, with SIGKILL some seconds
later: the run finishes the step under way (for up to ``log.term_grace`` seconds), writes a
checkpoint there and stops. Either way the run's own artifacts (``summary.json``, ``trace.json``,
``gantt.png``) are written and :class:`RunInterrupted` says where to resume; the CLI exits 130
(SIGINT) or 143 (SIGTERM), as a shell reports those signals.

Who waits on it: the colocated loop checks it between iterations (and is interrupted inside one:
:meth:`StopRequest.interruptible`); the coordinator checks it at every turn of its loop and writes
the boundary's checkpoint in its OPTIM token. Before and after those loops (the actors' start, the
artifacts) :func:`stop_scope` cancels the run's task instead, and turns that cancellation into
:class:`RunInterrupted`, as ``asyncio.timeout`` turns its own into ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import FrameType

from digenrl.errors import DigenrlError

__all__ = ["RunInterrupted", "StopRequest", "on_signals", "stop_scope", "latest_checkpoint"]

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(DigenrlError):
    """The run stopped on a signal, in order; ``step`` optimizer steps are done.

    Attributes:
        signum: the first signal (``signal.SIGINT`` or ``signal.SIGTERM``).
        step: optimizer steps done when it stopped (the resumed run continues from the checkpoint).
        checkpoint: the newest complete checkpoint of the run directory, or ``None``.
        out: the run directory (``None``: a run that writes no files).
        exit_code: ``128 + signum`` (130, 143), what a shell reports for a process those signals ended.
    """

    def __init__(self, signum: int, step: int, checkpoint: Path | None = None, out: Path | None = None) -> None:
        where = f"last checkpoint {checkpoint.name}" if checkpoint is not None else "no checkpoint yet"
        super().__init__(f"interrupted at step {step}; {where}")
        self.signum, self.step, self.checkpoint, self.out = signum, step, checkpoint, out
        self.exit_code = 128 + signum

    def at(self, step: int, out: Path | None) -> RunInterrupted:
        """The same stop after ``step`` steps, with the run directory and its newest checkpoint filled in."""
        return RunInterrupted(self.signum, step, latest_checkpoint(out) if out is not None else None, out)


def latest_checkpoint(out: Path) -> Path | None:
    """The complete checkpoint ``out/checkpoints/latest`` names, or ``None``."""
    pointer = out / "checkpoints" / "latest"
    try:
        ckpt = out / "checkpoints" / pointer.read_text().strip()
    except OSError:
        return None
    return ckpt if ckpt.is_dir() else None


class _StopNow(BaseException):
    """Raised inside :meth:`StopRequest.interruptible` when the run must stop at once (a BaseException, as
    KeyboardInterrupt is, so that no ``except Exception`` of the step swallows it)."""


class StopRequest:
    """What the signals asked of one run (see the module docstring).

    Args:
        grace: ``log.term_grace``: seconds SIGTERM waits for the step boundary (0: stop at once).
    """

    def __init__(self, grace: float = 60.0) -> None:
        self.grace = grace
        self.signum: int | None = None  # the first signal
        self.deadline: float | None = None  # time.monotonic() by which SIGTERM's boundary must come
        self._now = False
        self._window = 0  # > 0 while the colocated loop may be interrupted mid-step
        self.on_now: Callable[[], None] | None = None  # what stops the run at once (stop_scope: cancel its task)

    @property
    def requested(self) -> bool:
        """A signal came: the run stops at the next boundary at the latest."""
        return self.signum is not None

    @property
    def now(self) -> bool:
        """The run stops where it is: SIGINT, a second signal, or SIGTERM's grace spent."""
        if not self._now and self.deadline is not None and time.monotonic() >= self.deadline:
            self._now = True
        return self._now

    @property
    def checkpoint_due(self) -> bool:
        """SIGTERM, within its grace: the next step boundary writes a checkpoint."""
        return self.signum == signal.SIGTERM and not self.now

    def request(self, signum: int) -> None:
        """A signal arrived (the handlers call this; a test may too)."""
        first = self.signum is None
        if first:
            self.signum = signum
        if signum == signal.SIGTERM and first and self.grace > 0:
            self.deadline = time.monotonic() + self.grace
            log.info("[shutdown] run: step=signal SIGTERM: stopping after this step's checkpoint "
                     "(log.term_grace = %g s)", self.grace)
        else:
            self.expire()

    def expire(self) -> None:
        """Stop at once (SIGINT, a second signal, or the grace is over)."""
        if self._now:
            return
        self._now = True
        if self._window:
            raise _StopNow
        if self.on_now is not None:
            self.on_now()

    @contextlib.contextmanager
    def polled(self) -> Iterator[None]:
        """A loop that reads :attr:`now` at every turn runs (the coordinator's): stopping at once is left to it."""
        saved, self.on_now = self.on_now, None
        try:
            yield
        finally:
            self.on_now = saved

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A stretch the synchronous loop may leave at once (a step's compute; never a file being written).

        Raises:
            _StopNow: leaving it (caught by :func:`on_signals`' caller through :meth:`stopped`).
        """
        if self.now:
            raise _StopNow
        self._window += 1
        try:
            yield
        finally:
            self._window -= 1

    @staticmethod
    def stopped() -> type[BaseException]:
        """The exception :meth:`interruptible` raises, for the loop that catches it."""
        return _StopNow


def _install(handler: Callable[[int, FrameType | None], None]) -> dict[int, object]:
    """Our handler for SIGINT and SIGTERM; returns the previous ones. A SIGINT ignored when the run
    started (a background job of a script) stays ignored, as Python leaves it."""
    previous: dict[int, object] = {}
    for sig in SIGNALS:
        if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, handler)
    return previous


@contextlib.contextmanager
def on_signals(stop: StopRequest) -> Iterator[StopRequest]:
    """SIGINT and SIGTERM feed ``stop`` while the synchronous loop runs (the main thread only; elsewhere,
    e.g. a benchmark's worker thread, the signals keep their handlers). SIGTERM's grace is a SIGALRM, taken
    only once a SIGTERM came (pytest-timeout, for one, keeps its own until then)."""
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    alarm: list[object] = []  # the SIGALRM handler we replaced, once we did

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.now:  # a further signal while stopping: the default, so it can still be forced
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        stop.request(signum)
        if stop.deadline is not None and not stop.now and not alarm:
            alarm.append(signal.signal(signal.SIGALRM, lambda *_: stop.expire()))
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, stop.deadline - time.monotonic()))

    previous = _install(handler)
    try:
        yield stop
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, alarm[0])  # type: ignore[arg-type]
        for sig, old in previous.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def stop_scope(stop: StopRequest) -> AsyncIterator[StopRequest]:
    """SIGINT and SIGTERM feed ``stop`` while the body runs on this event loop.

    While no loop polls ``stop`` (``stop.on_now`` is this scope's), stopping at once cancels the body's task; the
    scope turns that cancellation, and only that one, into :class:`RunInterrupted` (step 0: the caller fills
    in the real one). Any other cancellation passes through.

    Raises:
        RunInterrupted: the body was cancelled by a signal.
    """
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    cancelled = False
    timer: asyncio.TimerHandle | None = None

    def cancel() -> None:
        nonlocal cancelled
        if not cancelled:
            cancelled = True
            task.cancel()

    def handler(signum: int) -> None:
        nonlocal timer
        if stop.now:  # again while stopping: the next one gets the handler from before (asyncio's: cancel)
            log.warning("[shutdown] run: step=signal %s again while stopping; send it once more to abort at once",
                        signal.Signals(signum).name)
            for num, before in installed.items():
                with contextlib.suppress(ValueError, RuntimeError):
                    if loop.remove_signal_handler(num) and before is not None:
                        signal.signal(num, before)  # type: ignore[arg-type]
            return
        stop.request(signum)
        if stop.deadline is not None and not stop.now and timer is None:
            timer = loop.call_later(max(0.0, stop.deadline - time.monotonic()), stop.expire)

    stop.on_now = cancel
    installed: dict[int, object] = {}  # signal -> the Python handler before ours (asyncio.Runner's, a caller's)
    for sig in SIGNALS:
        before = signal.getsignal(sig)
        if sig == signal.SIGINT and before is signal.SIG_IGN:
            continue
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(sig, handler, sig)
            installed[sig] = before
    try:
        yield stop
    except asyncio.CancelledError:
        if cancelled and task.uncancel() == 0:
            raise RunInterrupted(stop.signum or signal.SIGINT, 0) from None
        raise
    finally:
        if timer is not None:
            timer.cancel()
        stop.on_now = None
        for num, old in installed.items():
            with contextlib.suppress(ValueError, RuntimeError):
                if loop.remove_signal_handler(num) and old is not None:
                    signal.signal(num, old)  # type: ignore[arg-type]
