"""Every adapter's deterministic sampler and sigmas against the stock diffusers pipeline it wraps (issue 32.4).

With the ``tiny`` presets (random weights, seed 0), the adapter's ODE (``rollout_steps`` with noise level 0
on every step) from given ``x_0`` and prompt embeddings equals ``pipe.__call__(latents=x_0,
prompt_embeds=..., output_type="latent")`` after every one of 3 steps, with the model's guidance passed the
pipeline's way: true CFG for Qwen-Image (with its norm rescale), Wan2.1 and SD3.5, the guidance embedding for FLUX.1
and HunyuanVideo. The transformer sees the same timestep and guidance values on every step, and
``model.sigmas(n)`` is bitwise the scheduler's sigmas after the pipeline's own ``set_timesteps`` (its ``mu`` /
``shift``). Machinery and how to add an adapter: ``tests/models/_oracle.py``.

Tolerances (latents reach |x| ~ 4.5; one fp32 ulp there is 4.8e-7):

* FLUX.1, HunyuanVideo: bitwise. One batch, one forward per step, the same timestep tensor values (the FLUX
  pipeline's ``(1000·sigma)/1000`` rounds back to ``sigma`` exactly for these sigmas, checked per step as a
  transformer input), and ``sde_step`` at ``a = 0`` is the scheduler's ``x + (sigma_next − sigma)·v`` op for op.
* SD3.5: bitwise. The stock pipeline also runs both CFG branches as one ``2B``-row forward, negative rows first,
  which the adapter does in the same order; the timestep is the scheduler's fp32 ``1000·sigma`` in both.
* Qwen-Image: 1e-5 (measured 1.5e-6). The adapter runs both CFG branches as one ``2B``-row forward, the
  pipeline as two ``B``-row forwards; matmuls of another shape round differently (~5e-7 per branch, measured),
  and ``v_u + w (v_c − v_u)`` (w = 4) multiplies that by up to 2w − 1 = 7 before the norm rescale.
* Wan2.1: 1e-5 (measured 2.9e-6), after two documented differences, see :func:`_wan_first_order`.
* Qwen-Image-Edit / -Plus: 1e-5 (measured 1.5e-6 / 1.4e-6), Qwen-Image's batched CFG; the stock pipelines get the
  input image(s) as PIL (``image=``) and VAE-encode them at 1024², so the adapter runs with ``image_area = 1024²``
  (4096 image tokens beside the 16 noise tokens); Plus with two input images, batch 1 (its pipeline's limit).
* Wan2.2 (same differences): A14B 1e-5 (measured 1.2e-6) over 4 steps, two on each expert (each with its own
  CFG scale, 4 and 3); TI2V-5B 1e-5 (measured 1.7e-6), where the stock pipeline feeds one timestep per token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models._oracle import (
    OracleCase,
    check_ode,
    check_sigmas,
    run_ode,
    stock_sigmas,
    tiny_model,
    with_scheduler,
)


def _qwenimage(m: Any, c: dict[str, torch.Tensor]) -> dict[str, Any]:
    return dict(prompt_embeds=c["prompt_embeds"], prompt_embeds_mask=c["prompt_mask"],
                negative_prompt_embeds=c["negative_embeds"], negative_prompt_embeds_mask=c["negative_mask"],
                true_cfg_scale=m.guidance_scale)


def _flux(m: Any, c: dict[str, torch.Tensor]) -> dict[str, Any]:
    return dict(prompt_embeds=c["prompt_embeds"], pooled_prompt_embeds=c["pooled_embeds"],
                guidance_scale=m.guidance_scale)


def _wan(m: Any, c: dict[str, torch.Tensor]) -> dict[str, Any]:
    return dict(prompt_embeds=c["prompt_embeds"], negative_prompt_embeds=c["negative_embeds"],
                guidance_scale=m.guidance_scale, num_frames=m.num_frames)


def _wan22(m: Any, c: dict[str, torch.Tensor]) -> dict[str, Any]:
    # each expert's own CFG scale (a one-transformer pipeline refuses guidance_scale_2)
    return dict(_wan(m, c), guidance_scale_2=m.guidance_scale_2) if m.boundary_ratio is not None else _wan(m, c)


def _hunyuan(m: Any, c: dict[str, torch.Tensor]) -> dict[str, Any]:
    return dict(prompt_embeds=c["prompt_embeds"], prompt_attention_mask=c["prompt_mask"],
                pooled_prompt_embeds=c["pooled_embeds"], guidance_scale=m.guidance_scale, num_frames=m.num_frames)


def _sd3(m: Any, c: dict[str, torch.Tensor]) -> dict[str, Any]:
    return dict(prompt_embeds=c["prompt_embeds"], pooled_prompt_embeds=c["pooled_embeds"],
                negative_prompt_embeds=c["negative_embeds"], negative_pooled_prompt_embeds=c["negative_pooled_embeds"],
                guidance_scale=m.guidance_scale)


def _first_order_unipc(config: Any, num_steps: int, *, float_timesteps: bool) -> Any:
    """Wan's own UniPC scheduler at ``solver_order=1`` with the corrector off (optionally float timesteps)."""
    from diffusers import UniPCMultistepScheduler

    class FloatTimestepsUniPC(UniPCMultistepScheduler):
        def set_timesteps(self, *args: Any, **kwargs: Any) -> None:
            super().set_timesteps(*args, **kwargs)
            # UniPC computes sigma·1000 and then casts it to int64; keep the value before the cast
            self.timesteps = self.sigmas[:-1].to(self.timesteps.device) * self.config.num_train_timesteps

    cls = FloatTimestepsUniPC if float_timesteps else UniPCMultistepScheduler
    return cls.from_config(config, solver_order=1, disable_corrector=list(range(num_steps)))


