"""Paper-scale scenarios: the four models on 16 and 32 GPUs, a heterogeneous testbed, a scaling sweep.

Recipes (ALGORITHM.md (b); every figure is the per-optimizer-step batch, kept fixed across GPU counts):

- Qwen-Image-20B: veRL-Omni / flow_grpo Qwen recipe, 32 prompts x G 16, 10 steps, SDE window of 2
  trained steps, true CFG, LoRA r64.
- FLUX.1-12B: DanceGRPO, 32 prompts x G 12, 16 steps at 720^2, trains int(0.6 x 15) = 9 random steps
  per sample, full fine-tune.
- Wan2.1-14B: flow_grpo Wan recipe, 32 prompts x G 4, 20 steps, trains 19 (all but the last),
  240x416x33 frames, CFG, LoRA r32.
- HunyuanVideo-13B: DanceGRPO, 16 prompts x G 24, 16 steps at 480^2 x 53 frames, best-of-n trains 8 of
  the 24 samples on 9 steps each; the workload carries that as 9 x 8/24 = 3 trained steps per sample
  (same training FLOPs, every sample's trajectory still generated and scored).

Forward-process scenarios (``kind = "forward"``, ALGORITHMS-FORWARD.md §3): the rollout is a deterministic ODE
sampler without CFG that ships each sample's clean latent, and a trained "step" is a noise level the trainer
draws, each row a forward + backward plus the no-grad forwards of its loss (``profiles.RowCost``):

- SD3.5-M DiffusionNFT (NVlabs/DiffusionNFT config/nft.py, the reference recipe): 48 prompts x G 24 per
  optimizer step, 10 dpm2 steps at guidance 1.0, 9 noise levels, old policy + reference (KL 1e-4) forwards,
  LoRA r32 on attention; on 8 H800 (the reference's 8 GPUs) and 16.
- Qwen-Image DiffusionNFT (veRL-Omni examples/diffusionnft_trainer/qwen_image): 24 prompts x G 16, 10 steps at
  true-CFG 1.0, all 10 levels (timestep_fraction 1.0), old policy + reference (ref_kl_coef 1e-4), LoRA r64.
- The SD3.5-M recipe on 8 H800 trainers and 4 L40S that only sample (the cheap GPUs' share of an NFT batch is
  small: its training is ~5x its rollout).

MixGRPO scenarios (``kind = "window"``, ALGORITHMS-FORWARD §2, Tencent-Hunyuan/MixGRPO's FLUX scripts): FLUX.1-dev
at 720^2, 32 prompts x G 12, 25 steps, the SDE in a window of 4 steps (4 trained transitions per sample), full
fine-tune, on the reference's 32 GPUs (as H800). MixGRPO runs all 25 forwards whatever the window; Flash runs the
window's end plus a DPM-Solver tail of 0.4x the remaining steps: 11 forwards at start 0, up to 24 at start 19
(``digenrl/sim/window.py``). The recipe moves the window every 20 optimizer steps; the scenario moves it every
batch, so the simulated run's 20 batches cross the whole cycle (each start's batches cost what they cost in the
recipe; the run's mean is the cycle's).

Disaggregated split: for a homogeneous testbed the rollout/trainer split balances one batch's rollout
device-seconds against its training device-seconds under the fixed cost model
(``n_rollout = round(N * R / (R + T))``, at least one of each). The heterogeneous testbed splits by
hardware (generation on L40S, training on H800).

A scenario is priced with the fitted cost model on its profile (``profile(model, variant)``) or, given a
``MeasuredCost`` (``bench bubbles --costs``), with the token costs a ``bench bubbles --real`` run measured
on one device type: then every pool must be of that type (``MeasuredCost.check_fleet``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from digenrl.errors import ConfigError
from digenrl.schedule.base import Device, Role, Workload
from digenrl.sim.calibration import calibrated_params
from digenrl.sim.cost import CostModel, CostParams
from digenrl.sim.devices import DeviceSpec, device_spec
from digenrl.sim.links import Link
from digenrl.sim.measured import MeasuredCost
from digenrl.sim.profiles import ModelProfile, RowCost, clean_sample_rows, profile
from digenrl.sim.flops import SampleShape
from digenrl.sim.sequence import SequenceRuns, group_devices, group_speedup
from digenrl.sim.window import SlidingWindow

__all__ = ["Scenario", "PlannedSplit", "SCENARIOS", "scenario", "placement", "measured_placement",
           "balanced_split"]

DEFAULT_BATCHES = 20


@dataclass(frozen=True, slots=True)
class Scenario:
    """A model recipe on a testbed.

    Attributes:
        name: key (``--scenario``).
        model: ``profiles.PROFILES`` key.
        prompts: prompts per logical batch; ``group_size``, ``num_steps``, ``trained_steps`` as in Workload.
        pools: ``(device type, count)`` per pool of the testbed.
        rollout_pool: for heterogeneous testbeds, the device type that generates in disaggregated
            schedules (the others train); ``""`` = choose the split by the cost model.
        kind: ``paper``, ``hetero``, ``scaling``, ``forward`` or ``user``.
        variant: the model's size (``flops.VARIANTS``); ``""`` = the paper recipe's own (the largest).
        passes: transformer passes per velocity when the recipe's CFG differs from the paper profile's (a
            forward-process recipe samples and trains at guidance 1: 1); 0 = the profile's.
        rows: what the recipe's algorithm adds per row and ships per sample (None: the profile's, Flow-GRPO's).
        recipe: where the recipe comes from (the profile's ``recipe`` when it is changed).
        config: the shipped config (``configs/<config>.toml``) the planner plans it with; ``""`` = the model's.
        window: a sliding SDE window whose rollout forwards move with the version (None: every step runs one).
        links: ``(device type, link)`` of each pool that is a far site behind a link (``links.py``); () = one fabric.
        full_finetune: train (and publish) the whole transformer instead of the recipe's LoRA adapter.
    """

    name: str
    model: str
    prompts: int
    group_size: int
    num_steps: int
    trained_steps: int
    pools: tuple[tuple[str, int], ...]
    rollout_pool: str = ""
    kind: str = "paper"
    variant: str = ""
    passes: int = 0
    rows: RowCost | None = None
    recipe: str = ""
    config: str = ""
    window: SlidingWindow | None = None
    links: tuple[tuple[str, Link], ...] = ()
    full_finetune: bool = False
    shape: SampleShape | None = None  # the recipe's sample when it is not the paper profile's (long video)
    sequence: SequenceRuns | None = None  # each run's SP degrees (sim/sequence.py); None: SP 1 everywhere

    @property
    def profile(self) -> ModelProfile:
        """The model's paper recipe at this scenario's size (with the scenario's CFG passes, rows and window)."""
        prof = profile(self.model, self.variant)
        if self.full_finetune:
            prof = replace(prof, trainable_params=prof.transformer_params, recipe=f"{prof.recipe}, full fine-tune")
        if self.shape is not None:
            prof = replace(prof, shape=self.shape, recipe=self.recipe or prof.recipe)
        if not self.passes and self.rows is None and self.window is None:
            return prof
        return replace(prof, cfg_rollout=self.passes or prof.cfg_rollout, cfg_train=self.passes or prof.cfg_train,
                       rows=self.rows or prof.rows, recipe=self.recipe or prof.recipe, window=self.window)

    @property
    def num_devices(self) -> int:
        return sum(n for _, n in self.pools)

    def workload(self, num_batches: int = DEFAULT_BATCHES) -> Workload:
        return Workload(num_batches, self.prompts, self.group_size, self.num_steps, self.trained_steps)

    @property
    def testbed(self) -> str:
        far = dict(self.links)
        return " + ".join(f"{n}x{t}" + (f"@{far[t]}" if t in far else "") for t, n in self.pools)


@dataclass(frozen=True, slots=True)
class PlannedSplit:
    """A placement chosen for one schedule (``digenrl plan --fleet``), replacing the scenario's fixed split.

    Attributes:
        schedule: the schedule it was planned for (other schedules keep the fixed split).
        rollout: rollout devices per device type (the first ones of each pool; the rest train).
        options: ``ScheduleOptions`` overrides it was planned with (tag_steps, fragment_groups, ...).
    """

    schedule: str
    rollout: tuple[tuple[str, int], ...]
    options: tuple[tuple[str, int], ...] = ()


_RECIPES = {  # model -> (prompts, G, steps, trained steps)
    "qwen-image": (32, 16, 10, 2),
    "flux": (32, 12, 16, 9),
    "wan": (32, 4, 20, 19),
    "hunyuan-video": (16, 24, 16, 3),
    # flow_grpo pickscore_sd3 (config/grpo.py): 48 prompts x 24 images per epoch (num_batches_per_epoch 4 x
    # train_batch_size 9 x 32 GPUs), 10 sampling steps, timestep_fraction 0.99 -> 9 trained
    "sd3": (48, 24, 10, 9),
    # veRL-Omni run_wan22_5b_t2v_hpsv3_v1.sh: train_batch_size 64 prompts x rollout.n 8, 10 steps, a 2-step SDE
    # window (at A14B: PROFILES["wan2.2"])
    "wan2.2": (64, 8, 10, 2),
    # flow_grpo counting_qwenimage_edit (config/grpo.py): 32 prompts x 16 images per epoch, 10 steps, no SDE window
    # (every step but the last trained)
    "qwen-image-edit": (32, 16, 10, 9),
}
_SHORT = {"qwen-image": "qwen", "flux": "flux", "wan": "wan", "hunyuan-video": "hunyuan", "sd3": "sd3",
          "wan2.2": "wan22", "qwen-image-edit": "qwenedit"}


def _paper() -> list[Scenario]:
    out = []
    for model, (prompts, g, steps, trained) in _RECIPES.items():
        for n in (16, 32):
            out.append(Scenario(f"{_SHORT[model]}-{n}", model, prompts, g, steps, trained, (("H800", n),)))
    return out


def _scaling() -> list[Scenario]:
    # Weak scaling of the Qwen-Image recipe: one prompt (16 images) per GPU per step.
    prompts, g, steps, trained = _RECIPES["qwen-image"]
    return [Scenario(f"scale-{n}", "qwen-image", max(prompts, n), g, steps, trained, (("H800", n),), kind="scaling")
            for n in (8, 32, 128, 512, 1024)]


_SD3_NFT = ("sd3_nft", "the DiffusionNFT SD3.5-M recipe (NVlabs/DiffusionNFT config/nft.py)")
_QWEN_NFT = ("qwenimage_nft", "veRL-Omni's Qwen-Image DiffusionNFT recipe (examples/diffusionnft_trainer/qwen_image)")


def _nft(name: str, model: str, batch: tuple[int, int, int, int], pools: tuple[tuple[str, int], ...],
         source: tuple[str, str], rollout_pool: str = "") -> Scenario:
    """A DiffusionNFT recipe: ``batch`` = (prompts, G, ODE steps, noise levels), sampled and trained without CFG, the
    clean latent across the boundary, the old policy's and the reference's forwards per row (KL 1e-4)."""
    config, recipe = source
    return Scenario(name, model, *batch, pools, rollout_pool, "forward", passes=1, rows=clean_sample_rows(2),
                    recipe=recipe, config=config)


def _forward() -> list[Scenario]:
    """The forward-process scenarios of the module docstring."""
    sd3, qwen = (48, 24, 10, 9), (24, 16, 10, 10)
    return [_nft("sd3-nft-8", "sd3", sd3, (("H800", 8),), _SD3_NFT),
            _nft("sd3-nft-16", "sd3", sd3, (("H800", 16),), _SD3_NFT),
            _nft("qwen-nft-16", "qwen-image", qwen, (("H800", 16),), _QWEN_NFT),
            _nft("hetero-sd3-nft", "sd3", sd3, (("H800", 8), ("L40S", 4)), _SD3_NFT, rollout_pool="L40S")]


_MIXGRPO = "Tencent-Hunyuan/MixGRPO scripts/finetune/finetune_flux_grpo_MixGRPO*.sh (FLUX.1-dev, 25 steps, W 4)"


# What each modelled peer's sequence parallelism is (SYSTEMS.md §10, 2026-12): veRL-Omni v0.3 has Ulysses SP in its
# actor (one recipe, Qwen-Image at SP 2; no Wan2.1-14B or HunyuanVideo pipeline, video recipes at 8 frames); UniRL
# v0.2 runs Ulysses SP on a folded FSDP2 mesh in its trainer (degree for these models not published); Flow-GRPO,
# DiffusionNFT and Flow-Factory run one diffusers loop without SP.
_LONG_VIDEO_PEERS = (
    ("colocated", (2, 2), "veRL-Omni hybrid: Ulysses in the actor; its one SP recipe is SP 2 (Qwen-Image), no "
                          "pipeline for this model: modelled at that degree"),
    ("colocated-flowgrpo", (1, 1), "Flow-GRPO / DiffusionNFT / Flow-Factory: no SP; memory not checked"),
    ("verl-omni-async", (1, 2), "veRL-Omni actor SP 2 as its one recipe; rollout SP unknown: 1"),
    ("verl-omni-async-lend", (1, 2), "as verl-omni-async"),
    ("unirl", (1, 2), "UniRL: Ulysses on a folded FSDP2 mesh in the trainer, degree unknown: 2; rollout SP unknown: 1"),
)


def _long_video() -> list[Scenario]:
    """Long video (SYSTEMS.md §10): Wan2.1-14B at Flash-GRPO's 480x832 x 81 frames (32,760 tokens a row, one trained
    step, configs/wan_long.toml's batch) and HunyuanVideo-13B at 720p x 129 frames (118,800 video tokens, DanceGRPO's
    batch), each run at its SP (digenrl: the trainer SP 2 the memory plan needs; the peers: ``_LONG_VIDEO_PEERS``)."""
    runs = SequenceRuns((1, 2), _LONG_VIDEO_PEERS)
    wan = SampleShape.from_pixels(81, 480, 832, 512)
    hunyuan = SampleShape.from_pixels(129, 720, 1280, 256)
    return [Scenario("wan-long-16", "wan", 8, 8, 20, 1, (("H100", 16),), kind="long-video", variant="14B",
                     shape=wan, sequence=runs, config="wan_long",
                     recipe="Flash-GRPO's Wan2.1 geometry (480x832 x 81 frames, one trained step), LoRA r32, CFG"),
            Scenario("hunyuan-long-32", "hunyuan-video", 16, 24, 16, 3, (("H100", 32),), kind="long-video",
                     shape=hunyuan, sequence=runs,
                     recipe="DanceGRPO's HunyuanVideo recipe at 720p x 129 frames (as xDiT serves it at SP up to 8)")]


def _window() -> list[Scenario]:
    """The MixGRPO scenarios of the module docstring: the window moving every batch (the recipe: every 20-25)."""
    batch, pools = (32, 12, 25, 4), (("H800", 32),)
    out = []
    for name, window in (("flux-mixgrpo-32", SlidingWindow(25, 4, 1)), ("flux-mixflash-32", SlidingWindow(25, 4, 1, 0.4))):
        forwards = [window.forwards(v) for v in range(window.positions)]
        recipe = (f"{_MIXGRPO}{', Flash 0.4' if window.tail_ratio else ''}; {min(forwards)}..{max(forwards)} rollout "
                  f"forwards a sample as the window moves, mean {window.mean_forwards():.1f}")
        out.append(Scenario(name, "flux", *batch, pools, kind="window", recipe=recipe, config="flux_mixgrpo",
                            window=window))
    return out


def _cross_site() -> list[Scenario]:
    """A 32-H800 training cluster and a 16-A100 inference site behind 1 or 10 Gbit/s (``links.py``), the A100s
    generating: Qwen-Image Flow-GRPO (the veRL-Omni recipe) and DiffusionNFT, LoRA r64 and full fine-tuning. Not in
    the default selection; ``cross_site.py`` adds each its verdict against the training cluster alone."""
    out = []
    for algo, batch in (("", _RECIPES["qwen-image"]), ("nft-", (24, 16, 10, 10))):
        for full in (False, True):
            for gbit in (1, 10):
                name = f"xs-qwen-{algo}{'full' if full else 'lora'}-{gbit}g"
                pools, links = (("H800", 32), ("A100", 16)), (("A100", Link(gbit * 1e9)),)
                sc = (_nft(name, "qwen-image", batch, pools, _QWEN_NFT, rollout_pool="A100") if algo else
                      Scenario(name, "qwen-image", *batch, pools, rollout_pool="A100"))
                out.append(replace(sc, kind="cross-site", links=links, full_finetune=full))
    return out


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        *_paper(),
        Scenario("hetero-flux", "flux", 32, 12, 16, 9, (("H800", 8), ("L40S", 16)), rollout_pool="L40S", kind="hetero"),
        *_forward(),
        *_window(),
        *_long_video(),
        *_scaling(),
        *_cross_site(),
    ]
}


