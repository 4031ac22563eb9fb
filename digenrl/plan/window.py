"""What a moving window means for the split (MixGRPO-Flash): the rollout's work per sample changes over the run.

MixGRPO-Flash's rollout runs the window's end plus a compressed tail (``digenrl/sim/window.py``): 11 forwards a
sample at start 0 of 25 steps, 24 at start 19, while training stays the window's transitions. The split that balances
one batch's rollout against its training (``n_rollout = round(N R / (R + T))``, the scenarios' rule) therefore moves
with the window; a fixed split is balanced for one position and leaves one side idle at the others. The planner
prices each token at its version's window, and this note says how far apart the ends are.
"""

from __future__ import annotations

from dataclasses import replace

from digenrl.config import Config
from digenrl.policy import trained_steps
from digenrl.sim.calibration import calibrated_params
from digenrl.sim.cost import CostModel
from digenrl.sim.devices import device_spec
from digenrl.schedule.base import Role
from digenrl.sim.profiles import ModelProfile
from digenrl.sim.window import SlidingWindow

__all__ = ["window_note"]


def _rollout_share(prof: ModelProfile, cfg: Config, gpu: str, forwards: float) -> float:
    """The share of devices whose rollout time equals the rest's training time at ``forwards`` a sample."""
    ro, spec = cfg.rollout, device_spec(gpu)
    cost = CostModel(replace(prof, window=None), {"x": spec}, calibrated_params(), {"x": Role.TRAINER})
    samples = ro.prompts_per_batch * ro.group_size
    roll, train = cost.batch_work(samples, ro.prompts_per_batch, round(forwards), samples * trained_steps(cfg), spec)
    return roll / (roll + train)


def window_note(prof: ModelProfile, cfg: Config, gpu: str, devices: int) -> str | None:
    """One line: the rollout forwards a sample over the window's cycle and the balanced split at its ends and mean
    on ``devices`` of ``gpu``; None when every version's rollout costs the same."""
    window: SlidingWindow | None = prof.window
    if window is None or window.tail_ratio is None:
        return None
    cycle = [window.forwards(window.shift_every * p) for p in range(window.positions if window.shift_every else 1)]
    lo, hi, mean = min(cycle), max(cycle), window.mean_forwards()
    split = {f: min(devices - 1, max(1, round(devices * _rollout_share(prof, cfg, gpu, f)))) for f in (lo, mean, hi)}
    every = f"every {window.shift_every} optimizer steps" if window.shift_every else "never (fixed at step 0)"
    return (f"split: the SDE window moves {every}, so a sample's rollout runs {lo}..{hi} forwards (mean {mean:.1f}, "
            f"{window.num_steps} without Flash) beside {window.window} trained transitions; the balanced rollout share "
            f"of {devices} {gpu} is {split[lo]} at the cheapest window, {split[hi]} at the dearest, {split[mean]} on "
            f"the cycle's mean (placement.rollout is fixed for the run: choose for the mean, or the phase that matters)")


def config_window_note(cfg: Config) -> str | None:
    """:func:`window_note` for a config's own placement (``placement.gpu``, its rollout + trainer devices); None too
    for a model the profiles do not price (a tiny preset)."""
    from digenrl.errors import ConfigError
    from digenrl.plan.rows import rollout_window, row_cost
    from digenrl.sim.profiles import model_profile

    window = rollout_window(cfg)
    if window is None or window.tail_ratio is None:
        return None
    try:
        prof = model_profile(cfg.model, reward=cfg.reward, rows=row_cost(cfg))
    except ConfigError:
        return None
    place = cfg.placement
    return window_note(replace(prof, window=window), cfg, place.gpu, max(2, place.rollout + place.trainer))
