"""Config loading and validation, and the thin `digenrl validate` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digenrl.config import ACTOR_SCHEDULES, Config, apply_overrides, config_from_dict, load_config, parse_override
from digenrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-qwenimage.toml"


def test_shipped_config_loads_with_overrides() -> None:
    cfg = load_config(TINY, ["train.lr=1e-3", "rollout.steps=window", "reward.weights={jpeg_compressibility=1.0}",
                             "data.prompts=['a red square', 'a blue square']"])
    assert isinstance(cfg, Config)
    assert cfg.train.lr == 1e-3 and cfg.rollout.steps == "window"
    assert cfg.reward.weights == {"jpeg_compressibility": 1.0}
    assert cfg.data.prompts == ["a red square", "a blue square"]
    assert cfg.model.name == "qwenimage" and cfg.placement.threads == 2
    with pytest.raises(AttributeError):
        cfg.train.lr = 1.0  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.kl=l3", r"train.kl: 'l3' is not allowed; allowed: 'exact', 'g2'"),
        ("train.lrr=1", r"train.lrr: unknown key; allowed in \[train\]: algorithm, iterations, lr"),
        ("trian.lr=1", r"\[trian\]: unknown table; allowed: model, rollout"),
        ("train.lr=fast", r"train.lr: must be a number, got 'fast'"),
        ("train.lr=-1", r"train.lr: must be > 0"),
        ("rollout.sde=ode", r"rollout.sde: 'ode' is not allowed; allowed: 'sde', 'wan', 'dance', 'cps'"),
        ("rollout.group_size=1", r"rollout.group_size: must be >= 2"),
        ("rollout.window=99", r"rollout.window: must be in 1\.\.2 \(rollout.num_steps - 1"),
        ("rollout.window_range=[4,5]", r"rollout.window_range: must be \[\] or \[lo, hi\] with 0 <= lo <= hi <= 1"),
        ("model.name=sd9", r"model.name: 'sd9' is not allowed; allowed: 'qwenimage', .*'flux'.*'sd3'"),
        ("model.preset=pretrained;model.vae_init=signal;model.init=''", r"model.vae_init: must be 'default' for pretrained weights"),
        ("model.preset=pretrained", r"model.init: must be '' for preset 'pretrained' \(use model.path\)"),
        ("model.preset=pretrained;model.init=''", r"model.path: must be set for preset 'pretrained'"),
        ("model.vae_init=signal", r"model.vae_init: must be 'default' with model.init"),
        ("reward.weights={imagereward=1.0}", r"reward.weights.imagereward: 'imagereward' is not allowed"),
        ("reward.weights={aesthetic=1.0}", r"reward.models.aesthetic.path: the 'aesthetic' reward needs it"),
        ("reward.weights={remote=1.0}", r"reward.url: must be set when 'remote' is weighted"),
        ("data.prompt_set=imagenet", r"data.prompt_set: 'imagenet' is not allowed; allowed: 'color', 'simple', 'shapes', 'ocr'"),
        ("schedule.name=magic", r"schedule.name: 'magic' is not allowed; allowed: 'colocated', 'colocated-tsp', 'disaggregated'"),
        ("schedule.mode=colocated", r"schedule.mode: renamed to schedule.name"),
        ("placement.processes=1", r"placement.processes: removed"),
        ("transport.kind=inproc", r"transport.kind: removed"),
        ("placement.rollot=1", r"placement.rollot: unknown key; allowed in \[placement\]: threads, rollout, trainer"),
        ("train.betas=[0.9]", r"train.betas: must be two values"),
        ("rollout.num_steps=2.5", r"rollout.num_steps: must be of type int"),
        ("schedule.step_chunk=-1", r"schedule.step_chunk: must be a positive integer \(0 = the schedule's default\)"),
        ("schedule.tag_steps=1.5", r"schedule.tag_steps: must be of type int"),
        ("placement.trainer=0", r"placement.trainer: must be >= 1, got 0"),
        ("placement.rollout=true", r"placement.rollout: must be of type int"),
        ("transport.weights=rdma", r"transport.weights: 'rdma' is not allowed; allowed: 'zmq', 'gloo', 'nccl', 'cuda_ipc'"),
        ("transport.weights=torchdist", r"transport.weights: 'torchdist' was replaced by 'gloo'"),
        ("transport.weights=nccl", r"transport.weights = 'nccl' moves CUDA buffers, but model.device = 'cpu'"),
        ("transport.actors=inproc;transport.weights=gloo", r"transport.weights: must be 'zmq' .* transport.actors = 'inproc'"),
        ("transport.bucket_mb=0", r"transport.bucket_mb: must be > 0"),
        ("log.keep_checkpoints=0", r"log.keep_checkpoints: must be >= 1"),
        ("log.trace=1", r"log.trace: must be of type bool"),
        ("placement.workers=1", r"placement.workers = 1: one actor process per joined worker needs at least 2"),
        ("placement.workers=2", r"needs transport.actors = 'zmq' and transport.address = 'tcp://"),
        ("transport.address=http://127.0.0.1:5555", r"transport.address: must be an address starting with tcp:// or ipc://"),
        ("transport.address=tcp://127.0.0.1", r"transport.address: must be tcp://HOST:PORT with a port in 0\.\.65535"),
        ("transport.address=tcp://127.0.0.1:99999", r"transport.address: must be tcp://HOST:PORT"),
        ("transport.address=tcp://0.0.0.0:5555", r"transport.address: must be one interface of this host .*not a wildcard"),
        ("transport.address=inproc://x", r"transport.address: must be an address starting with tcp:// or ipc://"),
        ("transport.actors=inproc;transport.address=tcp://127.0.0.1:0", r"transport.address: must be an address starting with inproc://"),
        ("schedule.name=gap;placement.rollout=0", r"placement.rollout = 0 needs a schedule with TAG \(tag, async1\), not 'gap'"),
        ("schedule.name=colocated-tsp", r"schedule.name = 'colocated-tsp' runs placement.trainer actors that each "
                                        r"sample and train; set placement.rollout = 0 \(got 1\)"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, override.split(";"))


def test_the_window_keys_bind_only_the_window_mode() -> None:
    """Fewer steps under all_but_last need no new window: the default window = 2 of a 2-step run is not refused
    (it was, naming a key the user never set); in window mode it still is."""
    two = load_config(TINY, ["rollout.steps=all_but_last", "rollout.num_steps=2", "rollout.window=2",
                             "rollout.window_range=[]"])
    assert two.rollout.num_steps == 2
    with pytest.raises(ConfigError, match=r"rollout.window: must be in 1\.\.1"):
        load_config(TINY, ["rollout.num_steps=2", "rollout.window=2", "rollout.window_range=[]"])


def test_actor_settings_load_with_overrides() -> None:
    cfg = load_config(TINY, ["schedule.name=async1", "schedule.step_chunk=2", "placement.rollout=2"])
    assert (cfg.schedule.name, cfg.placement.rollout, cfg.placement.trainer, cfg.transport.actors) == ("async1", 2, 1, "zmq")
    # The override replaces the config's step_chunk; the config's other token sizes stay, unset ones are left out.
    assert cfg.schedule_options == {"fragment_groups": 16, "step_chunk": 2, "train_pack": 128, "tag_steps": 3}
    assert cfg.rollout.group_size == 8 and cfg.disaggregated
    off = load_config(TINY, ["schedule.name=colocated", "schedule.step_chunk=0"])
    assert not off.disaggregated and "step_chunk" not in off.schedule_options
    assert load_config(TINY).disaggregated and not Config().disaggregated and Config().schedule_options == {}
    assert ACTOR_SCHEDULES == ("colocated-tsp", "disaggregated", "gap", "tsp", "tag", "async1")
    # Trainers generate everything when there is no rollout actor (TAG).
    assert load_config(TINY, ["placement.rollout=0"]).placement.rollout == 0


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_configs_round_trip_through_their_json(path: Path) -> None:
    """``config.json`` (what a run directory keeps) rebuilds the same Config, token sizes included."""
    cfg = load_config(path, ["schedule.fragment_members=3"])
    again = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.schedule_options == cfg.schedule_options
    assert again.schedule_options["fragment_members"] == 3


def test_override_parsing() -> None:
    assert parse_override("a.b=1e-3") == (["a", "b"], 1e-3)
    assert parse_override("a.b=word") == (["a", "b"], "word")
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    with pytest.raises(ConfigError, match="expected table.key=value"):
        parse_override("a.b")
    with pytest.raises(ConfigError, match="must be table.key"):
        parse_override("lr=1")
    assert apply_overrides({"t": {"x": 1}}, ["t.y=2"]) == {"t": {"x": 1, "y": 2}}


def test_defaults_and_missing_file(tmp_path: Path) -> None:
    assert config_from_dict({}) == Config()
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_validate_command() -> None:
    from digenrl_cli.main import app

    runner = CliRunner()
    ok = runner.invoke(app, ["validate", str(TINY)])
    assert ok.exit_code == 0 and "ok (qwenimage/tiny" in ok.output
    bad = runner.invoke(app, ["validate", str(TINY), "--set", "train.kl=l3"])
    assert bad.exit_code == 2 and "train.kl" in bad.output