def scenario(name: str) -> Scenario:
    """Built-in scenario by name (user scenario files: :func:`digenrl.sim.user.load_scenario`).

    Raises:
        ConfigError: unknown name; lists the known ones.
    """
    if name not in SCENARIOS:
        raise ConfigError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def balanced_split(sc: Scenario, spec: DeviceSpec, probe: CostModel | MeasuredCost) -> int:
    """Rollout devices of a homogeneous testbed that balance rollout and training time per batch, as ``probe``
    (the fitted cost model on one ``spec`` device, or measured costs) prices them."""
    w = sc.workload(1)
    roll, train = probe.batch_work(w.samples_per_batch, w.prompts_per_batch, w.num_steps, w.rows_per_batch, spec)
    n = sc.num_devices
    return min(n - 1, max(1, round(n * roll / (roll + train))))


def _roles(sc: Scenario, colocated: bool, rollout: dict[str, int] | None,
           balance: CostModel | MeasuredCost) -> tuple[dict[str, DeviceSpec], dict[str, Role]]:
    """Every device of ``sc`` (``<type>-<i>``) with its spec and role; ``balance`` prices the split of a
    homogeneous testbed without a planned split or a rollout pool."""
    specs: dict[str, DeviceSpec] = {}
    for dtype, count in sc.pools:
        spec = device_spec(dtype)
        for i in range(count):
            specs[f"{dtype.lower()}-{i}"] = spec
    names = list(specs)
    if colocated:
        return specs, {n: Role.HYBRID for n in names}
    if rollout is not None:
        index = {n: int(n.rsplit("-", 1)[1]) for n in names}
        return specs, {n: Role.ROLLOUT if index[n] < rollout.get(specs[n].name, 0) else Role.TRAINER for n in names}
    if sc.rollout_pool:
        return specs, {n: Role.ROLLOUT if specs[n].name == sc.rollout_pool else Role.TRAINER for n in names}
    n_roll = balanced_split(sc, specs[names[0]], balance)
    return specs, {n: Role.ROLLOUT if i < n_roll else Role.TRAINER for i, n in enumerate(names)}


