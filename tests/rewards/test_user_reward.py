"""A reward written in Python (``[reward.models.<name>] python = "file.py:Class"``): the example's scores against
an independent computation, every mistake a user makes as one line naming the key, the failure policy on a bad
score, and the rule that a process imports only the files its own start allowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from digenrl.config import config_from_dict, load_config
from digenrl.errors import ConfigError
from digenrl.rewards import RewardError, build_reward
from digenrl.rewards.user import allow_user_reward, check_user_reward
from digenrl.usercode import USER_CODE_ENV

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rewards" / "brightness.py"
TINY = ROOT / "configs" / "tiny-qwenimage.toml"


def _user(path: Path | str, name: str = "mine", weight: float = 1.0, **settings: object) -> dict:
    return {"weights": {name: weight}, "models": {name: {"python": str(path), **settings}}}


def _build(reward: dict, **options: object):
    cfg = config_from_dict({"reward": reward})
    r = cfg.reward
    return build_reward(r.weights, **{**r.build_options("cpu"), **options})


def _write(tmp_path: Path, body: str, name: str = "mine.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    allow_user_reward(f"{path}:Mine")  # this test process's own config names it
    return path


def _luminance(images: torch.Tensor) -> np.ndarray:
    """Rec. 709 luminance, averaged per image, in float64 numpy (not the example's code)."""
    x = images.double().numpy()
    return (0.2126 * x[:, 0] + 0.7152 * x[:, 1] + 0.0722 * x[:, 2]).reshape(len(x), -1).mean(axis=1)


def test_the_example_scores_the_mean_luminance_and_its_target_setting() -> None:
    allow_user_reward(f"{EXAMPLE}:Brightness")
    images = torch.rand(5, 3, 12, 10, generator=torch.Generator().manual_seed(0))
    prompts = ["a red circle"] * 5
    plain = _build(_user(f"{EXAMPLE}:Brightness", "brightness"))
    np.testing.assert_allclose(plain.score(images, prompts).numpy(), _luminance(images), atol=1e-6)
    targeted = _build(_user(f"{EXAMPLE}:Brightness", "brightness", target=0.25))
    np.testing.assert_allclose(targeted.score(images, prompts).numpy(), 1 - np.abs(_luminance(images) - 0.25), atol=1e-6)
    video = torch.rand(2, 3, 4, 6, 6, generator=torch.Generator().manual_seed(1))  # [B, 3, F, H, W]
    lum = (0.2126 * video[:, 0] + 0.7152 * video[:, 1] + 0.0722 * video[:, 2]).double().flatten(1).mean(1)
    np.testing.assert_allclose(plain.score(video, prompts[:2]).numpy(), lum.numpy(), atol=1e-6)


def test_the_config_takes_a_reward_of_the_users_own_name_from_the_shipped_config() -> None:
    cfg = load_config(TINY, ["reward.weights={brightness = 1.0}",
                             'reward.models.brightness.python="examples/rewards/brightness.py:Brightness"'])
    assert cfg.reward.models["brightness"]["python"] == "examples/rewards/brightness.py:Brightness"
    with pytest.raises(ConfigError, match=r"^reward\.weights\.brightnes: 'brightnes' is not allowed; allowed: .*"
                                          r"or a reward of your own in Python: \[reward\.models\.brightnes\] python"):
        load_config(TINY, ["reward.weights={brightnes = 1.0}",
                           'reward.models.brightness.python="examples/rewards/brightness.py:Brightness"'])


@pytest.mark.parametrize(("python", "message"), [
    ("examples/rewards/brightness.py", r"reward\.models\.mine\.python: must be 'path/to/file\.py:ClassName'"),
    ("rewards.brightness:Brightness", r"reward\.models\.mine\.python: must be 'path/to/file\.py:ClassName'"),
    ("examples/rewards/brightness.py:", r"reward\.models\.mine\.python: must be"),
])
def test_a_misspelt_path_is_refused_as_the_config_loads(python: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"reward": _user(python)})


def test_a_builtin_name_cannot_be_taken_by_a_python_reward() -> None:
    with pytest.raises(ConfigError, match=r"^reward\.models\.color\.python: 'color' is a built-in reward"):
        config_from_dict({"reward": _user(f"{EXAMPLE}:Brightness", "color")})


