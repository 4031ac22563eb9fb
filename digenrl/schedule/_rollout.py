"""Rollout side of the disaggregated schedule: READY buckets, picking work, ROLLOUT/REWARD tokens.

A mixin of ``DisaggregatedSchedule`` (one idea per module: this one is "which fragments run where
next"). READY fragments wait in buckets keyed ``(version, batch, step)`` with one heap per version
ordered by ``(batch, -step)``: older batches and further-advanced fragments go first, so a rollout
device works depth-first and whole prompt groups complete as early as possible (group-major), which
is what lets GAP stream them to the trainers. A ROLLOUT token takes one bucket's fragments up to the
device's sample budget (step-level batching only at the same step).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING

from digenrl.schedule._state import BatchState, FragInfo, FragState
from digenrl.schedule.base import Role, Token, TokenKind

if TYPE_CHECKING:
    from digenrl.schedule.base import Workload
    from digenrl.schedule.cost import SpeedTracker
    from digenrl.schedule.options import ResolvedSizes, ScheduleOptions

__all__ = ["RolloutMixin", "Entry"]

Entry = tuple[int, int]  # (fragment index, epoch)


class RolloutMixin:
    """Rollout and reward dispatch; state lives in ``DisaggregatedSchedule``."""

    w: Workload
    opt: ScheduleOptions
    sizes: ResolvedSizes
    version: int
    published: int
    _prev_published: int
    _opened: int
    _speed: SpeedTracker
    _batches: dict[int, BatchState]
    _buckets: dict[tuple[int, int, int], deque[Entry]]
    _heaps: dict[int, list[tuple[int, int]]]
    _in_heap: set[tuple[int, int, int]]
    _idle: dict[Role, dict[str, None]]
    _alive: dict[Role, dict[str, None]]
    _role: dict[str, Role]
    _running: dict[str, Token]
    _held: dict[str, set[tuple[int, int]]]
    _reward_queue: deque[tuple[int, int, int]]
    _local_reward: dict[str, deque[tuple[int, int, int]]]
    _next_id: int
    _helping: set[str]

    if TYPE_CHECKING:
        def _token(self, kind: TokenKind, device: str, batch: int, **fields: object) -> Token: ...

    def _push_ready(self, b: int, f: int) -> None:
        info = self._batches[b].frags[f]
        key = (info.version, b, info.step)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = deque()
        bucket.append((f, info.epoch))
        if key not in self._in_heap:
            self._in_heap.add(key)
            heapq.heappush(self._heaps.setdefault(info.version, []), (b, -info.step))

    def _bucket_top(self, version: int) -> tuple[int, int] | None:
        """Best (batch, -step) with a live READY fragment at ``version``; drops stale entries."""
        heap = self._heaps.get(version)
        while heap:
            b, neg = heap[0]
            key = (version, b, -neg)
            bucket = self._buckets.get(key)
            batch = self._batches.get(b)
            while bucket and (batch is None or not self._live(batch, bucket[0], FragState.READY)):
                bucket.popleft()
            if bucket:
                return b, neg
            heapq.heappop(heap)
            self._in_heap.discard(key)
            self._buckets.pop(key, None)
        return None

    @staticmethod
    def _live(batch: BatchState, entry: Entry, state: FragState) -> bool:
        info = batch.frags[entry[0]]
        return info.epoch == entry[1] and info.state is state

    @property
    def _first_version(self) -> int:
        """The oldest version of the run: -1 after a one-step-stale resume (``previous_version``), else 0."""
        return -1 if self.opt.previous_version else 0

    def _unstarted_batch(self, version: int, only: int | None = None) -> int | None:
        """Lowest open batch with unstarted fragments that start with ``version``.

        Batch ``b`` starts with version ``max(first, b - staleness)`` (``first``: see
        ``_first_version``). Versions are then a function of the
        batch, not of timing: a run is reproducible and resumes exactly. Only with no rollout device
        left (they keep the older version) does a trainer start batches ``V..V + staleness`` at ``V``.
        """
        s = self.opt.staleness
        if self._alive[Role.ROLLOUT]:
            lo, hi = (0 if version == self._first_version else version + s), version + s
        else:
            lo, hi = version, version + s
        hi = min(self._opened, hi)
        if only is not None:
            lo = hi = only if lo <= only <= hi else -1
        for b in range(max(lo, self.version), hi + 1):
            batch = self._batches.get(b)
            if batch is not None and batch.unstarted:
                return b
        return None


    def _issue_reward(self, name: str, queue: deque[tuple[int, int, int]], out: list[Token]) -> None:
        picked: list[tuple[int, int]] = []
        samples = 0
        while queue and (not picked or samples < self.sizes.rollout_batch):
            b, f, epoch = queue[0]
            batch = self._batches.get(b)
            if batch is None or not self._live(batch, (f, epoch), FragState.AWAIT_REWARD):
                queue.popleft()
                continue
            if picked and b != picked[0][0]:
                break
            queue.popleft()
            picked.append((b, f))
            samples += batch.frags[f].geo.num_samples
        if not picked:
            return
        batch = self._batches[picked[0][0]]
        infos = [batch.frags[f] for _, f in picked]
        for info in infos:
            info.state = FragState.REWARDING
        if self._role[name] is Role.TRAINER:
            self._helping.add(name)  # scoring on a trainer needs the rollout-side (decoder) state too
        out.append(self._token(TokenKind.REWARD, name, batch.k, fragment=infos[0].geo.index, num_samples=samples,
                               policy_version=infos[0].version, fragments=tuple(i.geo for i in infos),
                               sources=tuple(i.holder for i in infos), helper=self._role[name] is Role.TRAINER))

    def _dispatch_rollout(self, out: list[Token]) -> None:
        idle = self._idle[Role.ROLLOUT]
        versions = (self.published, self._prev_published)
        while idle:
            pick = self._pick(versions)
            if pick is None:
                return
            name = next(iter(idle))
            cap = round(self.sizes.rollout_batch * self._speed.relative_speed(name, TokenKind.ROLLOUT))
            out.append(self._rollout_token(name, pick, cap, self.sizes.step_chunk, helper=False))

    def _pick(self, versions: tuple[int, ...], only: int | None = None) -> tuple[int, int, int] | None:
        """Best rollout work as ``(version, batch, step)``; step ``-1`` means unstarted fragments."""
        best: tuple[int, int, int] | None = None
        best_key: tuple[int, int] | None = None
        for v in dict.fromkeys(versions):
            top = self._bucket_top(v)
            if top is not None and (only is None or top[0] == only) and (best_key is None or top < best_key):
                best, best_key = (v, top[0], -top[1]), top
        for v in dict.fromkeys(versions):
            b = self._unstarted_batch(v, only)
            if b is not None and (best_key is None or (b, 0) < best_key):
                best, best_key = (v, b, -1), (b, 0)
        return best

    def _rollout_token(self, name: str, pick: tuple[int, int, int], cap: int, chunk: int, helper: bool) -> Token:
        version, b, step = pick
        batch = self._batches[b]
        chosen: list[FragInfo] = []
        samples = 0
        if step < 0:  # unstarted: this token fixes their version for the whole trajectory
            step = 0
            while batch.unstarted and (not chosen or samples + batch.frags[batch.unstarted[0]].geo.num_samples <= cap):
                info = batch.frags[batch.unstarted.popleft()]
                info.version = version
                chosen.append(info)
                samples += info.geo.num_samples
        else:
            bucket = self._buckets[(version, b, step)]
            while bucket:
                if not self._live(batch, bucket[0], FragState.READY):
                    bucket.popleft()
                    continue
                info = batch.frags[bucket[0][0]]
                if chosen and samples + info.geo.num_samples > cap:
                    break
                bucket.popleft()
                chosen.append(info)
                samples += info.geo.num_samples
        end = min(self.w.num_steps, step + chunk)
        sources = []
        for info in chosen:
            sources.append(info.holder)
            if info.holder:
                self._held[info.holder].discard((b, info.geo.index))
            info.state = FragState.RUNNING
            info.dispatched = end
        batch.sample_steps_left -= samples * (end - step)
        return self._token(TokenKind.ROLLOUT, name, b, fragment=chosen[0].geo.index, num_samples=samples,
                           step_start=step, step_end=end, policy_version=version,
                           fragments=tuple(i.geo for i in chosen), sources=tuple(sources), helper=helper)

    def _undo_rollout(self, token: Token) -> None:
        """Take back a token that was built but not issued (TAG said no)."""
        self._next_id -= 1
        del self._running[token.device]
        self._idle[Role.TRAINER][token.device] = None
        batch = self._batches[token.batch]
        batch.sample_steps_left += token.num_samples * (token.step_end - token.step_start)
        for geo, source in zip(reversed(token.fragments), reversed(token.sources)):
            info = batch.frags[geo.index]
            info.dispatched = token.step_start
            if token.step_start == 0:
                info.state, info.version = FragState.UNSTARTED, -1
                batch.unstarted.appendleft(geo.index)
            else:
                info.state = FragState.READY
                self._held[source].add((batch.k, geo.index))
                key = (token.policy_version, batch.k, token.step_start)
                self._buckets.setdefault(key, deque()).appendleft((geo.index, info.epoch))
                if key not in self._in_heap:
                    self._in_heap.add(key)
                    heapq.heappush(self._heaps.setdefault(token.policy_version, []), (batch.k, -token.step_start))

    def _rollout_done(self, token: Token) -> None:
        batch = self._batches[token.batch]
        name = token.device
        finished = []
        batch.sample_steps_undone -= token.num_samples * (token.step_end - token.step_start)
        for geo in token.fragments:
            info = batch.frags[geo.index]
            info.step = token.step_end
            info.holder = name
            self._held.setdefault(name, set()).add((batch.k, geo.index))
            if info.step < self.w.num_steps:
                info.state = FragState.READY
                self._push_ready(batch.k, geo.index)
            else:
                info.state = FragState.AWAIT_REWARD
                finished.append((batch.k, geo.index, info.epoch))
        if finished:
            if self._alive[Role.REWARD]:
                self._reward_queue.extend(finished)
            else:
                self._local_reward.setdefault(name, deque()).extend(finished)
