"""Config loading and validation, and the thin `digenrl validate` command."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from digenrl.config import Config, apply_overrides, config_from_dict, load_config, parse_override
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
        ("train.lrr=1", r"train.lrr: unknown key; allowed in \[train\]: iterations, lr"),
        ("trian.lr=1", r"\[trian\]: unknown table; allowed: model, rollout"),
        ("train.lr=fast", r"train.lr: must be a number, got 'fast'"),
        ("train.lr=-1", r"train.lr: must be > 0"),
        ("rollout.sde=ode", r"rollout.sde: 'ode' is not allowed; allowed: 'sde', 'wan', 'dance', 'cps'"),
        ("rollout.group_size=1", r"rollout.group_size: must be >= 2"),
        ("rollout.window=99", r"rollout.window: must be in 1\.\.5"),
        ("rollout.window_range=[3,4]", r"rollout.window_range: must be \[\] or \[lo, hi\] with 0 <= lo <= hi <= 3"),
        ("model.name=sd3", r"model.name: 'sd3' is not allowed; allowed: 'qwenimage', 'flux'"),
        ("model.preset=pretrained", r"model.vae_init: must be 'default' for pretrained weights"),
        ("model.preset=pretrained;model.vae_init=default", r"model.path: must be set for preset 'pretrained'"),
        ("reward.weights={aesthetic=1.0}", r"reward.weights.aesthetic: 'aesthetic' is not allowed"),
        ("reward.weights={remote=1.0}", r"reward.url: must be set when 'remote' is weighted"),
        ("data.prompt_set=imagenet", r"data.prompt_set: 'imagenet' is not allowed; allowed: 'color', 'simple', 'ocr'"),
        ("schedule.mode=magic", r"schedule.mode: 'magic' is not allowed"),
        ("train.betas=[0.9]", r"train.betas: must be two values"),
        ("rollout.num_steps=2.5", r"rollout.num_steps: must be of type int"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, override.split(";"))


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