def test_each_mistake_in_the_file_is_one_line_naming_the_key(tmp_path: Path) -> None:
    def refused(path: Path | str, match: str, **settings: object) -> str:
        allow_user_reward(f"{path}:Mine")  # this test process's own config names it
        with pytest.raises(ConfigError, match=match) as info:
            _build(_user(f"{path}:Mine", **settings))
        assert "\n" not in str(info.value)
        return str(info.value)

    refused(tmp_path / "absent.py", r"^reward\.models\.mine\.python: no file .*absent\.py \(looked for ")
    raising = _write(tmp_path, "import math\n\nRATE = math.sqrt(-1)\n", "raising.py")
    msg = refused(raising, r"^reward\.models\.mine\.python: importing .*raising\.py raised ValueError: math domain")
    assert msg.endswith("(raising.py line 3: RATE = math.sqrt(-1))")
    broken = _write(tmp_path, "class Mine:\n    def score(self images):\n        pass\n", "broken.py")
    assert refused(broken, r"importing .*broken\.py raised SyntaxError").endswith("(broken.py line 2: def score(self images):)")
    missing = _write(tmp_path, "import no_such_package_anywhere\n", "missing.py")
    refused(missing, r"raised ModuleNotFoundError: No module named 'no_such_package_anywhere' \(missing\.py line 1")
    other = _write(tmp_path, "class Other:\n    def score(self, images, prompts):\n        return images[:, 0, 0, 0]\n",
                   "other.py")
    refused(other, r"^reward\.models\.mine\.python: .*other\.py has no attribute 'Mine' \(its classes: Other\)$")
    function = _write(tmp_path, "def Mine(images, prompts):\n    return images.mean((1, 2, 3))\n", "function.py")
    refused(function, r"function\.py:Mine is a function, not a class; name a reward class with a score\(images, prompts\)")
    scoreless = _write(tmp_path, "class Mine:\n    pass\n", "scoreless.py")
    refused(scoreless, r"^reward\.models\.mine\.python: class Mine in .*scoreless\.py has no score\(images, prompts\)")
    allow_user_reward(f"{EXAMPLE}:Brightness")
    with pytest.raises(ConfigError, match=r"^reward\.models\.mine\.targte: Brightness takes no setting 'targte' "
                                          r"\(its settings: target\)$"):
        _build(_user(f"{EXAMPLE}:Brightness", targte=0.5))
    with pytest.raises(ConfigError, match=r"^reward\.models\.mine: Brightness\(target=2\) raised ValueError: target "
                                          r"must lie in \[0, 1\], got 2 \(brightness\.py line \d+: raise ValueError"):
        _build(_user(f"{EXAMPLE}:Brightness", target=2))


_BAD_SCORES = {
    "shape": ("return torch.zeros(len(prompts), 2)", r"returned shape \(4, 2\), expected \[4\] \(one score per image\)"),
    "nan": ("return torch.full((len(prompts),), float('nan'))", r"returned non-finite scores \[nan, nan, nan, nan\]"),
    "none": ("return None", r"returned NoneType, expected 4 numbers"),
    "raises": ("return 1 / 0", r"raised ZeroDivisionError: division by zero \(bad_raises\.py line 6: return 1 / 0\)"),
}


@pytest.mark.parametrize("kind", sorted(_BAD_SCORES))
def test_a_bad_score_is_a_reward_error_under_the_failure_policy(tmp_path: Path, kind: str) -> None:
    body, message = _BAD_SCORES[kind]
    path = _write(tmp_path, f"import torch\n\n\nclass Mine:\n    def score(self, images, prompts):\n        {body}\n",
                  f"bad_{kind}.py")
    images, prompts = torch.rand(4, 3, 8, 8), ["a"] * 4
    with pytest.raises(RewardError, match=rf"reward 'mine' \(bad_{kind}\.py:Mine\.score\) {message}"):
        _build(_user(f"{path}:Mine")).score(images, prompts)
    penalised = _build(_user(f"{path}:Mine") | {"on_error": "penalty", "penalty": -3.0})
    assert penalised.score(images, prompts).tolist() == [-3.0] * 4 and penalised.failures == 1


