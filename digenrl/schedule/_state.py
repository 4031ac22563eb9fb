"""Per-batch bookkeeping shared by the schedules: fragments, group assembly, the train queue.

Everything here is O(1) or O(work handed out) per call: fragments sit in deques, group completion
is a counter per prompt chunk, and training rows are carved off the front of a deque of
``[fragment, start, end]`` segments.
"""

from __future__ import annotations

import enum
import math
from collections import deque

from digenrl.schedule.base import Fragment, Workload

__all__ = ["FragState", "FragInfo", "BatchState"]

Part = tuple[int, int, int]  # (fragment index, row start, row end)


class FragState(enum.IntEnum):
    UNSTARTED = 0
    READY = 1  # some steps done, latents on ``holder``, waiting for the next step range
    RUNNING = 2  # a ROLLOUT token is running it
    AWAIT_REWARD = 3  # all steps done, latents on ``holder``, waiting for a REWARD token
    REWARDING = 4
    SCORED = 5  # durable; trainable once its prompt groups are complete


class FragInfo:
    """Mutable state of one fragment. ``epoch`` bumps on every restart so queued entries go stale."""

    __slots__ = ("geo", "state", "version", "step", "dispatched", "holder", "epoch")

    def __init__(self, geo: Fragment) -> None:
        self.geo = geo
        self.state = FragState.UNSTARTED
        self.version: int = -1
        self.step = 0  # steps completed
        self.dispatched = 0  # steps handed out (completed or running)
        self.holder = ""  # device holding its latest latents
        self.epoch = 0


class BatchState:
    """One logical batch: its fragments, which are scored, which rows are trained."""

    def __init__(self, k: int, workload: Workload, groups: int, members: int, gap: bool) -> None:
        w = workload
        self.k = k
        self.gap = gap
        self.trained_steps = w.trained_steps
        self.n_pc = math.ceil(w.prompts_per_batch / groups)
        self.n_mc = math.ceil(w.group_size / members)
        self.frags: list[FragInfo] = []
        for pc in range(self.n_pc):
            p0, p1 = pc * groups, min(w.prompts_per_batch, (pc + 1) * groups)
            for mc in range(self.n_mc):
                m0, m1 = mc * members, min(w.group_size, (mc + 1) * members)
                geo = Fragment(k, len(self.frags), p0, p1, m0, m1, w.group_size)
                self.frags.append(FragInfo(geo))
        self.unstarted: deque[int] = deque(range(len(self.frags)))
        self.scored_in_pc = [0] * self.n_pc
        self.pcs_done = 0
        self.n_scored = 0
        self.sample_steps_left = w.samples_per_batch * w.num_steps  # not yet handed out
        self.sample_steps_undone = self.sample_steps_left  # not yet completed (running ones included)
        self.rows_total = w.rows_per_batch
        self.rows_done = 0
        self.rows_queued = 0  # trainable, not yet handed out
        self.train_queue: deque[list[int]] = deque()  # [fragment, start, end]
        self.trained_by: dict[str, list[Part]] = {}  # trainer -> parts whose gradients it holds

    # -- group assembly ------------------------------------------------------------------------
    def score(self, f: int) -> None:
        """Mark fragment ``f`` scored; queue rows that became trainable (complete prompt groups)."""
        info = self.frags[f]
        info.state = FragState.SCORED
        self.n_scored += 1
        pc = f // self.n_mc
        self.scored_in_pc[pc] += 1
        if self.scored_in_pc[pc] < self.n_mc:
            return  # advantages need every member of these prompts' groups
        self.pcs_done += 1
        if self.gap:
            self._queue_chunk(pc)
        elif self.pcs_done == self.n_pc:
            for chunk in range(self.n_pc):  # full-batch barrier: everything at once
                self._queue_chunk(chunk)

    def _queue_chunk(self, pc: int) -> None:
        for f in range(pc * self.n_mc, (pc + 1) * self.n_mc):
            rows = self.frags[f].geo.num_samples * self.trained_steps
            self.train_queue.append([f, 0, rows])
            self.rows_queued += rows

    @property
    def all_scored(self) -> bool:
        return self.n_scored == len(self.frags)

    # -- training rows -------------------------------------------------------------------------
    def carve(self, limit: int, whole_samples: bool) -> list[Part]:
        """Take up to ``limit`` rows off the train queue, never mixing policy versions.

        With ``whole_samples`` the cut falls on sample boundaries (every trained step of a sample
        in one token: the per-timestep loop without TSP).
        """
        parts: list[Part] = []
        version = -1
        left = max(limit, 1)
        t = self.trained_steps
        queue = self.train_queue
        while queue and left > 0:
            seg = queue[0]
            f, start, end = seg
            v = self.frags[f].version
            if parts and v != version:
                break
            version = v
            take = min(end - start, left)
            if whole_samples and take < end - start:
                take = max(t, take - take % t) if not parts else take - take % t
                if take <= 0:
                    break
            parts.append((f, start, start + take))
            left -= take
            self.rows_queued -= take
            if start + take == end:
                queue.popleft()
            else:
                seg[1] = start + take
        return parts

    def requeue(self, parts: list[Part]) -> None:
        """Put rows back at the front (their gradients were lost with a dead trainer)."""
        for f, start, end in reversed(parts):
            self.train_queue.appendleft([f, start, end])
            self.rows_queued += end - start

    def trained(self, device: str, parts: list[Part]) -> None:
        self.trained_by.setdefault(device, []).extend(parts)
        self.rows_done += sum(end - start for _, start, end in parts)

    def lose_trainer(self, device: str) -> None:
        """A trainer died: the rows it accumulated gradients for must be trained again."""
        parts = self.trained_by.pop(device, [])
        self.rows_done -= sum(end - start for _, start, end in parts)
        self.requeue(parts)

    @property
    def fully_trained(self) -> bool:
        return self.rows_done == self.rows_total

    def restart(self, f: int, front: bool = True) -> None:
        """Fragment ``f`` lost its latents: generate it again from noise (any version allowed)."""
        info = self.frags[f]
        self.sample_steps_left += info.geo.num_samples * info.dispatched
        self.sample_steps_undone += info.geo.num_samples * info.step
        info.epoch += 1
        info.state = FragState.UNSTARTED
        info.version = -1
        info.step = info.dispatched = 0
        info.holder = ""
        if front:
            self.unstarted.appendleft(f)
        else:
            self.unstarted.append(f)