def _wan_first_order(m: Any, num_steps: int, *, float_timesteps: bool = True) -> Any:
    """The stock ``WanPipeline`` over the adapter's components, its UniPC scheduler made first order.

    Two documented differences separate the adapter from ``WanPipeline`` with its default scheduler:

    1. The solver. The stock UniPC is a 2nd-order multistep predictor with a corrector; the RL sampler is
       first order on the same sigmas (Euler at ``a = 0``, Euler-Maruyama otherwise), as flow_grpo's Wan
       sampler. UniPC at ``solver_order=1`` with the corrector disabled is its data-prediction DDIM step
       ``x_t = (σ_t/σ_s)·x + α_t(1 − e^{−h})·x̂0`` (``λ = log(α/σ)``, ``α = 1 − σ``), algebraically
       ``x + (σ_t − σ_s)·v``; computed through fp32 logs and exps it rounds differently (~1e-6 over 3 steps).
    2. The timestep dtype. UniPC casts ``1000·σ`` to int64 (truncation: 999.999 -> 999); the adapter feeds
       the exact ``1000·σ`` (wan.py's docstring). Restoring the float value before the cast is the only
       change; :func:`test_wan_stock_int64_timesteps_are_the_documented_difference` pins the cast itself.

    The sigmas are not touched: ``test_sigmas_equal_stock_scheduler`` checks the default stock scheduler's.
    """
    return with_scheduler(m.pipe, _first_order_unipc(m.pipe.scheduler.config, num_steps, float_timesteps=float_timesteps))


def _edit_inputs(*names: str) -> tuple[list[Any], tuple[str, ...]]:
    """The shipped example input images ``names`` (PIL) and edit prompts carrying them (the edit oracle cases)."""
    from PIL import Image

    from digenrl.data.prompts import edit_prompt

    paths = [str(Path(__file__).resolve().parents[2] / "examples" / "edit" / n) for n in names]
    images = [Image.open(p).convert("RGB") for p in paths]
    if len(names) == 1:  # QwenImageEditPipeline takes one image for the batch: two prompts of different lengths
        return images, (edit_prompt("make the square blue", paths), edit_prompt("turn it into a circle at noon", paths))
    return images, (edit_prompt("put the circle of picture 2 into picture 1", paths),)  # the Plus pipeline: batch 1


_EDIT_IMAGES, _EDIT_PROMPTS = _edit_inputs("red_square.png")
_PLUS_IMAGES, _PLUS_PROMPTS = _edit_inputs("red_square.png", "green_circle.png")


def _qwenimage_edit(m: Any, c: dict[str, torch.Tensor]) -> dict[str, Any]:
    return dict(_qwenimage(m, c), image=_PLUS_IMAGES if m.plus else _EDIT_IMAGES[0])


_BATCHED_CFG = ("the adapter's one 2B-row CFG forward rounds unlike the pipeline's two B-row forwards "
                "(~5e-7 per branch), amplified up to (2w - 1)x by the CFG combination")

