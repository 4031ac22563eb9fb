"""The metrics of one optimizer step, the same for every schedule, and where they are written.

:class:`StepMetrics` is the one schema: the colocated loop and every actor schedule fill the same
fields, so two runs can be compared line by line. ``metrics.jsonl`` holds one
:meth:`StepMetrics.line` per optimizer step (flat JSON: the per-component rewards become
``reward/<name>`` keys; ``bubble_ratio`` stays a map with one entry per actor and ``overall``).
:class:`MetricsLog` writes the file and, when asked, TensorBoard and W&B (``log.wandb``) the same numbers and
the sample grids (docs/logging.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["StepMetrics", "LOSS_KEYS", "ALGORITHM_KEYS", "algorithm_fields", "PHASE_KEYS", "PARITY_KEYS", "METRIC_KEYS", "MetricsLog", "parity_fields",
           "parity_warning", "total_drops", "expert_fields"]

log = logging.getLogger(__name__)

#: Per-row means of the clipped-surrogate diagnostics (``digenrl.rl.loss.reduce_stats``).
LOSS_KEYS = ("policy_loss", "kl", "approx_kl", "clipfrac", "clipfrac_gt_one", "clipfrac_lt_one", "ratio", "ratio_dev")
#: Per-row means of a forward-process algorithm's own diagnostics (``digenrl.rl.forward``): DiffusionNFT's
#: ``mean_d (v - v_old)^2`` and weighted positive / negative errors, AWM's KL to its EMA policy.
ALGORITHM_KEYS = ("old_deviate", "nft_pos", "nft_neg", "ema_kl")
#: Seconds the batch's work took in each phase, summed over devices: denoising steps, VAE decode,
#: reward scoring, and training (forward/backward and the optimizer step).
PHASE_KEYS = ("t_rollout", "t_decode", "t_reward", "t_train")
#: Rollout/trainer numerics parity before the step's update (``digenrl.rl.loss.parity_sums``).
PARITY_KEYS = ("parity_rows", "parity_ratio", "parity_ratio_dev_max", "parity_logp_diff_max")


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One optimizer step's metrics (one ``metrics.jsonl`` line), for every schedule.

    Attributes:
        step: the logical batch just trained (0-based); ``version`` = the policy version it made (step + 1).
        time: seconds since the run started, at the end of the step; ``seconds``: the step's wall time
            (since the previous step ended); ``samples_per_s``: the batch's samples / ``seconds``.
        reward_mean, reward_std: over the batch's samples; ``reward_std_mean``: mean within-group std;
            ``rewards``: mean of each weighted component (``reward/<name>`` in the line).
        reward_failures: samples scored with the failure penalty (``reward.on_error = "penalty"``).
        zero_std_ratio: share of groups with identical rewards (no signal; their rows are dropped);
            ``adv_abs_mean``: mean |advantage|.
        rows_trained: transitions (sample x trained step) the trainers ran; ``rows_kept``: those that
            count in the loss (not of a zero-std group).
        policy_loss ... ratio_dev: per-row means of the loss diagnostics (:data:`LOSS_KEYS`).
        grad_norm: gradient norm before clipping.
        max_staleness: the largest ``batch - policy_version`` among the batch's samples (0: on-policy).
        bubble_ratio: idle share of each actor over the step (1 - compute time / ``seconds``) and
            their mean, ``overall``; the colocated loop is one actor, ``colocated``.
        t_rollout, t_decode, t_reward, t_train: seconds this batch's work took in each phase
            (:data:`PHASE_KEYS`), summed over actors.
        parity_rows ... parity_logp_diff_max: rollout/trainer parity, before the step's update, of
            the rows the trainer recomputed with the very weights that sampled them (every row of an
            on-policy batch; of a stale async1 batch, a sample recomputed under the behaviour weights
            when ``train.check_parity``): how many rows, their mean ratio ``exp(l - l_old)`` (1 when
            both sides compute the same numbers), max |ratio - 1| and max |l - l_old|. ``None`` when
            no row was measured. This is not ``ratio``: a stale batch's ratio against the *current*
            weights differs from 1 by design (the policy moved); parity compares like with like.
        dropped_messages: malformed messages the run's endpoints dropped so far (cumulative: the
            coordinator's, and each actor's as of its latest token result); ``dropped``: the same by
            reason (``dropped/<reason>`` in the line, e.g. ``dropped/garbage``). 0 in the colocated loop.
        rows_by_expert: a mixture-of-experts model (Wan2.2 A14B): the trained rows each expert ran
            (``rows_by_expert/high``, ``rows_by_expert/low`` in the line); empty for other models.
        algorithm: the training algorithm's own terms (``algorithm/<name>`` in the line): per-row means of
            :data:`ALGORITHM_KEYS` and the decay its slow copy moved with after the step (``old_decay``,
            ``ema_decay``); empty for Flow-GRPO.
    """

    step: int
    version: int
    time: float
    seconds: float
    samples_per_s: float
    reward_mean: float
    reward_std: float
    reward_std_mean: float
    reward_failures: int
    zero_std_ratio: float
    adv_abs_mean: float
    rows_trained: int
    rows_kept: int
    policy_loss: float
    kl: float
    approx_kl: float
    clipfrac: float
    clipfrac_gt_one: float
    clipfrac_lt_one: float
    ratio: float
    ratio_dev: float
    grad_norm: float
    max_staleness: int
    bubble_ratio: dict[str, float]
    t_rollout: float
    t_decode: float
    t_reward: float
    t_train: float
    parity_rows: int
    parity_ratio: float | None
    parity_ratio_dev_max: float | None
    parity_logp_diff_max: float | None
    dropped_messages: int
    rewards: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    rows_by_expert: dict[str, int] = field(default_factory=dict)
    algorithm: dict[str, float] = field(default_factory=dict)

    def line(self) -> dict[str, Any]:
        """The flat ``metrics.jsonl`` form."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _MAPS}
        out.update({f"reward/{name}": value for name, value in self.rewards.items()})
        out.update({f"dropped/{reason}": n for reason, n in sorted(self.dropped.items())})
        out.update({f"rows_by_expert/{label}": n for label, n in self.rows_by_expert.items()})
        out.update({f"algorithm/{name}": v for name, v in self.algorithm.items()})
        return out


_MAPS = ("rewards", "dropped", "rows_by_expert", "algorithm")  # flattened into ``<prefix>/<name>`` keys by ``line``

#: Keys every ``metrics.jsonl`` line has, whatever the schedule (``reward/<name>`` and ``dropped/<reason>``
#: keys follow the config and what was dropped).
METRIC_KEYS = tuple(f.name for f in dataclasses.fields(StepMetrics) if f.name not in _MAPS)


def total_drops(counts: dict[str, dict[str, int]]) -> tuple[int, dict[str, int]]:
    """``{endpoint: transport stats}`` -> (all dropped messages, dropped by reason), summed over endpoints."""
    total, by_reason = 0, {}
    for stats in counts.values():
        total += stats.get("dropped", 0)
        for key, n in stats.items():
            if key.startswith("dropped/"):
                by_reason[key[len("dropped/"):]] = by_reason.get(key[len("dropped/"):], 0) + n
    return total, by_reason


def parity_fields(stats: dict[str, float]) -> dict[str, Any]:
    """The :data:`PARITY_KEYS` fields from reduced loss stats (``None`` values when no row was measured)."""
    rows = int(stats.get("parity_rows", 0))
    values = {k: (stats.get(k, 0.0) if rows else None) for k in PARITY_KEYS[1:]}
    return {"parity_rows": rows, **values}


def expert_fields(stats: dict[str, float]) -> dict[str, int]:
    """``rows_by_expert`` from reduced loss stats: ``{"high": rows, "low": rows}`` (``{}`` without experts)."""
    prefix = "rows_by_expert/"
    return {k[len(prefix):]: int(v) for k, v in stats.items() if k.startswith(prefix)}


def parity_warning(line: dict[str, Any], tolerance: float) -> str | None:
    """A warning when a step's parity is off by more than ``tolerance`` (``train.parity_tolerance``)."""
    dev, diff = line.get("parity_ratio_dev_max"), line.get("parity_logp_diff_max")
    if dev is None or diff is None or max(dev, diff) <= tolerance:
        return None
    return (f"step {line['step']}: rollout/trainer parity off: max |ratio - 1| = {dev:.3g}, max |dlog-prob| = "
            f"{diff:.3g} > train.parity_tolerance {tolerance:g} over {line['parity_rows']} rows recomputed "
            "with the weights that sampled them; rollout and training compute different numbers (dtype, "
            "kernels, LoRA merge, or stale weights on a rollout actor)")


