"""``batch_advantages`` (``train.adv_std = "global"``): no row of a batch is trainable before all of it is scored.

The hazard it removes (a TAG run whose only rollout device died): a TRAIN token issued as soon as one prompt
group was scored held the lone trainer, waiting for advantages that need the rest of the batch, which only
that trainer could still generate (tests/e2e/test_tag_kill.py runs it over real processes).
"""

from __future__ import annotations

from digenrl.recipes.disaggregated import tiny_cpu_cost
from digenrl.schedule import Device, DeviceDied, Role, TokenKind, Workload, make_schedule
from digenrl.schedule._replay import Fault, Replay, replay
from tests.schedule._checker import Setup, check

# tests/e2e/_tiny.py's tiny_config: 2 batches of 2 prompts x 2 samples, 4 steps, 3 trained (4 fragments of 1 sample)
W = Workload(num_batches=2, prompts_per_batch=2, group_size=2, num_steps=4, trained_steps=3)
DEVICES = [Device("rollout-0", Role.ROLLOUT), Device("trainer-0", Role.TRAINER)]
COST = tiny_cpu_cost()  # the estimate the real run schedules with (the trainer helps as it does there)


def _duration(token) -> float:
    return COST.seconds(token, Device(token.device, Role.TRAINER if token.device == "trainer-0" else Role.ROLLOUT))


def _run(batch_advantages: bool, faults: list[Fault] = ()) -> Replay:
    schedule = make_schedule("tag", DEVICES, W, COST, batch_advantages=batch_advantages)
    return replay(schedule, DEVICES, _duration, faults)


def _rollout_dies_at_its_first_batch_1_token(batch_advantages: bool) -> Replay:
    first = next(s for s in _run(batch_advantages).spans
                 if s.token.device == "rollout-0" and s.token.kind is TokenKind.ROLLOUT and s.token.batch == 1)
    return _run(batch_advantages, [Fault(first.start + 1e-6, DeviceDied("rollout-0"))])


def _first_train_before_last_score(rep: Replay, batch: int) -> bool:
    trains = [s.issued_seq for s in rep.spans if s.token.kind is TokenKind.TRAIN and s.token.batch == batch]
    scores = [s.ended_seq for s in rep.spans if s.token.kind is TokenKind.REWARD and s.token.batch == batch
              and s.end is not None]
    return min(trains) < max(scores)  # (a token issued by the last score's own completion comes after it)


def test_a_lone_trainer_generates_the_whole_batch_before_training_it() -> None:
    rep = _rollout_dies_at_its_first_batch_1_token(batch_advantages=True)
    assert rep.done and rep.deaths and not rep.failed
    # Every fragment scored once, every row trained once, and none before the whole batch was scored.
    setup = Setup(W, 0, False, False, {d.name: d.role for d in DEVICES}, frozenset(d.name for d in DEVICES))
    assert check(rep, setup) == []
    after = [s.token for s in rep.spans if s.start > rep.deaths[0][1]]
    generated = {f.index for t in after if t.kind is TokenKind.ROLLOUT and t.step_start == 0 for f in t.fragments}
    assert {t.device for t in after} == {"trainer-0"} and generated >= {2, 3}  # the dead device's share: TAG


def test_without_it_a_train_token_of_the_batch_starts_before_the_batch_is_scored() -> None:
    """What the coordinator's TRAIN task then waits on (it holds the trainer): the fragments still unscored."""
    assert _first_train_before_last_score(_rollout_dies_at_its_first_batch_1_token(batch_advantages=False), 1)
    assert not _first_train_before_last_score(_rollout_dies_at_its_first_batch_1_token(batch_advantages=True), 1)