def test_an_edit_reward_gets_the_sources_and_the_settings_device(tmp_path: Path) -> None:
    path = _write(tmp_path, "class Mine:\n    uses_sources = True\n\n    def __init__(self, device, scale=1.0):\n"
                  "        self.device, self.scale = device, scale\n\n    def score(self, images, prompts, sources):\n"
                  "        return self.scale * (images - sources[:, 0]).abs().mean((1, 2, 3))\n", "edit.py")
    reward = _build(_user(f"{path}:Mine", scale=2.0))
    assert reward.uses_sources and reward.inner.parts["mine"][0].inner.device == "cpu"
    images, sources = torch.rand(3, 3, 4, 4), torch.rand(3, 2, 3, 4, 4)
    expected = 2.0 * (images - sources[:, 0]).abs().mean((1, 2, 3))
    torch.testing.assert_close(reward.score(images, ["x"] * 3, sources=sources), expected)


def test_validate_imports_the_file_but_does_not_build_the_reward(tmp_path: Path) -> None:
    marker = tmp_path / "built"
    path = _write(tmp_path, f"class Mine:\n    def __init__(self, size=1):\n        open({str(marker)!r}, 'w')\n\n"
                  "    def score(self, images, prompts):\n        return images.mean((1, 2, 3))\n")
    check_user_reward("mine", {"python": f"{path}:Mine", "size": 3})
    assert not marker.exists()
    with pytest.raises(ConfigError, match=r"^reward\.models\.mine\.colour: Mine takes no setting 'colour'"):
        check_user_reward("mine", {"python": f"{path}:Mine", "colour": 3})


def _score_in_a_fresh_process(reward: dict, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """What an actor does with the config its spawn message carries: ``config_from_dict``, then its reward."""
    code = ("import json, sys, torch\nfrom digenrl.config import config_from_dict\n"
            "from digenrl.roles.rollout import reward_builder\n"
            "cfg = config_from_dict(json.loads(sys.argv[1]))\n"
            "print(reward_builder(cfg)().score(torch.ones(2, 3, 4, 4), ['a', 'b']).tolist())\n")
    return subprocess.run([sys.executable, "-c", code, json.dumps({"reward": reward})], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env}, cwd=ROOT)


def test_a_config_from_a_message_never_makes_a_process_import_a_file(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    path = tmp_path / "evil.py"
    path.write_text(f"open({str(marker)!r}, 'w').close()\n\nclass Mine:\n    def score(self, images, prompts):\n"
                    "        return images.mean((1, 2, 3))\n")
    refused = _score_in_a_fresh_process(_user(f"{path}:Mine"), {})
    assert refused.returncode != 0
    assert f"reward.models.mine.python: this process was not started with {path}:Mine, so it does not import it" \
        in refused.stderr
    assert not marker.exists()  # refused before a line of it ran
    other = _score_in_a_fresh_process(_user(f"{path}:Mine"), {USER_CODE_ENV: json.dumps([f"{EXAMPLE}:Brightness"])})
    assert other.returncode != 0 and not marker.exists()  # allowing one file allows no other
    # The driver's launch allows it (the environment it gives its actor processes): now it runs.
    allowed = _score_in_a_fresh_process(_user(f"{path}:Mine"), {USER_CODE_ENV: json.dumps([f"{path}:Mine"])})
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.strip() == "[1.0, 1.0]" and marker.exists()


def test_validate_names_a_bad_python_reward_and_leaves_a_file_absent_here_to_its_host() -> None:
    from digenrl.recipes.preflight import preflight, validation

    bad = load_config(TINY, ["reward.weights={brightness = 1.0}",
                             'reward.models.brightness.python="examples/rewards/brightness.py:Brightnes"'])
    with pytest.raises(ConfigError, match=r"^reward\.models\.brightness\.python: .*brightness\.py has no attribute "
                                          r"'Brightnes' \(its classes: Brightness\)$"):
        preflight(bad)
    gpu = load_config(ROOT / "configs" / "qwenimage.toml", ["reward.weights={mine = 1.0}",
                                                            'reward.models.mine.python="/nowhere/mine.py:Mine"'])
    if not torch.cuda.is_available():  # a login node: the file is the run's host's to read
        assert "reward.models: /nowhere/mine.py is not on this host (the host that runs it reads it)" in validation(gpu).left