def placement(sc: Scenario, colocated: bool, params: CostParams | None = None,
              rollout: dict[str, int] | None = None, sp: tuple[int, int] = (1, 1)) -> tuple[list[Device], CostModel]:
    """Devices (with roles) and the cost model of ``sc`` for a colocated or a disaggregated schedule.

    ``rollout``: a planned split (rollout devices per type, the first of each pool) instead of the
    scenario's own. ``Device.speed`` is peak bf16 FLOP/s relative to an H800, a placement hint for
    the schedule; the cost model itself uses the full device specs.
    """
    params = params or calibrated_params()
    prof = sc.profile
    ref = device_spec("H800").peak_bf16_flops
    probe = CostModel(prof, {"x": device_spec(sc.pools[0][0])}, params, {"x": Role.HYBRID})
    specs, roles = _roles(sc, colocated, rollout, probe)
    if sp != (1, 1):  # SP groups (sim/sequence.py): one simulated actor each, its speedup as the speed hint
        specs, roles, degrees = group_devices(specs, roles, sp)
        cost = CostModel(prof, specs, params, roles, sp=degrees)
        return [Device(n, roles[n], specs[n].peak_bf16_flops / ref * group_speedup(cost, n)) for n in specs], cost
    devices = [Device(n, roles[n], specs[n].peak_bf16_flops / ref) for n in specs]
    return devices, CostModel(prof, specs, params, roles)


def measured_placement(sc: Scenario, colocated: bool, measured: MeasuredCost,
                       rollout: dict[str, int] | None = None) -> tuple[list[Device], MeasuredCost]:
    """:func:`placement` priced with ``measured`` costs: they are already the seconds of the one device type they
    were measured on, so every device has speed 1.

    Raises:
        ConfigError: ``measured`` does not price the scenario's pools (``MeasuredCost.check_fleet``).
    """
    measured.check_fleet([t for t, _ in sc.pools], f"scenario {sc.name} ({sc.testbed})")
    specs, roles = _roles(sc, colocated, rollout, measured)
    return [Device(n, roles[n], 1.0) for n in specs], measured