CASES = [
    OracleCase("qwenimage", stock_kwargs=_qwenimage, atol=1e-5, why=_BATCHED_CFG),
    OracleCase("flux", stock_kwargs=_flux),
    OracleCase("wan21", stock_kwargs=_wan, stock_pipeline=_wan_first_order, atol=1e-5,
               why=_BATCHED_CFG + "; UniPC's order-1 step in log space (see _wan_first_order)"),
    # Wan2.2 A14B: 4 steps, sigmas 1, .90 (high-noise expert, CFG 4) | .75, .50 (low-noise expert, CFG 3)
    OracleCase("wan22", stock_kwargs=_wan22, stock_pipeline=_wan_first_order, atol=1e-5, num_steps=4,
               why=_BATCHED_CFG + "; UniPC's order-1 step in log space (see _wan_first_order)"),
    # TI2V-5B: expand_timesteps, the pipeline feeds one timestep per token where the adapter feeds one per row
    OracleCase("wan22", stock_kwargs=_wan22, stock_pipeline=_wan_first_order, atol=1e-5, label="wan22-TI2V-5B",
               load={"variant": "TI2V-5B"}, resolution=(64, 96),
               why=_BATCHED_CFG + "; UniPC's order-1 step in log space; per-token vs per-row time embedding"),
    OracleCase("hunyuanvideo", stock_kwargs=_hunyuan),
    OracleCase("sd3", stock_kwargs=_sd3),
    # Qwen-Image-Edit(-Plus): the pipelines VAE-encode every input image at 1024² (4096 tokens at 8x) whatever the
    # output size; image_area = 1024² makes the adapter's conditioning images the same size. That costs ~4 s a
    # stock call on CPU (Plus, two images: ~9 s), so the sigma check compares two step counts, Plus one (the schedule
    # is Qwen-Image's, checked above at five)
    OracleCase("qwenimage_edit", stock_kwargs=_qwenimage_edit, atol=1e-5, why=_BATCHED_CFG,
               load={"image_area": 1024 * 1024}, prompts=_EDIT_PROMPTS, sigma_steps=(2, 28)),
    OracleCase("qwenimage_edit", stock_kwargs=_qwenimage_edit, atol=1e-5, why=_BATCHED_CFG, label="qwenimage_edit-plus",
               load={"image_area": 1024 * 1024, "variant": "edit-plus"}, prompts=_PLUS_PROMPTS, sigma_steps=(28,)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_ode_sampling_equals_stock_pipeline(case: OracleCase) -> None:
    check_ode(case)


# The edit models' schedules build their stock pipelines (~37 s each in CI); their ODE oracles above stay in it.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if "edit" in str(c) else c for c in CASES],
                         ids=str)
def test_sigmas_equal_stock_scheduler(case: OracleCase) -> None:
    check_sigmas(case)


def test_wan_stock_int64_timesteps_are_the_documented_difference() -> None:
    """What the stock Wan pipeline feeds the transformer is ``int64(1000·σ)``, truncated, where the adapter feeds
    ``1000·σ``; and the oracle is sharp enough to see it (random tiny weights make the time embedding very
    sensitive: the stock int64 run lands far outside the tolerance)."""
    case = next(c for c in CASES if c.name == "wan21")
    m = tiny_model(case)
    sig = m.sigmas(case.num_steps)
    stock = stock_sigmas(case, m, case.num_steps)  # leaves the stock scheduler's timesteps set
    assert m.pipe.scheduler.timesteps.dtype == torch.int64
    torch.testing.assert_close(stock, sig, rtol=0, atol=0)
    torch.testing.assert_close(m.pipe.scheduler.timesteps, (sig[:-1] * 1000).long(), rtol=0, atol=0)
    assert float(sig[0] * 1000) > 999.99  # UniPC starts at 1 - 1e-6: the first step is truncated by ~1

    def int_timesteps(model: Any, n: int) -> Any:
        return _wan_first_order(model, n, float_timesteps=False)

    r = run_ode(OracleCase("wan21", stock_kwargs=_wan, stock_pipeline=int_timesteps))
    fed = [s["timestep"] for s in r.stock_inputs]
    assert all(torch.equal(t, t.round()) for t in fed) and not torch.equal(fed[0], r.adapter_inputs[0]["timestep"])
    assert r.max_diff() > 100 * case.atol, r.max_diff()
