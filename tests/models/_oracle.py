"""Stock-pipeline oracle: an adapter's deterministic sampler against the diffusers pipeline it wraps.

One :class:`OracleCase` per adapter says how to call the stock pipeline (its ``__call__`` arguments
beyond the common ones), which pipeline object to call (the adapter's own ``model.pipe`` by default, so
the weights are the very same tensors), how to move latents between the two layouts, and the tolerance
with its reason. Two checks use it:

* :func:`check_ode`: from the same initial latents ``x_0`` and the same prompt embeddings, the adapter's
  sampler (``rollout_steps`` with noise level 0 on every step: exactly the Euler step of the ODE) and the
  pipeline's ``__call__(..., latents=x_0, output_type="latent")`` give the same latents after *every*
  step (read from ``callback_on_step_end``), and the transformer received the same timestep and
  guidance inputs on every step (read by a forward pre-hook), so a mismatch names its step and cause.
* :func:`check_sigmas`: ``model.sigmas(n)`` equals the pipeline scheduler's ``sigmas`` after the
  pipeline's own ``set_timesteps`` call inside ``__call__`` (its own ``mu`` / ``shift``), for several
  ``n`` and two resolutions. The pipeline is interrupted after its first step (diffusers' documented
  ``pipe._interrupt`` callback), so a 50-step schedule costs one transformer call.

Adding an adapter (e.g. ``sd3``) is one entry in ``CASES`` of ``tests/models/test_oracle.py``::

    OracleCase("sd3", stock_kwargs=lambda m, c: dict(
        prompt_embeds=c["prompt_embeds"], pooled_prompt_embeds=c["pooled_embeds"],
        negative_prompt_embeds=c["negative_embeds"], negative_pooled_prompt_embeds=c["negative_pooled_embeds"],
        guidance_scale=m.guidance_scale)),

with ``to_pipeline`` / ``to_adapter`` when the adapter's latent layout is not the pipeline's, and
``stock_pipeline`` when the stock scheduler is not first order (the Wan case: :func:`with_scheduler`
and ``_wan_first_order`` there), ``atol`` / ``why`` when the two are not bitwise equal.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from digenrl.models import load_model
from digenrl.models.base import Cond, GeneratorModel
from digenrl.rl.rollout import rollout_steps
from digenrl.rl.steps import StepPlan

__all__ = [
    "PROMPTS",
    "OracleCase",
    "OdeResult",
    "tiny_model",
    "with_scheduler",
    "adapter_trajectory",
    "stock_trajectory",
    "stock_sigmas",
    "run_ode",
    "check_ode",
    "check_sigmas",
]

# Two prompts of different token counts, so padded masks differ per row (and none is truncated).
PROMPTS: tuple[str, ...] = ("a red cat", "blue sky at noon")
# What the transformer is fed that the oracle compares per step besides the latents.
_RECORDED = ("timestep", "guidance")


def own_pipeline(model: Any, num_steps: int) -> Any:
    """The adapter's own ``pipe``: the stock pipeline over the adapter's very weights and scheduler."""
    return model.pipe


def with_scheduler(pipe: Any, scheduler: Any) -> Any:
    """A pipeline of ``pipe``'s class over the very same components and init config, with ``scheduler`` instead.

    Not ``from_pipe``: it casts the shared modules to fp32 unless told a dtype. The non-module init arguments
    (Wan2.2's ``boundary_ratio``, ``expand_timesteps``) are taken from ``pipe.config``.
    """
    cls = type(pipe)
    params = inspect.signature(cls.__init__).parameters
    extra = {k: v for k, v in pipe.config.items() if k in params and k not in pipe.components}
    return cls(**{**pipe.components, **extra, "scheduler": scheduler})


def same_layout(model: Any, latents: torch.Tensor) -> torch.Tensor:
    """Latents unchanged: the adapter's layout is the pipeline's (``latents=`` in, ``output_type="latent"`` out)."""
    return latents


@dataclass(frozen=True)
class OracleCase:
    """How to run one adapter's stock pipeline, and how close it must come.

    Attributes:
        name: the adapter's ``load_model`` name.
        stock_kwargs: ``(model, cond) -> dict`` of ``__call__`` arguments besides ``latents``,
            ``num_inference_steps``, ``height``, ``width``, ``output_type`` and the callback: the prompt
            (and negative/pooled) embeddings from ``cond`` and the guidance from ``model``.
        atol, rtol: tolerance of the per-step latents; 0 means bitwise.
        input_rtol: relative tolerance of the timestep/guidance values the transformer sees; 0 means bitwise
            (2.4e-7, two fp32 ulps, would cover a pipeline feeding ``(1000·sigma)/1000`` where it does not
            round back to ``sigma``).
        why: why the tolerance is what it is (shown when the check fails).
        stock_pipeline: ``(model, num_steps) -> pipeline`` to call; it must share the model's components.
        to_pipeline: adapter latents ``x_0`` -> the ``latents=`` the pipeline takes.
        to_adapter: the pipeline's latents (callback and ``output_type="latent"``) -> adapter layout.
        load: extra ``load_model`` keyword arguments (seed 0 and preset ``tiny`` are fixed).
        num_steps: denoising steps of the ODE comparison.
        resolution: the other ``(height, width)`` the sigma check uses (dynamic shift depends on it).
        label: the test id when one adapter has several cases (a variant), else ``name``.
        prompts: the prompts encoded (an edit model's carry input images; ``stock_kwargs`` passes them on).
        sigma_steps: the step counts :func:`check_sigmas` compares (fewer where each stock call is costly).
    """

    name: str
    stock_kwargs: Callable[[Any, Cond], dict[str, Any]]
    atol: float = 0.0
    rtol: float = 0.0
    why: str = "same operations in the same order on the same batch: bitwise equal"
    input_rtol: float = 0.0
    stock_pipeline: Callable[[Any, int], Any] = own_pipeline
    to_pipeline: Callable[[Any, torch.Tensor], torch.Tensor] = same_layout
    to_adapter: Callable[[Any, torch.Tensor], torch.Tensor] = same_layout
    load: dict[str, Any] = field(default_factory=dict)
    num_steps: int = 3
    resolution: tuple[int, int] = (48, 80)
    label: str = ""
    prompts: tuple[str, ...] = PROMPTS
    sigma_steps: tuple[int, ...] = (1, 2, 10, 28, 50)

    def __str__(self) -> str:
        return self.label or self.name


@functools.cache
def _load(name: str, items: tuple[tuple[str, Any], ...]) -> GeneratorModel:
    return load_model(name, "tiny", seed=0, **dict(items))


def tiny_model(case: OracleCase, **overrides: Any) -> Any:
    """The case's ``tiny`` model (seed 0), built once per process for each set of arguments."""
    return _load(case.name, tuple(sorted({**case.load, **overrides}.items())))


def networks(pipe: Any) -> list[torch.nn.Module]:
    """The denoising networks of a pipeline: ``transformer``, and ``transformer_2`` where it has one (Wan2.2
    A14B's low-noise expert)."""
    return [n for n in (pipe.transformer, getattr(pipe, "transformer_2", None)) if n is not None]


@contextlib.contextmanager
def recording_inputs(transformers: list[torch.nn.Module]) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Every call's ``timestep``/``guidance`` keyword inputs to any of ``transformers``, in call order, while
    the block runs."""
    calls: list[dict[str, torch.Tensor]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        calls.append({k: kwargs[k].detach().clone() for k in _RECORDED if isinstance(kwargs.get(k), torch.Tensor)})

    handles = [t.register_forward_pre_hook(hook, with_kwargs=True) for t in transformers]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _step_inputs(calls: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The distinct values of each recorded input over one step's transformer calls, as fp64, sorted.

    The adapters batch both CFG branches into one call where the pipelines make two: what must agree
    is the set of values the network saw in the step, not the call structure.
    """
    keys = {k for c in calls for k in c}
    return {k: torch.unique(torch.cat([c[k].double().flatten() for c in calls if k in c])) for k in sorted(keys)}


@torch.no_grad()
def adapter_trajectory(model: Any, x0: torch.Tensor, cond: Cond, num_steps: int
                       ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The adapter's ODE: ``rollout_steps`` one step range at a time, noise level 0 on every step.

    Returns the ``num_steps + 1`` latents (``x_0`` first) and, per step, the transformer's inputs.
    """
    b = x0.shape[0]
    sigmas = model.sigmas(num_steps)
    every = torch.ones(b, num_steps, dtype=torch.bool)
    plan = StepPlan(stochastic=every, trained=torch.zeros_like(every), window_start=torch.full((b,), -1))
    states, inputs = [x0.float()], []
    gen = torch.Generator().manual_seed(0)  # drawn and multiplied by a zero std: only keeps the global RNG alone
    for i in range(num_steps):
        with recording_inputs(networks(model.pipe) if hasattr(model, "pipe") else [model.transformer]) as calls:
            out = rollout_steps(model.velocity, states[-1], cond, sigmas, plan, i, i + 1, noise_level=0.0,
                                kind="sde", generator=gen)
        states.append(out.x)
        inputs.append(_step_inputs(calls))
    return states, inputs


@torch.no_grad()
def stock_trajectory(case: OracleCase, model: Any, x0: torch.Tensor, cond: Cond, num_steps: int
                     ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], Any]:
    """The stock pipeline's ``__call__`` from ``x0``: per-step latents (adapter layout), inputs and the pipeline."""
    pipe = case.stock_pipeline(model, num_steps)
    pipe.set_progress_bar_config(disable=True)
    states, inputs = [x0.float()], []

    with recording_inputs(networks(pipe)) as calls:
        def on_step_end(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
            states.append(case.to_adapter(model, kw["latents"]).float().clone())
            inputs.append(_step_inputs(calls))
            calls.clear()
            return {}

        out = pipe(latents=case.to_pipeline(model, x0.clone()), num_inference_steps=num_steps, height=model.height,
                   width=model.width, output_type="latent", return_dict=False, callback_on_step_end=on_step_end,
                   **case.stock_kwargs(model, cond))[0]
    final = case.to_adapter(model, out).float()
    if not torch.equal(final, states[-1]):
        raise AssertionError(f"{case}: the pipeline's output differs from the latents its last step callback saw")
    return states, inputs, pipe


@dataclass(frozen=True)
class OdeResult:
    """Both trajectories (``N + 1`` latents each, adapter layout) and the per-step transformer inputs."""

    adapter: list[torch.Tensor]
    stock: list[torch.Tensor]
    adapter_inputs: list[dict[str, torch.Tensor]]
    stock_inputs: list[dict[str, torch.Tensor]]
    stock_pipe: Any

    def max_diff(self) -> float:
        return max(float((a - s).abs().max()) for a, s in zip(self.adapter, self.stock, strict=True))


def run_ode(case: OracleCase, model: Any | None = None, num_steps: int | None = None) -> OdeResult:
    """Both ODE trajectories of ``case`` from one seeded ``x_0`` and the prompt embeddings of :data:`PROMPTS`."""
    model = tiny_model(case) if model is None else model
    n = case.num_steps if num_steps is None else num_steps
    cond = model.encode_prompts(list(case.prompts))
    x0 = model.prepare_latents(len(case.prompts), torch.Generator().manual_seed(1234))
    ours, our_inputs = adapter_trajectory(model, x0, cond, n)
    theirs, their_inputs, pipe = stock_trajectory(case, model, x0, cond, n)
    return OdeResult(ours, theirs, our_inputs, their_inputs, pipe)


def check_ode(case: OracleCase) -> OdeResult:
    """Assert the adapter's ODE equals the stock pipeline on every step: the transformer's timestep/guidance inputs
    (within ``input_rtol``, bitwise by default) and the latents (within ``atol``/``rtol``)."""
    r = run_ode(case)
    n = len(r.adapter) - 1
    assert len(r.stock) == n + 1, f"{case}: the pipeline ran {len(r.stock) - 1} steps, not {n}"
    for i in range(n):
        ours, theirs = r.adapter_inputs[i], r.stock_inputs[i]
        assert ours.keys() == theirs.keys(), f"{case} step {i}: transformer inputs {set(ours)} vs stock {set(theirs)}"
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k], rtol=case.input_rtol, atol=0,
                                       msg=lambda m, k=k, i=i: f"{case} step {i}: transformer input {k!r}: {m}")
        torch.testing.assert_close(r.adapter[i + 1], r.stock[i + 1], rtol=case.rtol, atol=case.atol,
                                   msg=lambda m, i=i: f"{case} latents after step {i} ({case.why}): {m}")
    moved = float((r.adapter[-1] - r.adapter[0]).abs().max())
    assert moved > 0.1, f"{case}: the sampler barely moved ({moved:.2e}); the comparison would prove nothing"
    return r


def stock_sigmas(case: OracleCase, model: Any, num_steps: int) -> torch.Tensor:
    """The scheduler's ``sigmas`` after the pipeline's own ``set_timesteps`` (one step is run, then interrupted)."""
    pipe = model.pipe
    pipe.set_progress_bar_config(disable=True)
    seen: list[torch.Tensor] = []

    def stop(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        seen.append(p.scheduler.sigmas.clone())
        p._interrupt = True  # diffusers' documented early stop: the loop skips the remaining steps
        return {}

    cond = model.encode_prompts(list(case.prompts[:1]))
    x0 = model.prepare_latents(1, torch.Generator().manual_seed(0))
    # np.errstate: a schedule the scheduler cannot make comes out NaN (check_sigmas looks), not as a warning
    try:
        with torch.no_grad(), np.errstate(invalid="ignore", divide="ignore"):
            pipe(latents=case.to_pipeline(model, x0), num_inference_steps=num_steps, height=model.height,
                 width=model.width, output_type="latent", return_dict=False, callback_on_step_end=stop,
                 **case.stock_kwargs(model, cond))
    finally:
        pipe._interrupt = False
    assert len(seen) == 1, f"{case}: expected one step before the interrupt, saw {len(seen)}"
    return seen[0]


def check_sigmas(case: OracleCase) -> None:
    """Assert ``model.sigmas(n) == scheduler.sigmas`` after the stock ``set_timesteps``, bitwise, for
    ``case.sigma_steps`` at two resolutions; where the stock schedule is not finite, assert ``model.sigmas(n)``
    raises ``ValueError`` instead."""
    h, w = case.resolution
    for model in (tiny_model(case), tiny_model(case, resolution=(h, w))):
        for n in case.sigma_steps:
            theirs = stock_sigmas(case, model, n)
            if not bool(torch.isfinite(theirs).all()):
                # a step count the stock schedule cannot do (Qwen-Image's shift_terminal at 1 step gives NaN):
                # the adapter must refuse it, not hand NaN to the sampler
                with pytest.raises(ValueError, match="num_steps"):
                    model.sigmas(n)
                continue
            ours = model.sigmas(n)
            torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0, msg=lambda m, n=n, model=model: (
                f"{case} at {model.height}x{model.width}, {n} steps: sigmas differ from the pipeline's: {m}"))
