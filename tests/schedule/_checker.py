"""Independent invariant checker over a replay: recomputes everything from the recorded spans.

It does not import schedule internals; it rebuilds published versions, trainer versions, scored
prompt groups and trained rows from what the driver saw, and returns a list of violations.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from digenrl.schedule import Role, TokenKind, Workload
from digenrl.schedule._replay import Replay


@dataclass(frozen=True)
class Setup:
    workload: Workload
    staleness: int
    gap: bool
    colocated: bool
    roles: dict[str, Role]  # every device ever seen (initial and joined)
    initial: frozenset[str]  # alive at time zero


def check(rep: Replay, setup: Setup) -> list[str]:
    errors: list[str] = []
    w = setup.workload
    n_steps, t_steps, g = w.num_steps, w.trained_steps, w.group_size
    death_seq = {name: seq for seq, _, name in rep.deaths}
    order = {id(span): i for i, span in enumerate(rep.spans)}

    # Timeline of events: completions by seq, issues by (seq, order).
    completed = sorted((s for s in rep.spans if s.end is not None), key=lambda s: s.ended_seq)
    published_at: list[tuple[int, int]] = [(-2, 0)]  # (seq, version) in order
    optim_done: list[tuple[int, int]] = []  # (seq, batch)
    for s in completed:
        if s.token.kind is TokenKind.PUBLISH:
            published_at.append((s.ended_seq, s.token.policy_version))
        elif s.token.kind is TokenKind.OPTIM:
            optim_done.append((s.ended_seq, s.token.batch))

    def trainer_version(seq: int) -> int:
        return sum(1 for q, _ in optim_done if q <= seq)

    def rollout_versions(seq: int) -> set[int]:
        seen = [v for q, v in published_at if q <= seq]
        return set(seen[-2:])

    # 1. one completed OPTIM per batch, in order; liveness
    batches = [b for _, b in optim_done]
    if batches != list(range(len(batches))):
        errors.append(f"optimizer steps out of order or repeated: {batches}")
    if rep.stalled:
        errors.append("stalled: nothing running, nothing pending, not done")
    if rep.done and len(batches) != w.num_batches:
        errors.append(f"done with {len(batches)} optimizer steps, want {w.num_batches}")

    # 2. trajectories: contiguous steps, one version, rollout devices hold it, staleness at start
    attempt: dict[tuple[int, int], tuple[int, int]] = {}  # (batch, frag) -> (version, steps done)
    scored: dict[tuple[int, int], int] = {}  # (batch, frag) -> version
    scored_samples: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))  # batch->prompt->members
    scored_seq: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)  # batch -> (seq, p0, p1, n members)
    for s in rep.spans:
        tok = s.token
        if tok.kind is TokenKind.ROLLOUT:
            role = setup.roles[tok.device]
            if role in (Role.TRAINER, Role.HYBRID):
                if tok.policy_version != trainer_version(s.issued_seq):
                    errors.append(f"token {tok.id}: {role.value} {tok.device} generates with version "
                                  f"{tok.policy_version}, holds {trainer_version(s.issued_seq)}")
            elif tok.policy_version not in rollout_versions(s.issued_seq):
                errors.append(f"token {tok.id}: rollout device {tok.device} uses version {tok.policy_version}, "
                              f"holds {sorted(rollout_versions(s.issued_seq))}")
            if tok.step_start == 0 and not (tok.batch - setup.staleness <= tok.policy_version <= tok.batch):
                errors.append(f"token {tok.id}: batch {tok.batch} started with version {tok.policy_version}")
    for s in completed:
        tok = s.token
        if tok.kind is TokenKind.ROLLOUT:
            for frag in tok.fragments:
                key = (frag.batch, frag.index)
                if tok.step_start == 0:
                    attempt[key] = (tok.policy_version, tok.step_end)
                    continue
                prev = attempt.get(key)
                if prev is None or prev != (tok.policy_version, tok.step_start):
                    errors.append(f"token {tok.id}: fragment {key} steps {tok.step_start}..{tok.step_end} "
                                  f"v{tok.policy_version} does not continue {prev}")
                attempt[key] = (tok.policy_version, tok.step_end)
        elif tok.kind is TokenKind.REWARD:
            for frag in tok.fragments:
                key = (frag.batch, frag.index)
                prev = attempt.get(key)
                if prev is None or prev[1] != n_steps or prev[0] != tok.policy_version:
                    errors.append(f"token {tok.id}: scores fragment {key} whose trajectory is {prev}")
                if key in scored:
                    errors.append(f"token {tok.id}: fragment {key} scored twice")
                scored[key] = prev[0] if prev else -1
                for p in range(frag.prompt_start, frag.prompt_end):
                    scored_samples[frag.batch][p].update(range(frag.member_start, frag.member_end))
                scored_seq[frag.batch].append((s.ended_seq, frag.prompt_start, frag.prompt_end, frag.num_members))

    def groups_complete(batch: int, seq: int) -> dict[int, int]:
        """prompt -> members scored by event ``seq`` (inclusive)."""
        count: dict[int, int] = defaultdict(int)
        for q, p0, p1, n in scored_seq.get(batch, []):
            if q <= seq:
                for p in range(p0, p1):
                    count[p] += n
        return count

    # 3. training: staleness, trainable when issued, exactly once, before the batch's OPTIM
    optim_spans = {s.token.batch: s for s in completed if s.token.kind is TokenKind.OPTIM}
    rows_by_batch: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for s in rep.spans:
        tok = s.token
        if tok.kind is not TokenKind.TRAIN:
            continue
        if not 0 <= tok.batch - tok.policy_version <= setup.staleness:
            errors.append(f"token {tok.id}: trains batch {tok.batch} from version {tok.policy_version}")
        done_groups = groups_complete(tok.batch, s.issued_seq)
        for frag in tok.fragments:
            if scored.get((frag.batch, frag.index)) != tok.policy_version:
                errors.append(f"token {tok.id}: fragment {frag.index} version mismatch")
            prompts = range(frag.prompt_start, frag.prompt_end) if setup.gap else range(w.prompts_per_batch)
            if any(done_groups.get(p, 0) != g for p in prompts):
                errors.append(f"token {tok.id}: trains batch {tok.batch} fragment {frag.index} before its groups "
                              f"{'' if setup.gap else '(whole batch, no GAP) '}are scored")
                break
        optim = optim_spans.get(tok.batch)
        if s.end is None or optim is None:
            continue
        if death_seq.get(tok.device, 1 << 60) < optim.ended_seq:
            continue  # its gradients died with it
        if s.ended_seq > optim.issued_seq:
            errors.append(f"token {tok.id}: counted TRAIN of batch {tok.batch} ends after its OPTIM starts")
        for frag, (r0, r1) in zip(tok.fragments, tok.rows):
            rows_by_batch[tok.batch].extend(frag.row(r, t_steps) for r in range(r0, r1))
    for b in optim_spans:
        rows = rows_by_batch[b]
        if len(rows) != len(set(rows)) or len(rows) != w.rows_per_batch:
            errors.append(f"batch {b}: {len(rows)} rows trained ({len(set(rows))} distinct), "
                          f"want each of {w.rows_per_batch} once")

    # 4. every OPTIM covers every live trainer; every version but the last is published
    for s in rep.spans:
        tok = s.token
        if tok.kind is TokenKind.OPTIM:
            want_role = Role.HYBRID if setup.colocated else Role.TRAINER
            alive = {n for n, r in setup.roles.items() if r is want_role and _alive_at(rep, setup, n, s.issued_seq)}
            if set(tok.group) != alive:
                errors.append(f"token {tok.id}: OPTIM group {sorted(tok.group)} != live {want_role.value}s {sorted(alive)}")
    if not setup.colocated:
        issued = {s.token.policy_version for s in rep.spans if s.token.kind is TokenKind.PUBLISH}
        for _, b in optim_done:
            if b + 1 < w.num_batches and b + 1 not in issued:
                errors.append(f"version {b + 1} never published")

    # 5. TAG never takes a trainer while trainable rows of its batch wait unassigned
    if not setup.colocated:
        errors += _check_tag_priority(rep, setup, trainer_version, groups_complete, order, death_seq)
    if setup.colocated:
        errors += _check_phases(rep)
    return errors


def _alive_at(rep: Replay, setup: Setup, name: str, seq: int) -> bool:
    """Alive after event ``seq``: initial devices start alive; joins and deaths flip it in order."""
    changes = [(q, True) for q, _, n in rep.joins if n == name] + [(q, False) for q, _, n in rep.deaths if n == name]
    alive = name in setup.initial
    for q, up in sorted(changes):
        if q <= seq:
            alive = up
    return alive


def _check_tag_priority(rep, setup, trainer_version, groups_complete, order, death_seq) -> list[str]:
    errors = []
    w = setup.workload
    for s in rep.spans:
        tok = s.token
        if tok.kind is not TokenKind.ROLLOUT or setup.roles[tok.device] is not Role.TRAINER:
            continue
        q = s.issued_seq
        v = trainer_version(q)
        done_groups = groups_complete(v, q)
        prompts = [p for p in range(w.prompts_per_batch) if done_groups.get(p, 0) == w.group_size]
        if not setup.gap and len(prompts) != w.prompts_per_batch:
            continue
        trainable = {(p * w.group_size + m, t) for p in prompts for m in range(w.group_size)
                     for t in range(w.trained_steps)}
        covered = set()
        for other in rep.spans[: order[id(s)]]:
            ot = other.token
            if ot.kind is TokenKind.TRAIN and ot.batch == v and death_seq.get(ot.device, 1 << 60) >= q:
                for frag, (r0, r1) in zip(ot.fragments, ot.rows):
                    covered.update(frag.row(r, w.trained_steps) for r in range(r0, r1))
        if trainable - covered:
            errors.append(f"token {tok.id}: trainer {tok.device} helps generate while "
                          f"{len(trainable - covered)} trainable rows of batch {v} wait")
    return errors


def _check_phases(rep: Replay) -> list[str]:
    errors = []
    phase: dict[str, str] = defaultdict(lambda: "rollout")
    for s in rep.spans:  # issue order; a device's tokens are sequential
        tok = s.token
        if tok.kind is TokenKind.SWITCH:
            phase[tok.device] = tok.switch_to
        elif tok.kind in (TokenKind.ROLLOUT, TokenKind.TRAIN) and phase[tok.device] != tok.kind.value:
            errors.append(f"token {tok.id}: {tok.kind.value} on {tok.device} in {phase[tok.device]} phase")
        elif tok.kind is TokenKind.OPTIM and any(phase[d] != "train" for d in tok.group):
            errors.append(f"token {tok.id}: OPTIM with a device outside the train phase")
    return errors
