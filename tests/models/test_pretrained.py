"""save_pretrained → load_model(preset="pretrained") round trips through diffusers' real from_pretrained."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from digenrl.errors import ConfigError
from digenrl.models import load_model


def _outputs(m, seed=0):
    cond = m.encode_prompts(["a cat", "two dogs on grass"])
    x = m.prepare_latents(2, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        v = m.velocity(x, torch.tensor([0.9, 0.2]), cond)
    return cond, v, m.decode(x), m.sigmas(5)


@pytest.fixture(scope="module")
def saved_qwen(tmp_path_factory):
    m = load_model("qwenimage", "tiny", seed=3)
    m.decode(m.prepare_latents(1, torch.Generator().manual_seed(0)))  # leaves the VAE's weights channels-last
    d = tmp_path_factory.mktemp("qwen_tiny")
    m.save_pretrained(d)
    return m, d


def test_qwen_pretrained_roundtrip_identical(saved_qwen, monkeypatch):
    m, d = saved_qwen
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("qwenimage", "pretrained", path=d, resolution=(64, 64), text_len=m.text_len)
    assert type(loaded.pipe).__name__ == "QwenImagePipeline"
    assert type(loaded.pipe.tokenizer).__name__ == "Qwen2Tokenizer"
    for a, b in zip(_outputs(m), _outputs(loaded)):
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_pretrained_missing_path_is_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="needs a local directory"):
        load_model("qwenimage", "pretrained")
    with pytest.raises(ConfigError, match="does not exist"):
        load_model("qwenimage", "pretrained", path=tmp_path / "absent")
    with pytest.raises(ConfigError, match="model_index.json"):
        load_model("qwenimage", "pretrained", path=tmp_path)


def test_pretrained_missing_weight_file_named(saved_qwen, tmp_path):
    _, d = saved_qwen
    broken = tmp_path / "broken"
    shutil.copytree(d, broken)
    for f in (broken / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match=r"no weight file .*transformer"):
        load_model("qwenimage", "pretrained", path=broken)
    shutil.rmtree(broken / "transformer")
    shutil.copytree(d / "transformer", broken / "transformer")
    shutil.rmtree(broken / "vae")
    with pytest.raises(ConfigError, match=r"component folder .*vae"):
        load_model("qwenimage", "pretrained", path=broken)
    assert "vae" in json.loads((broken / "model_index.json").read_text())


def test_unknown_name_and_preset_list_allowed_values():
    with pytest.raises(ConfigError, match=r"allowed: qwenimage, .*flux, wan21, .*hunyuanvideo.*sd3"):
        load_model("sd9", "tiny")
    with pytest.raises(ConfigError, match="allowed: tiny, tiny4x, small, pretrained"):
        load_model("qwenimage", "huge")


@pytest.mark.parametrize("name", ["flux", "wan21", "hunyuanvideo"])
def test_other_models_pretrained_roundtrip_identical(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = load_model(name, "tiny", seed=1)
    m.save_pretrained(tmp_path)
    loaded = load_model(name, "pretrained", path=tmp_path, resolution=(64, 64), text_len=m.text_len)
    assert type(loaded.pipe) is type(m.pipe)
    a, b = _outputs(m), _outputs(loaded)
    for k in a[0]:
        torch.testing.assert_close(a[0][k], b[0][k], rtol=0, atol=0)
    for u, w in zip(a[1:], b[1:]):
        torch.testing.assert_close(u, w, rtol=0, atol=0)
