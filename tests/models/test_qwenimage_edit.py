"""Qwen-Image-Edit(-Plus): the input images in the conditioning, replay from stored cond, JSONL prompt files.

The stock-pipeline oracle (every ODE step, sigmas) is ``tests/models/test_oracle.py``'s ``qwenimage_edit`` cases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from digenrl.data.prompts import edit_prompt, load_prompts, prompt_text, split_prompt
from digenrl.errors import ConfigError
from digenrl.models import load_model
from digenrl.models.base import cat_cond, cond_to, index_cond, repeat_cond
from digenrl.transport.codec import decode, encode

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "edit"
RED, GREEN = str(EXAMPLES / "red_square.png"), str(EXAMPLES / "green_circle.png")


@pytest.fixture(scope="module")
def model():
    return load_model("qwenimage_edit", "tiny", resolution=(32, 32))


def _x(b: int) -> torch.Tensor:
    return torch.randn(b, 4, 64, generator=torch.Generator().manual_seed(3))


def test_cond_carries_the_input_images_latents_as_the_pipeline_computes_them(model) -> None:
    prompts = [edit_prompt("make the square blue", [RED]), edit_prompt("make the circle red", [GREEN])]
    cond = model.encode_prompts(prompts)
    assert set(cond) == {"prompt_embeds", "prompt_mask", "negative_embeds", "negative_mask", "image_latents"}
    assert cond["image_latents"].shape == (2, 4, 64)  # 32 px -> a 4x4 latent -> 2x2 packed tokens, 64 channels
    # independently: the stock pipeline's own image path (resize, preprocess, VAE mode, normalise, pack)
    pipe = model.pipe
    for row, path in enumerate((RED, GREEN)):
        img = pipe.image_processor.resize(Image.open(path).convert("RGB"), 32, 32)
        pixels = pipe.image_processor.preprocess(img, 32, 32).unsqueeze(2)
        _, want = pipe.prepare_latents(pixels, 1, 16, 32, 32, torch.float32, "cpu", None)
        torch.testing.assert_close(cond["image_latents"][row:row + 1], want, rtol=0, atol=0)
    # the text encoder saw the image: the kept tokens include its vision tokens (vision start/end and 4 pads)
    ids = model.pipe.processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[img])["input_ids"][0]
    assert ids.tolist().count(260) == 4
    # CFG: the negative branch is encoded with the same image, so it differs per sample
    assert not torch.equal(cond["negative_embeds"][0], cond["negative_embeds"][1])


def test_the_same_instruction_on_another_input_image_gives_another_velocity(model) -> None:
    a = model.encode_prompts([edit_prompt("make it blue", [RED])])
    b = model.encode_prompts([edit_prompt("make it blue", [GREEN])])
    sigma = torch.full((1,), 0.8)
    with torch.no_grad():
        va, vb = model.velocity(_x(1), sigma, a), model.velocity(_x(1), sigma, b)
        # and each path alone carries the image: only the latents, or only the text embeddings, swapped
        v_lat = model.velocity(_x(1), sigma, {**a, "image_latents": b["image_latents"]})
        v_txt = model.velocity(_x(1), sigma, {**b, "image_latents": a["image_latents"]})
    assert (va - vb).abs().max() > 1e-3
    assert (va - v_lat).abs().max() > 1e-4 and (va - v_txt).abs().max() > 1e-4


def test_replay_from_stored_cond_equals_the_rollout(model) -> None:
    """What the trainer replays (rows picked, repeated, concatenated, sent over the wire) gives the rollout's velocity."""
    prompts = [edit_prompt("make the square blue", [RED]), edit_prompt("make the circle red", [GREEN])]
    cond = repeat_cond(model.encode_prompts(prompts), 2)  # a, a, b, b
    x, sigma = _x(4), torch.tensor([1.0, 0.9, 0.6, 0.3])
    with torch.no_grad():
        rollout = model.velocity(x, sigma, cond)
        frames = encode({"kind": "fragment"}, {"cond": cond})  # as a fragment's cond crosses the wire
        stored = cond_to(decode([bytes(f) for f in frames])[1]["cond"], "cpu")
        order = [3, 0, 2]
        replay = model.velocity(x[order], sigma[order], cat_cond([index_cond(stored, [3]), index_cond(stored, [0, 2])]))
    assert stored.keys() == cond.keys() and torch.equal(stored["image_latents"], cond["image_latents"])
    # a batch of 3 against one of 4: the same numbers up to fp32 rounding, not bit for bit (a matmul's blocking
    # depends on its rows and on the thread count an earlier test left; 9.5e-7 seen in a full run)
    torch.testing.assert_close(replay, rollout[order], rtol=1e-5, atol=2e-6)


