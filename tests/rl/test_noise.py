"""Per-sample noise: a sample's noise does not depend on which other samples share its fragment."""

from __future__ import annotations

import torch

from digenrl.rl.noise import initial_keys, initial_latents, noise_seed, transition_noise


class _Latents:
    """The one model method the noise module uses: ``prepare_latents(n, generator)``."""

    def prepare_latents(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn((batch, 4, 8), generator=generator)


def test_a_samples_noise_is_the_same_in_any_fragment() -> None:
    like = torch.zeros(6, 4, 8)
    whole = transition_noise(7, 3, list(range(6)), 2, like)
    part = transition_noise(7, 3, [4, 1], 2, like[:2])
    assert torch.equal(part[0], whole[4]) and torch.equal(part[1], whole[1])
    assert not torch.equal(whole[0], whole[1])  # samples differ
    assert not torch.equal(transition_noise(7, 3, [0], 3, like[:1])[0], whole[0])  # steps differ
    assert not torch.equal(transition_noise(7, 4, [0], 2, like[:1])[0], whole[0])  # batches differ
    assert abs(float(whole.mean())) < 0.2 and abs(float(whole.std()) - 1) < 0.2


def test_group_members_share_x0_only_with_same_init() -> None:
    model, group = _Latents(), 4
    ids = [4, 5, 6, 7, 8]  # prompt 1's whole group, then prompt 2's first member
    shared = initial_latents(model, 0, 1, initial_keys(ids, group, same_init=True))
    assert all(torch.equal(shared[0], shared[k]) for k in (1, 2, 3)) and not torch.equal(shared[0], shared[4])
    own = initial_latents(model, 0, 1, initial_keys(ids, group, same_init=False))
    assert not torch.equal(own[0], own[1])
    alone = initial_latents(model, 0, 1, initial_keys([8], group, same_init=True))
    assert torch.equal(alone[0], shared[4])


def test_seeds_do_not_collide_for_nearby_ids() -> None:
    seeds = {noise_seed(s, b, k, i) for s in range(3) for b in range(20) for k in range(-9, 40) for i in range(-1, 10)}
    assert len(seeds) == 3 * 20 * 49 * 11


def test_inactive_rows_get_zeros_and_leave_the_others_alone() -> None:
    like = torch.zeros(3, 4, 8)
    full = transition_noise(1, 2, [0, 1, 2], 0, like)
    some = transition_noise(1, 2, [0, 1, 2], 0, like, active=torch.tensor([True, False, True]))
    assert torch.equal(some[0], full[0]) and torch.equal(some[2], full[2]) and not some[1].any()
