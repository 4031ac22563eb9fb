"""Every compute path with its model on another device than the host (DESIGN §9).

On a GPU the first training step of every run once failed: the trainer built its batch from
fragments that arrived over the wire (decoded on the host) and handed them to a model on ``cuda:0``.
A model on the ``meta`` device fails the same way on any host tensor that reaches it ("Tensor on
device cpu is not on the expected device meta!"), so these tests run each path with its network
there: the rows, conditionings and advantages a role receives must be placed on its device by the
role, once. The inputs come from a real actor on the host (a CPU engine, the wire format); meta
tensors have no values, so what is asserted is that every pass ran and left its gradients on the
model's device (the numbers themselves are tested on CPU elsewhere).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from digenrl.actors.base import ActorRef
from digenrl.config import config_from_dict
from digenrl.data.prompts import load_prompts
from digenrl.models import repeat_cond
from digenrl.recipes import colocated
from digenrl.rl.advantages import group_advantages
from digenrl.rl.noise import initial_keys, initial_latents, transition_noise
from digenrl.rl.rollout import rollout_steps
from digenrl.rl.steps import plan_steps
from digenrl.roles.rollout import RolloutActor
from digenrl.roles.trainer import TrainerActor

STEPS = 4
GEO = [1, 0, 0, 2, 0, 2, 2]  # batch 1, fragment 0: prompts 0..1, members 0..1 of groups of 2
EDIT = Path(__file__).resolve().parents[2] / "examples" / "edit"


def _family_conf(name: str) -> dict[str, Any]:
    """A tiny model of each family whose inputs differ: Qwen-Image's text, SD3's pooled embeddings and three
    encoders, Wan2.2 TI2V-5B's per-token timesteps, Qwen-Image-Edit's input-image latents beside the text.

    Wan2.2 A14B is not here: it routes each row to an expert by its sigma's value, and a meta tensor has
    none (its expert passes are tested on CPU, tests/e2e/test_new_models.py).
    """
    model: dict[str, Any] = {"name": name, "preset": "tiny"}
    conf: dict[str, Any] = {"model": model, "data": {}}
    if name in ("sd3", "wan22"):
        model.update(resolution=[32, 32], text_len=8)
    if name == "wan22":
        model.update(variant="TI2V-5B")
    if name == "qwenimage_edit":
        model.update(resolution=[32, 32])
        conf["data"] = {"prompt_file": str(EDIT / "prompts.jsonl")}
    return conf


FAMILIES = ["qwenimage", "sd3", "wan22", "qwenimage_edit"]


@dataclass
class Family:
    conf: dict[str, Any]
    prompts: list[str]


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> Family:
    base = _family_conf(request.param)
    conf = {**base,
            "rollout": {"num_steps": STEPS, "group_size": 2, "prompts_per_batch": 2},
            "train": {"kl_beta": 0.04, "check_parity": True},
            "schedule": {"name": "async1"}}
    cfg = config_from_dict(conf)
    return Family(conf, list(load_prompts(prompt_file=cfg.data.prompt_file) if cfg.data.prompt_file else
                              ["a red square", "a blue circle", "a green square", "a white circle"]))


async def _actor(family: Family, cls: type, name: str, **kwargs: Any) -> Any:
    """A role actor as a plain object (no actor system): ``setup`` builds its model on the host."""
    actor = cls(config_from_dict(family.conf).to_dict(), **kwargs)
    actor._digenrl_ref = ActorRef(name, f"inproc://{name}")
    await actor.setup()
    return actor


def _to_meta(model: Any) -> None:
    """Put the network that computes velocities on the meta device (its LoRA adapters with it)."""
    model.transformer.to("meta")
    assert model.device.type == "meta"


def _discarded(model: Any) -> tuple[str, ...]:
    """Trained weights whose output the model discards: they get no gradient on any device.

    Qwen-Image's last block computes a text-stream output that the model discards.
    """
    if model.name in ("qwenimage", "qwenimage_edit"):
        last = len(model.transformer.transformer_blocks) - 1
        return (f"transformer_blocks.{last}.attn.to_add_out.", f"transformer_blocks.{last}.txt_mlp.")
    return ()


def _grads_on_meta(model: Any) -> bool:
    """Every trained weight the velocity depends on got its gradient, on the model's device."""
    discarded = _discarded(model)
    trained = [(n, p) for n, p in model.transformer.named_parameters() if p.requires_grad]
    missing = [n for n, p in trained if (p.grad is None) != n.startswith(discarded)]
    assert not missing, missing[:8]
    return bool(trained) and all(p.grad.device.type == "meta" for _, p in trained if p.grad is not None)