class MetricsLog:
    """``metrics.jsonl`` (appended and flushed per step), optional TensorBoard event files and a W&B run.

    Args:
        out: the run directory (``None``: keep nothing on disk).
        tensorboard: also write TensorBoard event files under ``out/tb``: every number of each line as a scalar,
            and the sample grids (:meth:`image`) as images.
        history: lines of the steps already done (a resumed run rewrites them first, so the file
            never holds a step twice).
        wandb: a started :class:`~digenrl.telemetry.wandb_log.WandbLog` that gets the same (``log.wandb``).
    """

    def __init__(self, out: Path | None, tensorboard: bool = False, history: list[dict[str, Any]] | None = None,
                 wandb: Any = None) -> None:
        self.path = out / "metrics.jsonl" if out is not None else None
        self._tb: Any = None
        self._wandb = wandb
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w") as f:
                for line in history or []:
                    f.write(json.dumps(line) + "\n")
        if tensorboard and out is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out / "tb"))
            except ImportError as exc:  # a dependency since issue 11; an environment may still lack it
                log.warning("log.tensorboard = true but TensorBoard cannot be imported (%s): no event files "
                            "under %s. Install it with `pip install tensorboard` (setup.sh does), or set "
                            "log.tensorboard = false", exc, out / "tb")

    @classmethod
    def for_run(cls, log_cfg: Any, config: dict[str, Any], out: Path | None,
                history: list[dict[str, Any]] | None = None) -> MetricsLog:
        """The run's log as its ``[log]`` table asks (``log.tensorboard``, ``log.wandb``; nothing of either
        without ``out``).

        Raises:
            ConfigError: ``log.wandb = true`` without W&B installed, or W&B could not start its run.
        """
        wandb = None
        if log_cfg.wandb and out is not None:
            from digenrl.telemetry.wandb_log import WandbLog

            wandb = WandbLog(out, config, project=log_cfg.wandb_project, entity=log_cfg.wandb_entity,
                             mode=log_cfg.wandb_mode)
        return cls(out, log_cfg.tensorboard, history, wandb=wandb)

    def write(self, metrics: dict[str, Any]) -> None:
        """Append one step's line (and its scalars)."""
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(metrics) + "\n")
        step = int(metrics["step"])
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
                elif isinstance(value, dict):
                    for sub, v in value.items():
                        if isinstance(v, int | float):
                            self._tb.add_scalar(f"{key}/{sub}", v, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step)

    def image(self, tag: str, array: Any, step: int, caption: str = "",
              scalars: dict[str, float] | None = None) -> None:
        """A sample grid (``[H, W, 3]`` uint8) at ``step``, with its ``scalars`` (e.g. ``eval/reward_mean``), to
        TensorBoard and W&B (``metrics.jsonl`` holds training steps only; the grid's JSON holds its numbers)."""
        if self._tb is not None:
            self._tb.add_image(tag, array, step, dataformats="HWC")
            for key, value in (scalars or {}).items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.image(tag, array, step, caption, scalars)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def algorithm_fields(stats: dict[str, float], step_terms: dict[str, float]) -> dict[str, float]:
    """The ``algorithm`` field: the :data:`ALGORITHM_KEYS` found in reduced loss stats, and the step's own terms."""
    return {**{k: stats[k] for k in ALGORITHM_KEYS if k in stats}, **step_terms}
