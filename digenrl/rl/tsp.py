"""Time-step parallel (TSP) training: many (sample x timestep) transitions per forward/backward.

The GRPO objective of a logical batch is the mean, over all its trained transitions, of the per-row loss
(:func:`digenrl.rl.loss.grpo_loss`). Gradient accumulation is normalised by the total number of trained
transitions (ALGORITHM (e).16), so it does not matter how rows are grouped into passes: one pass per
timestep (the Flow-GRPO loop, :func:`per_step_backward`) and packed passes of ``rows_per_pass`` rows
with a per-row sigma and repeated conditioning (:func:`packed_backward`) give the same gradient up to
float rounding. ``rows_per_pass`` is the knob that trades memory for fewer, larger passes.

Both functions only call ``backward()``; the caller owns ``zero_grad``, clipping and the optimizer step,
so fragments of one logical batch can accumulate into one update.

A mixture-of-experts generator (Wan2.2 A14B: one expert per noise level) passes ``experts``
(:func:`digenrl.models.experts.expert_splitter`): the rows are then grouped by expert before they are cut
into passes, so every pass runs one expert (an offloaded idle expert never swaps inside a graph), and each
pass's sums count its rows as ``rows_by_expert/<label>`` (``high`` / ``low``), which the metrics report.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from digenrl.models.base import Cond, index_cond
from digenrl.rl.loss import LossConfig, Sums, grpo_loss, parity_sums
from digenrl.rl.rollout import TransitionBatch, VelocityFn
from digenrl.rl.sde import gaussian_log_prob, transition_stats

__all__ = ["packed_backward", "per_step_backward", "sliced_backward", "backward_rows", "parity_recompute",
           "ExpertSplit", "RowsBackward"]

#: ``sigma [B] -> [(label, row indices)]``: the rows of each expert (``digenrl.models.experts.expert_rows``).
ExpertSplit = Callable[[torch.Tensor], list[tuple[str, torch.Tensor]]]
#: One pass over some rows, :func:`backward_rows`'s signature: another algorithm's rows and loss (``digenrl.algorithms``)
#: are packed, sliced and split by expert by the same drivers.
RowsBackward = Callable[..., Sums]


def _by_expert(batch: TransitionBatch, experts: ExpertSplit | None) -> list[tuple[str | None, TransitionBatch]]:
    """``batch`` as one group (no experts) or one sub-batch per expert with rows, high noise first."""
    if experts is None or len(batch) == 0:
        return [(None, batch)]
    return [(label, batch.rows(rows)) for label, rows in experts(batch.sigma)]


def _counted(sums: Sums, label: str | None, rows: int) -> Sums:
    return sums if label is None else {**sums, f"rows_by_expert/{label}": float(rows)}


def backward_rows(
    velocity: VelocityFn,
    batch: TransitionBatch,
    cond: Cond,
    advantages: torch.Tensor,
    cfg: LossConfig,
    *,
    normalizer: float,
    ref_velocity: VelocityFn | None = None,
    parity: bool = True,
) -> Sums:
    """One forward/backward over all rows of ``batch`` (each row with its own sigma and conditioning).

    Args:
        velocity: the policy's velocity (with grad).
        batch: the transitions of this pass.
        cond: conditioning of the whole batch; rows pick theirs by ``batch.sample``.
        advantages: ``[B]`` per-sample advantages of the whole batch.
        cfg: loss config.
        normalizer: the loss is ``sum(rows) / normalizer`` (the total trained rows of the update).
        ref_velocity: the reference velocity, required when ``cfg.kl_beta > 0``.
        parity: ``velocity`` has the weights that sampled ``batch`` (on-policy), so its log-probs
            also measure rollout/trainer parity (:func:`digenrl.rl.loss.parity_sums`).

    Returns:
        Detached per-row sums of the diagnostics, on the rows' device (see :class:`digenrl.rl.loss.LossTerms`).

    Raises:
        ValueError: if ``kl_beta > 0`` without ``ref_velocity``.
    """
    if len(batch) == 0:
        return {"rows": 0.0}
    rows_cond = index_cond(cond, batch.sample)
    mean_ref = None
    if cfg.kl_beta > 0:
        if ref_velocity is None:
            raise ValueError("kl_beta > 0 needs a reference velocity")
        with torch.no_grad():
            v_ref = ref_velocity(batch.x, batch.sigma, rows_cond)
            mean_ref, _, _ = transition_stats(
                batch.x, v_ref, batch.sigma, batch.sigma_next, batch.noise_level, batch.kind
            )
    v = velocity(batch.x, batch.sigma, rows_cond)
    mean, std, g = transition_stats(batch.x, v, batch.sigma, batch.sigma_next, batch.noise_level, batch.kind)
    log_prob = gaussian_log_prob(batch.x_next, mean, std, batch.kind)
    terms = grpo_loss(
        log_prob,
        batch.log_prob,
        advantages[batch.sample].float(),
        cfg,
        mean=mean,
        mean_ref=mean_ref,
        std=std,
        g=g,
    )
    (terms.loss.sum() / normalizer).backward()
    return {**terms.sums, **parity_sums(log_prob, batch.log_prob)} if parity else terms.sums


def packed_backward(
    velocity: VelocityFn,
    batch: TransitionBatch,
    cond: Cond,
    advantages: torch.Tensor,
    cfg: LossConfig,
    *,
    rows_per_pass: int | None = None,
    normalizer: float | None = None,
    ref_velocity: VelocityFn | None = None,
    parity: bool = True,
    experts: ExpertSplit | None = None,
    backward: RowsBackward | None = None,
) -> list[Sums]:
    """TSP: backward over ``batch`` in passes of up to ``rows_per_pass`` (sample x step) rows.

    Args:
        velocity: policy velocity.
        batch: all transitions to train (any mix of samples and steps).
        cond: conditioning of the whole batch.
        advantages: ``[B]`` per-sample advantages.
        cfg: loss config.
        rows_per_pass: rows per forward/backward; ``None`` packs everything into one pass.
        normalizer: total trained rows of the update (defaults to ``len(batch)``).
        ref_velocity: reference velocity for the KL.
        parity: the rows were sampled by ``velocity``'s weights (see :func:`backward_rows`).
        experts: a mixture-of-experts model's row split: passes never mix experts (module docstring).
        backward: one pass's forward/backward (default :func:`backward_rows`, Flow-GRPO's).

    Returns:
        Per-pass diagnostic sums (reduce with :func:`digenrl.rl.loss.reduce_stats`).

    Raises:
        ValueError: for ``rows_per_pass < 1``.
    """
    n = len(batch)
    per = n if rows_per_pass is None else rows_per_pass
    if per < 1 and n:
        raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
    norm = float(normalizer if normalizer is not None else max(n, 1))
    run = backward or backward_rows
    out: list[Sums] = []
    for label, group in _by_expert(batch, experts):
        for lo in range(0, len(group), max(per, 1)):
            sub = group.rows(slice(lo, lo + per))
            sums = run(velocity, sub, cond, advantages, cfg, normalizer=norm, ref_velocity=ref_velocity, parity=parity)
            out.append(_counted(sums, label, len(sub)))
    return out


def per_step_backward(
    velocity: VelocityFn,
    batch: TransitionBatch,
    cond: Cond,
    advantages: torch.Tensor,
    cfg: LossConfig,
    *,
    normalizer: float | None = None,
    ref_velocity: VelocityFn | None = None,
    parity: bool = True,
    experts: ExpertSplit | None = None,
    backward: RowsBackward | None = None,
) -> list[Sums]:
    """The Flow-GRPO reference loop: one forward/backward per timestep over the samples trained there
    (``experts``, ``backward``: as :func:`packed_backward`; a step's rows share one sigma, hence one expert)."""
    norm = float(normalizer if normalizer is not None else max(len(batch), 1))
    run = backward or backward_rows
    out: list[Sums] = []
    for step in torch.unique(batch.step).tolist():
        for label, sub in _by_expert(batch.rows((batch.step == step).nonzero().flatten()), experts):
            sums = run(velocity, sub, cond, advantages, cfg, normalizer=norm, ref_velocity=ref_velocity, parity=parity)
            out.append(_counted(sums, label, len(sub)))
    return out


def parity_recompute(velocity: VelocityFn, batch: TransitionBatch, cond: Cond, max_rows: int) -> Sums:
    """Parity sums of up to ``max_rows`` evenly spaced rows, recomputed without gradients.

    For rows the training pass does not measure (``train.check_parity``): ``velocity`` must carry the
    weights that sampled ``batch`` (the behaviour policy).
    """
    n = len(batch)
    if n == 0:
        return {"parity_rows": 0.0}
    sub = batch.rows(torch.linspace(0, n - 1, min(n, max_rows)).round().long().unique())
    with torch.no_grad():
        v = velocity(sub.x, sub.sigma, index_cond(cond, sub.sample))
        mean, std, _ = transition_stats(sub.x, v, sub.sigma, sub.sigma_next, sub.noise_level, sub.kind)
        return parity_sums(gaussian_log_prob(sub.x_next, mean, std, sub.kind), sub.log_prob)


def sliced_backward(
    velocity: VelocityFn,
    batch: TransitionBatch,
    cond: Cond,
    advantages: torch.Tensor,
    cfg: LossConfig,
    *,
    rank: int,
    world: int,
    rows_per_pass: int | None = None,
    normalizer: float,
    ref_velocity: VelocityFn | None = None,
    parity: bool = True,
    experts: ExpertSplit | None = None,
    backward: RowsBackward | None = None,
) -> list[Sums]:
    """TSP under sharded data parallelism (FSDP): rank ``rank``'s slice of ``batch``, in as many passes as every rank.

    Under FSDP a forward/backward is a collective (parameters are all-gathered, gradients
    reduce-scattered), so every rank must run the same number of passes. The rows are split into
    ``world`` contiguous shares (sizes differ by at most one); every rank runs
    ``ceil(ceil(n / world) / rows_per_pass)`` passes over its share. A rank with no row left for a
    pass runs it on the batch's first row with zero weight: the collectives match, its gradient
    contribution is exactly zero. Summed over ranks the gradient is :func:`packed_backward`'s.

    ``experts``: each expert's rows are sliced this way in turn (every rank sees the whole token, so the
    groups, and the pass counts, agree across ranks). ``backward``: as :func:`packed_backward`.

    Returns:
        This rank's per-pass diagnostic sums (zero-weight passes left out).
    """
    if experts is not None:
        out_all: list[Sums] = []
        for label, group in _by_expert(batch, experts):
            for sums in sliced_backward(velocity, group, cond, advantages, cfg, rank=rank, world=world,
                                        rows_per_pass=rows_per_pass, normalizer=normalizer,
                                        ref_velocity=ref_velocity, parity=parity, backward=backward):
                out_all.append(_counted(sums, label, int(sums.get("rows", 0))))
        return out_all
    n = len(batch)
    if n == 0:  # the same on every rank (each sees the whole token): nobody runs a pass
        return []
    lo, hi = rank * n // world, (rank + 1) * n // world
    largest = -(-n // world)
    per = largest if rows_per_pass is None else rows_per_pass
    if per < 1:
        raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
    run = backward or backward_rows
    out: list[Sums] = []
    for p in range(-(-largest // per)):
        a, b = lo + p * per, min(hi, lo + (p + 1) * per)
        if a < b:
            out.append(run(velocity, batch.rows(slice(a, b)), cond, advantages, cfg, normalizer=normalizer,
                           ref_velocity=ref_velocity, parity=parity))
        else:
            run(velocity, batch.rows(slice(0, 1)), cond, advantages, cfg, normalizer=float("inf"),
                ref_velocity=ref_velocity, parity=False)
    return out
