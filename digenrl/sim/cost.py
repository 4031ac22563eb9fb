"""The first-principles cost model: seconds of each token on each device, from FLOPs and bytes.

A token's time is its FLOPs over (peak bf16 FLOP/s x model FLOP utilisation), plus its bytes over the
link they cross. The only free parameters are the utilisations and the few efficiencies below; each
has a source, and the two utilisations are fitted ONCE to a published colocated run
(``calibration.py``: veRL-Omni Qwen-Image Flow-GRPO LoRA on 4 H800) and then held fixed for every
model, device and schedule. Nothing here knows which schedule is running.

Per token (``F`` = one transformer pass of one sample, ``profiles.ModelProfile.forward_flops``):

- ROLLOUT: samples x steps x cfg_rollout x F, plus the prompt encodings when the trajectory starts. Under a
  sliding window with a compressed tail (``profiles.ModelProfile.window``) only the token's steps below the
  version's forward count run a forward: the rollout's cost moves with the window.
- REWARD: samples x (VAE decode + reward model), both counted FLOPs; the reward model at its own
  utilisation (``mfu_reward``, fitted to veRL-Omni's sync vs async reward step times).
- TRAIN: rows x cfg_train x (``TRAIN_PASSES`` + the algorithm's no-grad forwards per row) x F; TSP-packed rows
  save ``tsp_train_saving``. A colocated (HYBRID) trainer also recomputes the old log-probs of rows that carry
  them (``old_logprob_passes`` forwards per row). What crosses the boundary comes over the network on a
  dedicated trainer: each row's latents (a transition's x_i, x_{i+1}) and each sample's (a clean latent)
  with its conditioning (``profiles.RowCost``: numbers, never an algorithm's name).
- OPTIM: AdamW's memory traffic over HBM, plus a ring all-reduce of the gradients over the trainer
  group (``schedule.cost.ring_allreduce_seconds``: ``2(n-1)/n`` of the gradient bytes over the
  slowest link, NVLink in a node and the NIC across, plus ``2(n-1)`` latencies per 64 MiB bucket;
  what the trainer group's bucketed all-reduce does over NCCL). Full fine-tuning under FSDP moves
  the same gradient bytes as a reduce-scatter; its parameter all-gathers are not charged here.
- PUBLISH: the trainable weights (LoRA adapter or full model, bf16) at the measured NCCL
  broadcast efficiency.
- SP (``sp``: a device that stands for a sequence-parallel group of k devices, ``sequence.py``): ROLLOUT's and
  TRAIN's transformer passes at one rank's share of the compute, plus Ulysses' all-to-alls over the group's link and
  a per-pass overhead; OPTIM's all-reduce runs over every rank of every group.
- SWITCH (colocated): the rollout engine's weights and the trainer's parameter shard over PCIe.
  A TAG helper on a trainer pays the same onload/offload of the rollout weights, charged by the
  simulator on each change between training and helping (``tag_switch_seconds``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from digenrl.errors import ConfigError
from digenrl.schedule.base import Device, Role, Token, TokenKind
from digenrl.schedule.cost import ring_allreduce_seconds
from digenrl.sim.devices import GPUS_PER_NODE, DeviceSpec
from digenrl.sim.profiles import BF16, ModelProfile
from digenrl.sim.sequence import UlyssesCost, ulysses_cost

__all__ = ["CostParams", "CostModel", "TRAIN_PASSES"]

# fwd (1) + bwd (2, grads w.r.t. activations and weights) + activation-checkpoint recompute (1):
# flow_grpo trains Qwen-Image with activation checkpointing, DanceGRPO uses gradient checkpointing.
TRAIN_PASSES = 4.0


@dataclass(frozen=True, slots=True)
class CostParams:
    """The cost model's parameters. Defaults other than the two MFUs are sourced constants.

    Attributes:
        mfu_rollout: utilisation of sampling, VAE decode, text encoding and reward forwards.
            Fitted to veRL-Omni's 107.9 s Qwen-Image generation (``calibration.py``).
        mfu_train: utilisation of the training passes, fitted to the rest of veRL-Omni's 420 s step
            once generation, reward, switches and sync are accounted from first principles. It
            absorbs everything veRL-Omni's trainer does beyond the counted FLOPs (FSDP parameter and
            optimizer offload, old-log-prob recompute, per-timestep loop), and every schedule pays it.
        tsp_train_saving: fraction of training time TSP packing removes. UniRL PR #394 measured
            batched timestep replay cutting the train phase by 15-17 % (FLUX.2-klein 9B and
            HunyuanVideo 1.5 on 8 GPUs); 0.16 is the midpoint.
        weight_sync_efficiency: achieved / line-rate bandwidth of a weight broadcast. verl's
            checkpoint engine moved Qwen3-30B-A3B to 30 receivers at 8.25 GB/s over 400 Gb/s IB
            (50 GB/s): 0.165.
        pcie_efficiency: achieved / nominal host-device copy bandwidth for pinned buffers (about
            50 of 64 GB/s on PCIe Gen5, 25 of 32 on Gen4): 0.8.
        optimizer_bytes_per_param: AdamW with fp32 master weights reads p, g, m, v and writes p, m, v
            (7 x 4 bytes) plus the bf16 copy: 30 bytes per trainable parameter.
        pass_latency_s: host-side latency per transformer pass (launches, Python); 5 ms.
        old_logprob_passes: forward passes per trained row a colocated (veRL-Omni hybrid) trainer
            spends recomputing the old policy's log-probs before the update. veRL-Omni's
            ``docs/algo/rollout_correction.md``: recomputing old log-probs costs about 20 % of a
            step and only its bypass mode skips it; one forward of the four passes a row costs to
            train (``TRAIN_PASSES``) is 15-20 % of the calibrated step. digenrl's rollout stores the
            behaviour log-probs with the trajectory (DESIGN.md §3), so dedicated trainers skip it.
            0 models a baseline in bypass mode.
        trainer_old_logprob_passes: the same recompute on a dedicated (``Role.TRAINER``) trainer. 0 for
            digenrl (stored behaviour log-probs); a peer that recomputes in its disaggregated mode
            (veRL-Omni's async trainer outside bypass mode) sets 1 (``peers.py``).
        phase_switches: a colocated device pays the engine switch between rollout and training
            (veRL-Omni's hybrid engine: vLLM-style sleep/wake and FSDP re-shard). ``False`` models a
            loop that samples and trains with the same weights in one process (Flow-GRPO's own).
        lend_switch_seconds: measured (to helper, back to trainer) seconds of lending a trainer to
            rollout, replacing the first-principles onload/offload (veRL-Omni PR #575: 9.1 s / 3.3 s).
        collective_latency_s: latency of one step of a ring collective (one NCCL message between
            neighbours): about 5 us over NVLink and 10 us over InfiniBand in nccl-tests' small
            message all-reduce times; 10 us, the pessimistic one, for every group.
        grad_bytes: bytes per trainable parameter in the gradient all-reduce; 2 (bf16) as
            veRL-Omni's FSDP reduces (``train.fp32_master`` runs reduce fp32: 4).
        mfu_reward: utilisation of the reward model's forwards (``None``: ``mfu_rollout``). Fitted to
            veRL-Omni's async-reward row: moving Qwen3-VL-8B scoring off the 4 training GPUs took the
            step from 420 s to 360 s (``docs/algo/performance.md``), so scoring 512 images costs about
            60 s on the critical path, far above its counted FLOPs (autoregressive VLM serving).
    """

    mfu_rollout: float
    mfu_train: float
    tsp_train_saving: float = 0.16
    weight_sync_efficiency: float = 8.25 / 50.0
    pcie_efficiency: float = 0.8
    optimizer_bytes_per_param: float = 30.0
    pass_latency_s: float = 0.005
    old_logprob_passes: float = 1.0
    collective_latency_s: float = 10e-6
    grad_bytes: float = BF16
    mfu_reward: float | None = None
    trainer_old_logprob_passes: float = 0.0
    phase_switches: bool = True
    lend_switch_seconds: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.mfu_reward is not None and not 0.0 < self.mfu_reward <= 1.0:
            raise ConfigError(f"cost.mfu_reward={self.mfu_reward!r}: must be in (0, 1] or unset")
        for name in ("mfu_rollout", "mfu_train", "weight_sync_efficiency", "pcie_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ConfigError(f"cost.{name}={value!r}: must be in (0, 1]")


@dataclass(slots=True)
class CostModel:
    """Seconds of a token on a device for one model profile and one placement.

    Args:
        profile: the model and recipe.
        specs: device name -> catalog entry, for every device of the run.
        params: utilisations and efficiencies (fitted once, then fixed).
        roles: device name -> role, used to tell dedicated trainers (which pull trajectories over
            the network) and to size the colocated re-shard.
    """

    profile: ModelProfile
    specs: dict[str, DeviceSpec]
    params: CostParams
    roles: dict[str, Role]
    _node: dict[str, int] = field(default_factory=dict)
    _train_side: int = 1  # devices holding a training shard (trainers or hybrids)
    _k: dict[str, float] = field(default_factory=dict)  # per-token constants, computed once
    _memo: dict[tuple[object, ...], float] = field(default_factory=dict)  # compute seconds by token shape
    # device name -> its sequence-parallel degree (an SP group of that many devices acting as one; sim/sequence.py)
    sp: dict[str, int] = field(default_factory=dict)
    _ulysses: dict[str, UlyssesCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = set(self.roles) - set(self.specs)
        if missing:
            raise ConfigError(f"devices without a catalog entry: {sorted(missing)}")
        prof = self.profile
        self._k = {
            "roll": prof.cfg_rollout * prof.forward_flops, "text": prof.text_flops,
            "decode": prof.decode_flops, "reward": prof.reward_flops, "latent": prof.latent_bytes,
            "train": prof.cfg_train * prof.forward_flops,  # one pass of a row (x its passes, ``_row_passes``)
            "row_bytes": prof.rows.row_latents * prof.latent_bytes + prof.rows.row_scalar_bytes,
            "sample_bytes": (prof.rows.sample_latents * prof.latent_bytes + prof.rows.sample_scalar_bytes
                             + prof.cond_bytes),
        }
        self._train_side = sum(1 for r in self.roles.values() if r in (Role.HYBRID, Role.TRAINER)) or 1
        # Devices fill nodes of GPUS_PER_NODE in the order given, one device type per node.
        counts: dict[str, int] = {}
        for name, spec in self.specs.items():
            i = counts.get(spec.name, 0)
            counts[spec.name] = i + 1
            self._node[name] = hash((spec.name, i // GPUS_PER_NODE))

    @property
    def _mfu_reward(self) -> float:
        return self.params.mfu_reward or self.params.mfu_rollout

    # -- link bandwidths ---------------------------------------------------------------------------

    def link_bytes_per_s(self, a: str, b: str) -> float:
        """Point-to-point bandwidth between two devices: NVLink/PCIe in a node, the NIC across."""
        sa, sb = self.specs[a], self.specs[b]
        if self._node[a] == self._node[b]:
            return sa.intra_node_bytes_per_s
        return min(sa.net_bytes_per_s, sb.net_bytes_per_s)

    def _group_bytes_per_s(self, names: tuple[str, ...]) -> float:
        nodes = {self._node[n] for n in names}
        specs = [self.specs[n] for n in names]
        if len(nodes) == 1:
            return min(s.intra_node_bytes_per_s for s in specs)
        return min(s.net_bytes_per_s for s in specs)

    # -- per-kind seconds --------------------------------------------------------------------------

    def _compute(self, flops: float, spec: DeviceSpec, mfu: float) -> float:
        return flops / (spec.peak_bf16_flops * mfu)

    def seconds(self, token: Token, device: Device) -> float:
        """Predicted seconds of ``token`` on ``device`` (the ``CostEstimate`` protocol).

        Raises:
            ConfigError: the device has no catalog entry.
        """
        spec = self.specs.get(device.name)
        if spec is None:
            raise ConfigError(f"device {device.name!r} has no catalog entry in this cost model")
        kind = token.kind
        if kind is TokenKind.ROLLOUT or kind is TokenKind.REWARD or kind is TokenKind.TRAIN:
            # The compute part depends on a few integers only; a 1024-GPU run asks for the same
            # shapes hundreds of thousands of times (the engine and the schedule's speed tracker).
            key = (kind, device.name, token.num_samples, token.step_start == 0, self._steps(token),
                   token.transitions, token.packed,
                   sum(f.num_prompts for f in token.fragments) if kind is TokenKind.ROLLOUT and token.step_start == 0 else 0)
            base = self._memo.get(key)
            if base is None:
                base = self._memo[key] = self._seconds(token, device, spec)
            return base + self._pull(token, device) if token.sources else base
        return self._seconds(token, device, spec)

    def _steps(self, token: Token) -> int:
        """Denoising steps of a token that run a forward (a ROLLOUT token of a moving window: those below its
        version's forward count; any other token: its step range)."""
        window = self.profile.window
        if window is None or token.kind is not TokenKind.ROLLOUT:
            return token.step_end - token.step_start
        return window.forwards_in(token.policy_version, token.step_start, token.step_end)

    def _seconds(self, token: Token, device: Device, spec: DeviceSpec) -> float:
        """``seconds`` without the latents pulled from other devices."""
        kind = token.kind
        p, k = self.params, self._k
        if kind is TokenKind.ROLLOUT:
            steps = self._steps(token)
            seconds = self._sequence(device.name, self._compute(token.num_samples * steps * k["roll"], spec,
                                                                p.mfu_rollout),
                                     token.num_samples * self.profile.cfg_rollout, steps)
            if token.step_start == 0 and k["text"]:
                seconds += self._compute(sum(f.num_prompts for f in token.fragments) * k["text"], spec, p.mfu_rollout)
            return seconds + steps * p.pass_latency_s
        if kind is TokenKind.REWARD:
            n = token.num_samples
            return (self._compute(n * k["decode"], spec, p.mfu_rollout) + self._compute(n * k["reward"], spec, self._mfu_reward)
                    + p.pass_latency_s)
        if kind is TokenKind.TRAIN:
            return self._train(token, device, spec)
        if kind is TokenKind.OPTIM:
            return self._optim(token, spec)
        if kind is TokenKind.PUBLISH:
            return self.publish_seconds(device.name)
        if kind is TokenKind.SWITCH:
            return self.switch_seconds(device.name)
        raise ConfigError(f"token kind {kind!r} has no cost")

    def ulysses(self, name: str) -> UlyssesCost | None:
        """What device ``name``'s SP group pays beside its compute (None: one device, no sequence parallelism)."""
        degree = self.sp.get(name, 1)
        if degree == 1:
            return None
        if name not in self._ulysses:
            spec = self.specs[name]  # a group inside one node: NVLink (PCIe without); larger ones cross the NIC
            link = spec.intra_node_bytes_per_s if degree <= GPUS_PER_NODE else spec.net_bytes_per_s
            self._ulysses[name] = ulysses_cost(self.profile, degree, link, self.params.collective_latency_s)
        return self._ulysses[name]

    def _sequence(self, name: str, compute_s: float, rows: int, passes: float) -> float:
        """``compute_s`` (one device's) on ``name``'s SP group: ``passes`` passes of ``rows`` rows each."""
        cost = self.ulysses(name)
        return compute_s if cost is None else cost.seconds(compute_s, rows, passes)

    def _pull(self, token: Token, device: Device) -> float:
        """Latents of fragments another device holds, moved before this token runs."""
        seconds = 0.0
        for fragment, source in zip(token.fragments, token.sources):
            if source and source != device.name and source in self.specs:
                size = fragment.num_samples * self._k["latent"]
                seconds += size / self.link_bytes_per_s(source, device.name)
        return seconds

    def row_passes(self, role: Role | None) -> float:
        """Transformer passes of one trained row (per CFG pass) on a device of ``role``: forward + backward +
        recompute (``TRAIN_PASSES``), the algorithm's no-grad forwards, and the old-log-prob recompute of a
        trainer that pays it (rows that carry log-probs only)."""
        p, rows = self.params, self.profile.rows
        recompute = {Role.HYBRID: p.old_logprob_passes, Role.TRAINER: p.trainer_old_logprob_passes}.get(role, 0.0)
        return TRAIN_PASSES + rows.nograd_forwards + (recompute if rows.logprob_rows else 0.0)

    def _train(self, token: Token, device: Device, spec: DeviceSpec) -> float:
        p = self.params
        role = self.roles.get(device.name)
        seconds = self._compute(token.transitions * self.row_passes(role) * self._k["train"], spec, p.mfu_train)
        if token.packed:
            seconds *= 1.0 - p.tsp_train_saving
        seconds = self._sequence(device.name, seconds, token.transitions * self.profile.cfg_train, self.row_passes(role))
        if role is Role.TRAINER:
            # what the rollout side ships crosses the network: each row's latents, each sample's latent and
            # conditioning (pessimistic: a same-node source would use NVLink, and rows of a sample split over two
            # tokens fetch the sample twice)
            moved = token.transitions * self._k["row_bytes"] + token.num_samples * self._k["sample_bytes"]
            seconds += moved / spec.net_bytes_per_s
        return seconds + p.pass_latency_s

    def _optim(self, token: Token, spec: DeviceSpec) -> float:
        group = token.group or (token.device,)
        n = len(group)
        trainable = self.profile.trainable_params
        update = trainable * self.params.optimizer_bytes_per_param / n / spec.hbm_bytes_per_s
        return update + self.allreduce_seconds(group)

    def allreduce_seconds(self, group: tuple[str, ...]) -> float:
        """The gradient all-reduce of one optimizer step over the trainer group ``group``."""
        ranks = sum(self.sp.get(g, 1) for g in group)  # an SP group's ranks hold partial gradients too
        if ranks < 2:
            return 0.0
        return ring_allreduce_seconds(self.params.grad_bytes * self.profile.trainable_params, ranks,
                                      self._group_bytes_per_s(group), self.params.collective_latency_s)

    def publish_seconds(self, source: str) -> float:
        """Broadcast of the trainable weights from ``source`` to the rollout side."""
        spec = self.specs[source]
        return self.profile.publish_bytes / (spec.net_bytes_per_s * self.params.weight_sync_efficiency)

    def switch_seconds(self, name: str) -> float:
        """One colocated phase switch: the rollout engine's full bf16 weights one way over PCIe
        (vLLM sleep/wake) and the FSDP parameter shard the other way; 0 without phase switches."""
        if not self.params.phase_switches:
            return 0.0
        spec = self.specs[name]
        moved = self.profile.weight_bytes * (1.0 + 1.0 / self._train_side)
        return moved / (spec.pcie_bytes_per_s * self.params.pcie_efficiency)

    def helper_switch_seconds(self, device: Device) -> float:
        """``base.SwitchCost``: the schedule's TAG decision charges what the engine charges (per change,
        the mean of the two directions)."""
        return 0.5 * (self.tag_switch_seconds(device.name, True) + self.tag_switch_seconds(device.name, False))

    def tag_switch_seconds(self, name: str, to_helper: bool = True) -> float:
        """A trainer entering (``to_helper``) or leaving helper generation: onload/offload the rollout
        weights, or the measured figures of ``lend_switch_seconds``."""
        if self.params.lend_switch_seconds is not None:
            return self.params.lend_switch_seconds[0 if to_helper else 1]
        spec = self.specs[name]
        return self.profile.weight_bytes / (spec.pcie_bytes_per_s * self.params.pcie_efficiency)

    # -- whole-batch work, for choosing splits -----------------------------------------------------

    def batch_work(self, samples: int, prompts: int, num_steps: int, trained_rows: int, spec: DeviceSpec) -> tuple[float, float]:
        """Device-seconds of rollout (+reward) and of training for one logical batch on ``spec`` (training as
        a dedicated trainer runs it: with the algorithm's no-grad forwards, and ``trainer_old_logprob_passes`` when
        the modelled system recomputes log-probs the rows carry)."""
        p, prof = self.params, self.profile
        steps = num_steps if prof.window is None else prof.window.mean_forwards()  # a moving window: its cycle's mean
        roll = samples * steps * prof.cfg_rollout * prof.forward_flops + prompts * prof.text_flops
        roll += samples * prof.decode_flops
        reward = self._compute(samples * prof.reward_flops, spec, self._mfu_reward)
        train = trained_rows * self.row_passes(Role.TRAINER) * self._k["train"]
        return self._compute(roll, spec, p.mfu_rollout) + reward, self._compute(train, spec, p.mfu_train)
