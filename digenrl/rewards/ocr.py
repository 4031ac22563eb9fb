"""Flow-GRPO's OCR reward, offline: recognition-only RapidOCR (PP-OCRv4 ONNX shipped in the wheel).

The target is the text between the first pair of double quotes in the prompt. Recognised text and
target are lower-cased with spaces removed; the score is ``1 - min(Lev(ocr, target), len) / len``, or 1 if
the target is a substring of the recognised text (ALGORITHM (c)). Recognition-only mode
(``use_det=False, use_cls=False``) reads the whole image as one text line in about 20 ms (FEASIBILITY §7).

``rapidocr-onnxruntime`` is an optional extra (``pip install digenrl[ocr]``), imported on first use.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from digenrl.rewards.base import RewardError, as_frames, check_batch, to_uint8_hwc

__all__ = ["quoted_text", "levenshtein", "ocr_similarity", "OcrReward"]

_QUOTED = re.compile(r'"([^"]*)"')


def quoted_text(prompt: str) -> str:
    """The text between the first pair of double quotes.

    Raises:
        RewardError: the prompt has no quoted text.
    """
    m = _QUOTED.search(prompt)
    if m is None or not m.group(1).strip():
        raise RewardError(f'ocr: prompt {prompt!r} has no "quoted" target text')
    return m.group(1)


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; unit costs)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_similarity(recognised: str, target: str) -> float:
    """Flow-GRPO's score of recognised text against the target (see the module docstring)."""
    rec = recognised.replace(" ", "").lower()
    tgt = target.replace(" ", "").lower()
    if not tgt:
        raise RewardError("ocr: empty target text")
    if tgt in rec:
        return 1.0
    return 1.0 - min(levenshtein(rec, tgt), len(tgt)) / len(tgt)


class OcrReward:
    """Edit-distance OCR reward with a lazily loaded RapidOCR recogniser.

    Raises:
        RewardError: (on first use) ``rapidocr-onnxruntime`` is not installed.
    """

    name = "ocr"

    def __init__(self) -> None:
        self._engine: Any = None

    def _ocr(self) -> Any:
        if self._engine is None:
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as exc:
                raise RewardError(
                    "the 'ocr' reward needs the optional extra: pip install 'digenrl[ocr]' "
                    "(rapidocr-onnxruntime)"
                ) from exc
            self._engine = RapidOCR()
        return self._engine

    def recognise(self, images: torch.Tensor) -> list[str]:
        """Text read from each image ``[N, 3, H, W]``."""
        engine = self._ocr()
        out = []
        for im in to_uint8_hwc(images).numpy():
            result, _ = engine(im, use_det=False, use_cls=False)
            out.append(result[0][0] if result else "")
        return out

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Score a batch (videos: the mean over frames).

        Raises:
            RewardError: malformed batch, a prompt without quoted text, or the extra is missing.
        """
        check_batch(images, prompts, self.name)
        targets = [quoted_text(p) for p in prompts]
        frames, f = as_frames(images)
        texts = self.recognise(frames)
        scores = [ocr_similarity(t, targets[k // f]) for k, t in enumerate(texts)]
        return torch.tensor(scores, dtype=torch.float32).reshape(-1, f).mean(dim=1)
