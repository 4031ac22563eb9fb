"""Schedule switches: one frozen dataclass, one preset per schedule name.

Every technique is a separate switch, so each can be measured alone and in combination. The named
schedules stack them in the order the paper introduces them::

    colocated      every device samples its share, switches, trains its share (hybrid engine)
    colocated-tsp  the same hybrid devices, training TSP-packed: digenrl's own colocated loop on actors
    disaggregated  rollout and trainer devices apart, full-batch barrier (naive split)
    gap            + generation-axis pipeline: fragments stream to trainers once their groups complete
    tsp            + time-step parallelism: packed train rows, step-range rollout tokens, step batching
    tag            + trainer-assisted generation where the cost model predicts a shorter makespan
    async1         + one-step trajectory-consistent staleness (staleness = 1): the full digenrl schedule

Sizes left at ``None`` are derived from the workload and the device counts (see ``resolve``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from digenrl.errors import ConfigError
from digenrl.schedule.base import Workload

__all__ = ["ScheduleOptions", "SCHEDULES", "PRESETS", "SIZE_KEYS", "ResolvedSizes", "resolve"]

# The token sizes (granularities) a caller may override; unset = the schedule's default.
SIZE_KEYS = ("fragment_groups", "fragment_members", "step_chunk", "rollout_batch", "train_pack", "tag_steps")


@dataclass(frozen=True, slots=True)
class ScheduleOptions:
    """Switches and granularity of a schedule.

    Attributes:
        colocated: every device is ``Role.HYBRID`` and alternates rollout and training phases.
        gap: stream fragments to trainers as soon as their prompt groups are scored (else a
            full-batch barrier between rollout and training).
        tsp: pack (sample x timestep) rows into TRAIN tokens and issue ROLLOUT tokens per denoising
            step range with step-level batching (else whole-trajectory rollout tokens of one
            fragment and unpacked per-timestep training of whole samples).
        tag: idle trainers generate fragments of the batch they wait for, when the cost model
            predicts the batch finishes sooner with the help.
        staleness: 0 = strict on-policy; 1 = batch k is generated with version k - 1 (batch 0 with 0).
        fragment_groups: prompts (whole groups) per fragment.
        fragment_members: members of each prompt's group per fragment (splits along G).
        step_chunk: denoising steps per ROLLOUT token (TSP).
        rollout_batch: most samples per ROLLOUT token at unit speed (step-level batching, TSP).
        train_pack: rows per TRAIN token at unit speed (rounded to whole samples without TSP).
        tag_steps: denoising steps per helper token (short, so the trainer returns quickly).
        previous_version: the rollout devices start with version -1 as well as 0 (a one-step-stale
            run resumed from a checkpoint: its first batch was generated with the version before).
        batch_advantages: advantages need every group of the batch (``train.adv_std = "global"``:
            the batch's reward std), so no row is trainable before the whole batch is scored, with
            or without GAP. A TRAIN token issued earlier would hold its trainer idle while the
            fragments it waits for may need that very trainer to generate them (TAG).
    """

    colocated: bool = False
    gap: bool = False
    tsp: bool = False
    tag: bool = False
    staleness: int = 0
    fragment_groups: int | None = None
    fragment_members: int | None = None
    step_chunk: int | None = None
    rollout_batch: int | None = None
    train_pack: int | None = None
    tag_steps: int | None = None
    previous_version: bool = False
    batch_advantages: bool = False

    def validate(self, workload: Workload) -> None:
        """Check the switches against each other and the workload.

        Raises:
            ConfigError: naming the offending option and the allowed values.
        """
        if self.staleness not in (0, 1):
            raise ConfigError(f"schedule.staleness={self.staleness!r}: allowed values are 0 and 1")
        if self.colocated and (self.gap or self.tag or self.staleness):
            raise ConfigError("schedule.colocated=true cannot be combined with gap, tag or staleness > 0")
        if self.previous_version and not self.staleness:
            raise ConfigError("previous_version=true needs staleness 1 (only a stale schedule uses an older version)")
        for name in SIZE_KEYS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"schedule.{name}={value!r}: must be a positive integer or unset")
        if self.fragment_groups is not None and self.fragment_groups > workload.prompts_per_batch:
            raise ConfigError(
                f"schedule.fragment_groups={self.fragment_groups} exceeds prompts_per_batch={workload.prompts_per_batch}"
            )
        if self.fragment_members is not None and self.fragment_members > workload.group_size:
            raise ConfigError(f"schedule.fragment_members={self.fragment_members} exceeds group_size={workload.group_size}")
        for name in ("num_batches", "prompts_per_batch", "group_size", "num_steps", "trained_steps"):
            if getattr(workload, name) < 1:
                raise ConfigError(f"workload.{name}={getattr(workload, name)!r}: must be >= 1")
        # (trained_steps is rows per sample: a forward-process method may draw more noise levels than steps)


PRESETS: dict[str, ScheduleOptions] = {
    "colocated": ScheduleOptions(colocated=True),
    "colocated-tsp": ScheduleOptions(colocated=True, tsp=True),
    "disaggregated": ScheduleOptions(),
    "gap": ScheduleOptions(gap=True),
    "tsp": ScheduleOptions(gap=True, tsp=True),
    "tag": ScheduleOptions(gap=True, tsp=True, tag=True),
    "async1": ScheduleOptions(gap=True, tsp=True, tag=True, staleness=1),
}
SCHEDULES: tuple[str, ...] = tuple(PRESETS)


@dataclass(frozen=True, slots=True)
class ResolvedSizes:
    """Granularities after defaults: what the schedule actually uses."""

    fragment_groups: int
    fragment_members: int
    step_chunk: int
    rollout_batch: int
    train_pack: int
    tag_steps: int


def resolve(options: ScheduleOptions, workload: Workload, n_rollout: int, n_trainer: int) -> ResolvedSizes:
    """Fill the unset sizes from the workload and device counts.

    Without GAP a batch is cut into one fragment per rollout device (the naive data-parallel split);
    with GAP fragments are a quarter of that, so several stream per device and per batch. Without
    TSP a rollout token is a whole trajectory of one fragment.
    """
    w = workload
    n_rollout = max(1, n_rollout)
    n_trainer = max(1, n_trainer)
    groups = options.fragment_groups
    members = options.fragment_members
    if groups is None:
        if members is not None:
            groups = max(1, math.ceil(w.prompts_per_batch / n_rollout))
        else:
            want = n_rollout * (4 if options.gap else 1)
            groups = max(1, math.ceil(w.prompts_per_batch / want))
            if w.prompts_per_batch < want:
                # Fewer prompts than wanted fragments: split each group along G instead.
                members = max(1, math.ceil(w.group_size / math.ceil(want / w.prompts_per_batch)))
    if members is None:
        members = w.group_size
    frag_samples = groups * members
    quarter = max(1, math.ceil(w.num_steps / 4))
    if options.tsp:
        # One fragment's samples by default: bigger tokens advance many fragments in lockstep, so they
        # finish together at the end of the batch and training loses GAP's streaming (measured in
        # the simulator: 1.3-1.5x longer makespans at a device's whole share per token). A fragment
        # already fills a pass (16+ samples: the per-pass launch latency is < 1 % of its compute),
        # so more step-level batching buys nothing and only delays the first fragments.
        rollout_batch = options.rollout_batch or frag_samples
        # With one fragment per token a rollout device runs its fragments depth-first anyway, so
        # step ranges shorter than the trajectory only add tokens (4x the coordinator traffic at
        # 1024 GPUs) unless several fragments share a pass; helpers still use short ranges.
        step_chunk = options.step_chunk or (w.num_steps if rollout_batch <= frag_samples else quarter)
    else:
        step_chunk = w.num_steps
        rollout_batch = frag_samples
    share = math.ceil(w.rows_per_batch / n_trainer)
    train_pack = options.train_pack or (math.ceil(share / 4) if options.gap else share)
    if not options.tsp:
        train_pack = max(w.trained_steps, train_pack - train_pack % w.trained_steps)
    tag_steps = options.tag_steps or max(1, math.ceil(min(step_chunk, quarter) / 2))
    return ResolvedSizes(groups, members, step_chunk, rollout_batch, train_pack, tag_steps)


def with_overrides(base: ScheduleOptions, overrides: dict[str, object]) -> ScheduleOptions:
    """``base`` with keyword overrides; unknown keys are a ``ConfigError`` naming them.

    Raises:
        ConfigError: for an option that does not exist.
    """
    known = {f.name for f in dataclasses.fields(ScheduleOptions)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown schedule option(s) {unknown}: allowed are {sorted(known)}")
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]
