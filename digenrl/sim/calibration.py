"""Fit the cost model's two utilisations to one published colocated run, once, and freeze them.

The reference is veRL-Omni's Flow-GRPO LoRA recipe on Qwen-Image (verl-omni ``docs/algo/performance.md``,
``run_qwen_image_ocr_lora.sh``; ``docs/start/rollout_batching.md``):

- 4 H800, colocated (actor, rollout and reward share the GPUs), LoRA r64 (attention + img/txt MLP),
  32 prompts x 16 images = 512 images per step at 512^2, 10 sampling steps, true CFG 4,
  SDE window of 2 trained steps;
- 0.305 images/GPU/s = 420 s per step;
- generation (rollout, request-level batching) 107.9 s per step, first step excluded.

The fit, in order:

1. ``mfu_rollout`` = generation FLOPs (512 x 10 x 2 CFG transformer passes, 32 prompt encodings,
   512 VAE decodes) / (4 x peak x 107.9 s).
2. ``mfu_reward``: reward (Qwen3-VL-8B scoring 512 images) costs the colocated step the 60 s that
   moving it to a 5th GPU saved (420 -> 360 s/step, same page). The two phase switches and the
   optimizer step are computed from first principles with the catalog's bandwidths.
3. ``mfu_train`` = training FLOPs (512 x 2 rows x 2 CFG x (4 passes + 1 old-log-prob recompute forward,
   ``CostParams.old_logprob_passes``)) / (4 x peak x what is left of 420 s).

Everything veRL-Omni spends beyond counted FLOPs therefore lands in ``mfu_train``, which every schedule
pays alike. The one modelled difference is the old-log-prob recompute (veRL-Omni: about 20 % of a step),
which the colocated baseline pays and digenrl's dedicated trainers do not (they use the stored
behaviour log-probs). That choice is deliberately conservative for digenrl: none of the baseline's unexplained
time is assumed to vanish when rollout and training are split.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from digenrl.schedule.base import Device, Role, Token, TokenKind
from digenrl.sim.cost import TRAIN_PASSES, CostModel, CostParams
from digenrl.sim.devices import device_spec
from digenrl.sim.profiles import ModelProfile, profile

if TYPE_CHECKING:
    from digenrl.sim.measured import MeasuredCost

__all__ = ["PUBLISHED", "Calibration", "calibrate", "calibrated_params", "fitted_source", "cost_source"]


@dataclass(frozen=True, slots=True)
class Published:
    """A published colocated run (the numbers the fit must reproduce)."""

    source: str
    model: str
    device: str
    gpus: int
    prompts: int
    group_size: int
    num_steps: int
    trained_steps: int
    step_seconds: float
    generation_seconds: float
    reward_seconds: float  # reward on the critical path: sync-reward step minus async-reward step

    @property
    def samples(self) -> int:
        return self.prompts * self.group_size

    @property
    def images_per_gpu_per_s(self) -> float:
        return self.samples / (self.gpus * self.step_seconds)


PUBLISHED = Published(
    source="verl-omni docs/algo/performance.md (0.305 img/GPU/s, 420 s/step) + docs/start/rollout_batching.md (107.9 s gen)",
    model="qwen-image", device="H800", gpus=4, prompts=32, group_size=16, num_steps=10, trained_steps=2,
    step_seconds=420.0, generation_seconds=107.9,
    # Same recipe with the reward model on a 5th GPU (async reward): 360 s/step, so scoring costs the
    # colocated step about 60 s (performance.md, "LoRA r64 + async reward", 0.280 img/GPU/s).
    reward_seconds=420.0 - 360.0,
)


@dataclass(frozen=True, slots=True)
class Calibration:
    """The fitted parameters and the step breakdown that produced them (seconds per step)."""

    params: CostParams
    generation: float
    reward: float
    switches: float
    optim: float
    train: float

    @property
    def step(self) -> float:
        return self.generation + self.reward + self.switches + self.optim + self.train


def calibrate(ref: Published = PUBLISHED) -> Calibration:
    """Fit ``mfu_rollout`` and ``mfu_train`` to ``ref`` (see the module docstring)."""
    prof = profile(ref.model)
    spec = device_spec(ref.device)
    names = [f"gpu{i}" for i in range(ref.gpus)]
    peak = ref.gpus * spec.peak_bf16_flops

    gen_flops: float = ref.samples * ref.num_steps * prof.cfg_rollout * prof.forward_flops
    gen_flops += ref.prompts * prof.text_flops + ref.samples * prof.decode_flops
    mfu_rollout = gen_flops / (peak * ref.generation_seconds)

    reward = ref.reward_seconds
    mfu_reward = min(1.0, ref.samples * prof.reward_flops / (peak * reward))
    probe = CostParams(mfu_rollout=mfu_rollout, mfu_train=1.0, mfu_reward=mfu_reward)
    model = CostModel(prof, {n: spec for n in names}, probe, {n: Role.HYBRID for n in names})
    switches = 2 * model.switch_seconds(names[0])
    optim = model.seconds(Token(0, TokenKind.OPTIM, names[0], 0, group=tuple(names)), Device(names[0], Role.HYBRID))
    train = ref.step_seconds - ref.generation_seconds - reward - switches - optim
    # The reference trainer is colocated: its train phase includes the old-log-prob recompute.
    passes = TRAIN_PASSES + probe.old_logprob_passes
    train_flops = ref.samples * ref.trained_steps * prof.cfg_train * passes * prof.forward_flops
    mfu_train = train_flops / (peak * train)
    params = CostParams(mfu_rollout=mfu_rollout, mfu_train=mfu_train, mfu_reward=mfu_reward)
    return Calibration(params, ref.generation_seconds, reward, switches, optim, train)


@functools.lru_cache(maxsize=1)
def calibrated_params() -> CostParams:
    """The frozen parameters every comparison uses."""
    return calibrate().params


# The cost terms in which a digenrl schedule's own implementation differs from the calibration run (veRL-Omni's
# hybrid engine, which ``colocated`` models). ``colocated-tsp`` is digenrl's colocated loop on actors: each
# device samples and trains with one model (no engine switch) and trains on the log-probs stored at sampling
# (no recompute), i.e. Flow-GRPO's own loop (``peers.colocated-flowgrpo``) with TSP-packed training.
OWN_COSTS: dict[str, dict[str, object]] = {"colocated-tsp": {"old_logprob_passes": 0.0, "phase_switches": False}}


def schedule_params(schedule: str) -> CostParams:
    """The frozen parameters as ``schedule`` (a name of ``SCHEDULES``) pays them: :data:`OWN_COSTS` applied."""
    return dataclasses.replace(calibrated_params(), **OWN_COSTS.get(schedule, {}))  # type: ignore[arg-type]


def fitted_source(params: CostParams | None = None) -> str:
    """``fitted veRL-Omni utilisations (rollout MFU 0.379, train 0.162)``: the default cost source."""
    p = params or calibrated_params()
    return f"fitted veRL-Omni utilisations (rollout MFU {p.mfu_rollout:.3f}, train {p.mfu_train:.3f})"


def cost_source(prof: ModelProfile | None, measured: MeasuredCost | None = None,
                params: CostParams | None = None) -> str:
    """What priced a simulation: ``measured`` costs (their file), else the fitted utilisations on ``prof``'s FLOPs."""
    if measured is not None:
        return measured.describe()
    if prof is None:
        raise ValueError("cost_source: a profile or measured costs")
    return f"{fitted_source(params)} on the {prof.describe()}"
