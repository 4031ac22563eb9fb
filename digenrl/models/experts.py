"""Generators made of several expert transformers, each denoising its own band of noise levels (Wan2.2 A14B).

A mixture-of-experts generator (``models/wan22.py``) picks one expert per *row* by that row's noise level:
in the stock pipeline a whole denoising step runs one expert, and here every row of a packed TSP batch
(rows at many steps) runs the expert of its own sigma. What the rest of digenrl sees:

* ``model.transformer`` is an :class:`ExpertSet`: one ``torch.nn.Module`` holding the *trained* experts
  as children named after the pipeline components (``transformer`` = the high-noise expert,
  ``transformer_2`` = the low-noise one). LoRA (``models/lora.py``) adds one adapter to each, the optimizer
  trains their parameters, and the trainable state dict names every tensor after its expert
  (``transformer.blocks.0.attn1.to_q.lora_A.weight``, ``transformer_2.blocks.0...``): publication
  (``roles/weights.py`` buckets), weight digests and checkpoints carry both experts without knowing it.
* ``model.expert_of(sigma)``: each row's expert (0 = high noise, 1 = low noise), and
  :func:`expert_rows` / :func:`expert_counts` built on it, which the trainers use to group TSP passes by
  expert (``model.expert_offload``) and to report ``rows_by_expert/<label>`` in the metrics.

A model without experts has no ``expert_of``: the helpers return one group / no counts for it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch

from digenrl.errors import ConfigError

__all__ = ["ExpertSet", "EXPERT_LABELS", "expert_rows", "expert_counts", "has_experts", "expert_splitter",
           "expert_window_starts", "window_range"]

# Pipeline component -> the label metrics and config values use for it.
EXPERT_LABELS: dict[str, str] = {"transformer": "high", "transformer_2": "low"}


class ExpertSet(torch.nn.Module):
    """The trained experts of a mixture-of-experts generator as one module (what LoRA and the optimizer see).

    Its children are the experts themselves (no copies), named after their pipeline components. It has no
    forward of its own: the adapter calls each expert on its rows. The diffusers ``ModelMixin`` methods the
    rest of digenrl calls on ``model.transformer`` are applied to every expert.

    Args:
        experts: component name -> expert transformer, high-noise expert first.
    """

    def __init__(self, experts: dict[str, torch.nn.Module]) -> None:
        super().__init__()
        if not experts:
            raise ValueError("an ExpertSet needs at least one expert")
        for name, module in experts.items():
            self.add_module(name, module)
        # Where trained parameters live (set by a model whose idle expert waits in host memory: adapters
        # added to that expert are created there and moved here, to their optimizer's device).
        self.home: torch.device | None = None

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        """Component name -> trained expert, in pipeline order."""
        return dict(self.named_children())

    def _each(self) -> Iterator[Any]:
        return iter(self.children())

    # -- the ModelMixin surface --------------------------------------------------------------------
    def add_adapter(self, adapter_config: Any, adapter_name: str = "default") -> None:
        """One peft adapter per expert, drawn one after the other (the experts' ``lora_A`` differ)."""
        for expert in self._each():
            expert.add_adapter(copy.deepcopy(adapter_config), adapter_name=adapter_name)
            if self.home is not None:
                for name, p in expert.named_parameters():
                    if "lora_" in name and p.device != self.home:
                        p.data = p.data.to(self.home)

    def disable_adapters(self) -> None:
        for expert in self._each():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self._each():
            expert.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for expert in self._each():
            expert.enable_gradient_checkpointing()

    def disable_gradient_checkpointing(self) -> None:
        for expert in self._each():
            expert.disable_gradient_checkpointing()

    def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """``torch.compile`` every expert in place (this module has no forward of its own to compile)."""
        for expert in self._each():
            expert.compile(*args, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        first = next(self._each())
        return first.dtype if isinstance(getattr(first, "dtype", None), torch.dtype) else next(first.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def peft_config(self) -> dict[str, Any]:
        """The experts' adapter configs (equal: :meth:`add_adapter` gives each the same), for peft's
        ``get_peft_model_state_dict``, which then names every tensor after its expert."""
        return next(self._each()).peft_config

    @property
    def config(self) -> Any:
        """The first expert's config (all experts of one pipeline share the architecture)."""
        return next(self._each()).config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ExpertSet has no forward: the model calls each expert on the rows of its noise levels")


def has_experts(model: Any) -> bool:
    """Whether ``model`` picks an expert per row (more than one expert transformer)."""
    return len(getattr(model, "experts", ())) > 1


def expert_rows(model: Any, sigma: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(label, row indices)`` per expert that has rows at noise levels ``sigma`` ``[B]``, high noise first.

    A model without experts: one group, ``("all", every row)``. Indices are on ``sigma``'s device.
    """
    if not has_experts(model):
        return [("all", torch.arange(sigma.shape[0], device=sigma.device))]
    index = model.expert_of(sigma)
    out = []
    for k, name in enumerate(model.experts):
        rows = (index == k).nonzero().flatten()
        if rows.numel():
            out.append((EXPERT_LABELS.get(name, name), rows))
    return out


def expert_counts(model: Any, sigma: torch.Tensor) -> dict[str, float]:
    """``{"rows_by_expert/<label>": rows}`` of a mixture-of-experts model (every expert, zeros included); ``{}``
    otherwise. Counts, which :func:`digenrl.rl.loss.reduce_stats` sums (they ride the loss sums)."""
    if not has_experts(model):
        return {}
    index = model.expert_of(sigma)
    return {f"rows_by_expert/{EXPERT_LABELS.get(name, name)}": float((index == k).sum())
            for k, name in enumerate(model.experts)}


def expert_splitter(model: Any) -> Any:
    """The ``experts`` argument of the TSP passes (``digenrl.rl.tsp``): ``sigma -> expert_rows(model, sigma)``
    for a mixture-of-experts model, ``None`` for any other."""
    if not has_experts(model):
        return None
    return lambda sigma: expert_rows(model, sigma)


def expert_window_starts(placement: str, num_steps: int, window: int, boundary_step: int,
                         window_range: tuple[int, int] | None = None) -> tuple[int, int]:
    """The ``(lo, hi)`` window starts (``rl.steps.plan_steps``' ``window_range``) that put a ``window``-step SDE
    window where ``rollout.window_expert`` says, relative to the expert boundary.

    ``boundary_step``: the first step of the low-noise expert (steps ``0 .. boundary_step - 1`` are the high-noise
    expert's; ``num_steps`` when every step is). The last step is never in a window. Placements: ``any`` (steps
    0..N-2), ``high`` (only high-noise steps), ``low`` (only low-noise steps), ``span`` (at least one step of
    each). ``window_range`` (``rollout.window_range``) narrows the starts further.

    Raises:
        ConfigError: no start satisfies both (naming ``rollout.window_expert`` and the steps each expert has).
    """
    last = num_steps - 1 - window  # the largest start that keeps the last step out
    lo, hi = {"any": (0, last), "high": (0, boundary_step - window), "low": (boundary_step, last),
              "span": (boundary_step - window + 1, boundary_step - 1)}[placement]
    lo, hi = max(lo, 0), min(hi, last)
    if window_range is not None:
        lo, hi = max(lo, window_range[0]), min(hi, window_range[1])
    if lo > hi:
        raise ConfigError(
            f"rollout.window_expert = {placement!r}: no {window}-step window fits (rollout.window = {window}, "
            f"rollout.window_range = {list(window_range) if window_range else []}); of {num_steps} steps the "
            f"high-noise expert has steps 0..{boundary_step - 1} and the low-noise expert steps {boundary_step}.."
            f"{num_steps - 1} (the last step is never trained). Change rollout.window, rollout.num_steps or "
            "rollout.window_expert")
    return lo, hi


def window_range(model: Any, rollout: Any) -> tuple[int, int] | None:
    """The window starts (``plan_steps``' ``window_range``) under ``rollout.window_expert``.

    ``"any"``: ``rollout.window_range`` as it is. Otherwise the starts that put the window on the high-noise
    expert's steps, the low-noise expert's, or across the boundary (:func:`expert_window_starts`),
    narrowed by ``rollout.window_range``.

    Raises:
        ConfigError: ``rollout.window_expert`` set for a model without experts, or no window fits.
    """
    placement = getattr(rollout, "window_expert", "any")
    if placement == "any":
        return rollout.window_bounds()
    if not has_experts(model):
        raise ConfigError(f"rollout.window_expert = {placement!r}: model {getattr(model, 'name', '?')!r} has one "
                          "transformer, no expert boundary to place the window by; use 'any'")
    return expert_window_starts(placement, rollout.num_steps, rollout.window, model.boundary_step(rollout.num_steps),
                                rollout.window_bounds())