@pytest.fixture
async def host_rollout(family: Family) -> Any:
    """A rollout actor on the host holding fragment GEO, version 0, advanced to step 2."""
    actor = await _actor(family, RolloutActor, "rollout-0")
    frag = actor.engine.fresh(GEO, 0, family.prompts)
    actor.engine.advance([frag], 0, 2)
    actor.engine.fragments[frag.key] = frag
    yield actor
    await actor.__cleanup__(None)


async def test_rollout_continues_a_handed_over_fragment_on_its_device(family: Family, host_rollout: Any) -> None:
    device_rollout = await _actor(family, RolloutActor, "rollout-1")
    try:
        _to_meta(device_rollout.engine.model)
        device_rollout.peers = {"rollout-0": host_rollout}  # take_fragment answers with the wire form (host)
        frag = await device_rollout._obtain(GEO, "rollout-0", 0, family.prompts, 2)
        device_rollout.engine.advance([frag], 2, STEPS)
        assert frag.step == STEPS and frag.x.device.type == "meta"
        rows = frag.transitions()
        assert {k for k, v in rows.items() if v.device.type == "meta"} == {
            "x", "x_next", "sigma", "sigma_next", "log_prob", "noise_level"}
        assert rows["sample"].device.type == "cpu"  # indices stay on the host
    finally:
        await device_rollout.__cleanup__(None)


async def test_trainer_generates_from_a_handed_over_fragment_on_its_device(family: Family, host_rollout: Any) -> None:
    """TAG: a trainer continues a rollout actor's fragment with its own (newest) weights."""
    trainer = await _actor(family, TrainerActor, "trainer-0", staleness=1)
    try:
        _to_meta(trainer.model)
        trainer.peers = {"rollout-0": host_rollout}
        frag = await trainer._obtain(GEO, "rollout-0", 0, family.prompts, 2)
        trainer._rollout_compute([frag], 0, 2, STEPS)
        assert frag.step == STEPS and frag.transitions()["x_next"].device.type == "meta"
    finally:
        await trainer.__cleanup__(None)