def test_pretrained_round_trip(model, tmp_path: Path) -> None:
    model.save_pretrained(tmp_path / "edit")
    index = json.loads((tmp_path / "edit" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline" and index["processor"] == [None, None]
    # a loaded model conditions at the pipelines' 1024² unless told otherwise; the tiny one at its output's size
    again = load_model("qwenimage_edit", "pretrained", path=tmp_path / "edit", resolution=(32, 32), text_len=128,
                       image_area=32 * 32)
    prompts = [edit_prompt("make the square blue", [RED])]
    c1, c2 = model.encode_prompts(prompts), again.encode_prompts(prompts)
    for k in c1:
        torch.testing.assert_close(c1[k], c2[k], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(again.velocity(_x(1), torch.ones(1), c2), model.velocity(_x(1), torch.ones(1), c1))
    with pytest.raises(ConfigError, match="not a Qwen-Image-Edit"):
        load_model("qwenimage", "tiny", resolution=(32, 32)).save_pretrained(tmp_path / "t2i")
        load_model("qwenimage_edit", "pretrained", path=tmp_path / "t2i")


def test_edit_plus_takes_several_images_and_edit_one() -> None:
    plus = load_model("qwenimage_edit", "tiny", resolution=(32, 32), variant="edit-plus")
    cond = plus.encode_prompts([edit_prompt("put the circle on the square", [RED, GREEN])])
    assert cond["image_latents"].shape == (1, 8, 64)  # two images' tokens after each other
    with torch.no_grad():
        v = plus.velocity(_x(1), torch.ones(1), cond)
        swapped = plus.velocity(_x(1), torch.ones(1), {**cond, "image_latents": cond["image_latents"][:, [4, 5, 6, 7, 0, 1, 2, 3]]})
    assert v.shape == (1, 4, 64) and (v - swapped).abs().max() > 1e-4  # picture order matters
    edit = load_model("qwenimage_edit", "tiny", resolution=(32, 32))
    with pytest.raises(ConfigError, match="variant 'edit' takes one input image"):
        edit.encode_prompts([edit_prompt("x", [RED, GREEN])])
    with pytest.raises(ConfigError, match="carries no input images"):
        edit.encode_prompts(["a plain prompt"])


def test_jsonl_prompt_files(tmp_path: Path) -> None:
    shutil_copy = (tmp_path / "in.png")
    shutil_copy.write_bytes(Path(RED).read_bytes())
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "make it blue", "images": ["in.png"]}\n\n{"prompt": "a \\"quoted\\" one", "images": ["in.png"]}\n')
    prompts = load_prompts(prompt_file=str(good))
    assert split_prompt(prompts[0]) == ("make it blue", [str(shutil_copy.resolve())])
    assert prompt_text(prompts[1]) == 'a "quoted" one' and prompt_text("a plain prompt") == "a plain prompt"
    assert all(isinstance(p, str) for p in prompts) and json.loads(json.dumps(prompts)) == prompts  # wire/checkpoints

    def error(text: str) -> str:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ConfigError) as exc:
            load_prompts(prompt_file=str(bad))
        assert f"{str(bad)!r} line" in str(exc.value)
        return str(exc.value)

    assert "line 2: not JSON" in error('{"prompt": "ok", "images": ["in.png"]}\n{"prompt": oops}\n')
    assert "line 1: expected" in error('["not", "an", "object"]\n')
    assert "line 3: image" in error('{"prompt": "a", "images": ["in.png"]}\n\n{"prompt": "b", "images": ["gone.png"]}\n')
    assert "line 2: 2 images, but earlier lines have 1" in error(
        '{"prompt": "a", "images": ["in.png"]}\n{"prompt": "b", "images": ["in.png", "in.png"]}\n')


def test_random_preset_builds_the_published_pipeline_with_random_embeds() -> None:
    """Preset ``random`` (one block at the real width, no text encoder): the real pipeline class and byte processor;
    the random prompt features are as long as the instruction plus the image tokens Qwen2.5-VL would read."""
    m = load_model("qwenimage_edit", "random", layers=1, text_encoder="random-embeds", resolution=(32, 32), text_len=64)
    # the published models condition at the pipelines' 1024² whatever the output size (model.image_area = 0)
    assert m.image_hw == (1024, 1024) and m.image_tokens == 4096
    m = load_model("qwenimage_edit", "random", layers=1, text_encoder="random-embeds", resolution=(32, 32), text_len=64,
                   image_area=32 * 32)
    assert type(m.pipe).__name__ == "QwenImageEditPipeline" and m.pipe.text_encoder is None
    cond = m.encode_prompts([edit_prompt("make it blue", [RED])])
    assert cond["image_latents"].shape == (1, 4, 64) and cond["prompt_embeds"].shape == (1, 64, 3584)
    assert int(cond["prompt_mask"].sum()) == len("make it blue") + 4  # a 32 px image: 56x56 at least, 2x2 merged tokens
    with torch.no_grad():
        assert torch.isfinite(m.velocity(_x(1), torch.ones(1), cond)).all()


def test_a_config_without_a_jsonl_prompt_file_is_refused_at_load() -> None:
    from digenrl.config import config_from_dict

    with pytest.raises(ConfigError, match=r"data.prompt_file: model qwenimage_edit .* \.jsonl"):
        config_from_dict({"model": {"name": "qwenimage_edit", "preset": "tiny"}, "data": {"prompt_set": "color"}})
    ok = config_from_dict({"model": {"name": "qwenimage_edit", "preset": "tiny"},
                           "data": {"prompt_file": str(EXAMPLES / "prompts.jsonl")}})
    assert ok.model.name == "qwenimage_edit"
    with pytest.raises(ConfigError, match=r"model.image_area: .*only qwenimage_edit"):
        config_from_dict({"model": {"name": "qwenimage", "image_area": 1024}})


def test_an_input_image_of_another_aspect_is_said_to_be_stretched_once(tmp_path: Path, caplog) -> None:
    """The stock pipelines keep an input image's aspect; a run stretches it to the output's: the user is told,
    once, with both aspects and the key to change. A square input at a square output says nothing."""
    import logging

    wide = tmp_path / "wide.png"
    Image.new("RGB", (64, 32), (200, 30, 30)).save(wide)
    m = load_model("qwenimage_edit", "tiny", resolution=(32, 32))
    caplog.set_level(logging.WARNING, logger="digenrl.models.qwenimage_edit")
    m.encode_prompts([edit_prompt("make it blue", [RED])])
    assert not caplog.records
    cond = m.encode_prompts([edit_prompt("make it blue", [str(wide)])] * 2)
    assert cond["image_latents"].shape[1] == m.image_tokens  # conditioned at the run's one size all the same
    assert [r.getMessage() for r in caplog.records] == [
        "qwenimage_edit: input image of 64x32 (aspect 2.000) for 'make it blue' is stretched to the output's aspect "
        "1.000 (model.resolution = [32, 32]); the stock pipelines keep an input's aspect and make the output the "
        "same: set model.resolution to your images' aspect, or crop them (said once)"]