def _train_token(frag_version: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rows = 4 * (STEPS - 1)  # 4 samples, every step but the last trained
    token = {"batch": GEO[0], "frags": [GEO[1:]], "rows": [[0, rows]], "packed": True}
    return token, [{"adv": [1.0, -1.0, 0.5, -0.5], "keep": [True] * 4, "store": "trainer-0"}]


async def _stored_trainer(family: Family, version: int) -> Any:
    """A trainer holding GEO's scored fragment (generated by a host engine with ``version``), as sent over the wire."""
    trainer = await _actor(family, TrainerActor, "trainer-0", staleness=1)
    frag = trainer.engine.fresh(GEO, version, family.prompts)  # (the trainer's engine still on the host)
    trainer.engine.advance([frag], 0, STEPS)
    await trainer.store_fragment.call(frag.to_wire(with_latents=False))
    return trainer


async def test_trainer_trains_rows_that_arrived_on_the_host_on_its_device(family: Family) -> None:
    trainer = await _stored_trainer(family, version=1)
    try:
        await trainer.optim.call(0, 0)  # version 1: the fragment is on-policy
        _to_meta(trainer.model)
        token, frags = _train_token(1)
        out = await trainer.train.call(token, frags)
        assert out["rows"] == [[0, 0, 12, 12]]
        assert _grads_on_meta(trainer.model)
        parity = [s for s in out["sums"] if "parity_rows" in s]
        assert parity and parity[0]["parity_rows"] == 12  # the training pass measured parity (on-policy)
        assert math.isnan(out["sums"][0]["ratio"])  # a meta tensor reads as NaN, never a made-up value
    finally:
        await trainer.__cleanup__(None)


async def test_stale_rows_recompute_parity_under_the_behaviour_weights_on_its_device(family: Family) -> None:
    """async1: rows sampled by version 0 trained into version 2; parity recomputed under version 0's weights."""
    trainer = await _stored_trainer(family, version=0)
    try:
        await trainer.optim.call(0, 0, keep_previous=True)  # version 1, keeping version 0's weights (on the host)
        _to_meta(trainer.model)
        token, frags = _train_token(0)
        out = await trainer.train.call(token, frags)
        assert _grads_on_meta(trainer.model)
        parity = [s for s in out["sums"] if "parity_rows" in s]
        assert len(parity) == 1 and parity[0]["parity_rows"] == 12  # the recompute's sample: all 12 rows
    finally:
        await trainer.__cleanup__(None)


def test_colocated_step_trains_on_its_device_with_advantages_from_the_host(family: Family) -> None:
    """The colocated loop: rollout on the device, the reward's advantages from the host, backward on the device."""
    cfg = config_from_dict({**family.conf, "schedule": {"name": "colocated"}})
    run = colocated.setup(cfg)
    g = cfg.rollout.group_size
    cond = repeat_cond(run.model.encode_prompts(family.prompts[:2]), g)
    _to_meta(run.model)
    cond = {k: v.to("meta") for k, v in cond.items()}  # the prompt embeddings as a text encoder on the device leaves them
    groups = torch.arange(2).repeat_interleave(g)
    sids = list(range(2 * g))
    x0 = initial_latents(run.model, 0, 0, initial_keys(sids, g, False))
    plan = plan_steps(STEPS, groups)
    res = rollout_steps(run.model.velocity, x0, cond, run.sigmas, plan, 0, STEPS, noise_level=0.7,
                        noise=lambda i: transition_noise(0, 0, sids, i, x0, active=plan.stochastic[:, i]))
    assert res.x.device.type == "meta" and res.transitions.sigma.device.type == "meta"
    adv = group_advantages(torch.tensor([0.2, 0.9, 0.4, 0.1]), groups)  # a reward's scores: on the host
    sums = colocated._backward(run, res.transitions, cond, adv.advantages)
    assert sums and _grads_on_meta(run.model)


# -- the forward-process paths (train.algorithm = nft): the ODE rollout, rows drawn from clean samples -----------

def _nft(family: Family) -> Family:
    return Family({**family.conf, "train": {"algorithm": "nft", "check_parity": True}}, family.prompts)


async def test_an_ode_fragment_continues_on_its_device_and_ships_its_clean_latent(family: Family) -> None:
    nft = _nft(family)
    host = await _actor(nft, RolloutActor, "rollout-0")
    device_rollout = await _actor(nft, RolloutActor, "rollout-1")
    try:
        frag = host.engine.fresh(GEO, 0, nft.prompts)
        host.engine.advance([frag], 0, 2)  # dpm2's state (the previous x0) travels with the latents
        host.engine.fragments[frag.key] = frag
        _to_meta(device_rollout.engine.model)
        device_rollout.peers = {"rollout-0": host}
        moved = await device_rollout._obtain(GEO, "rollout-0", 0, nft.prompts, 2)
        device_rollout.engine.advance([moved], 2, STEPS)
        rows = moved.transitions()
        assert moved.step == STEPS and rows["y"].device.type == "meta" and rows["sample"].device.type == "cpu"
        assert rows["probe"].device.type == "meta"  # recorded at step 0 on the host actor, placed with the fragment
    finally:
        await host.__cleanup__(None)
        await device_rollout.__cleanup__(None)


async def test_a_trainer_trains_forward_process_rows_from_the_host_on_its_device(family: Family) -> None:
    """Rows drawn from clean samples that arrived on the host (their noise drawn there too), with the old policy's
    and the trained forwards, the parity recompute, and the old policy following the step, all on the device."""
    trainer = await _stored_trainer(_nft(family), version=0)
    try:
        _to_meta(trainer.model)
        trainer.algorithm.copy.state = {k: v.to("meta") for k, v in trainer.algorithm.copy.state.items()}
        k = trainer.algorithm.rows_per_sample
        token = {"batch": GEO[0], "frags": [GEO[1:]], "rows": [[0, 4 * k]], "packed": True}
        out = await trainer.train.call(token, [{"adv": [1.0, -1.0, 0.5, -0.5], "keep": [True] * 4, "store": "trainer-0"}])
        assert out["rows"] == [[0, 0, 4 * k, 4 * k]]
        assert _grads_on_meta(trainer.model)
        parity = [s for s in out["sums"] if s.get("parity_rows")]
        assert parity and parity[0]["parity_rows"] == 4  # every sample's first-step probe recomputed (on-policy)
        await trainer.optim.call(0, 4 * k)
        assert all(v.device.type == "meta" for v in trainer.algorithm.copy.state.values())
    finally:
        await trainer.__cleanup__(None)


def test_a_colocated_forward_process_step_trains_on_its_device(family: Family) -> None:
    nft = _nft(family)
    cfg = config_from_dict({**nft.conf, "schedule": {"name": "colocated"}})
    run = colocated.setup(cfg)
    g = cfg.rollout.group_size
    cond = repeat_cond(run.model.encode_prompts(nft.prompts[:2]), g)
    _to_meta(run.model)
    run.algorithm.copy.state = {k: v.to("meta") for k, v in run.algorithm.copy.state.items()}
    cond = {k: v.to("meta") for k, v in cond.items()}
    sids = list(range(2 * g))
    x0 = initial_latents(run.model, 0, 0, sids).to("meta")
    clean, probe = colocated._integrate(run.model, x0, cond, run.sigmas, "dpm2", 0)
    assert clean.device.type == "meta" and probe.device.type == "meta"
    k = run.algorithm.rows_per_sample
    rows = run.algorithm.token_rows({"y": clean, "probe": probe}, (0, 4 * k), torch.ones(4, dtype=torch.bool), 0,
                                    sids, 0).to("meta")
    adv = group_advantages(torch.tensor([0.2, 0.9, 0.4, 0.1]), torch.arange(2).repeat_interleave(g))
    sums = colocated._backward(run, rows, cond, adv.advantages)
    assert sums and _grads_on_meta(run.model)


# -- MixGRPO-Flash: the SDE window, then a DPM-Solver tail whose state travels with the fragment ------------------

async def test_a_flash_fragment_continues_its_tail_on_its_device(family: Family) -> None:
    flash = Family({**family.conf, "train": {"algorithm": "mixgrpo", "check_parity": True},
                    "mixgrpo": {"window": 1, "flash": True}}, family.prompts)
    host = await _actor(flash, RolloutActor, "rollout-0")
    device_rollout = await _actor(flash, RolloutActor, "rollout-1")
    try:
        frag = host.engine.fresh(GEO, 0, flash.prompts)
        host.engine.advance([frag], 0, 2)  # the window (step 0) and the tail's first step: x0 rides along
        assert frag.x0 is not None
        host.engine.fragments[frag.key] = frag
        _to_meta(device_rollout.engine.model)
        device_rollout.peers = {"rollout-0": host}
        moved = await device_rollout._obtain(GEO, "rollout-0", 0, flash.prompts, 2)
        device_rollout.engine.advance([moved], 2, STEPS)
        rows = moved.transitions()
        assert moved.step == STEPS and moved.x.device.type == "meta" and rows["x"].device.type == "meta"
        assert rows["step"].tolist() == [0] * moved.num_samples  # the window's transition, its index on the host
    finally:
        await host.__cleanup__(None)
        await device_rollout.__cleanup__(None)
