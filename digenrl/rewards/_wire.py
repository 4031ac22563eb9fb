"""The JSON wire format of the HTTP reward service (client and server share it).

Request (``POST /score``)::

    {"prompts": [str, ...],
     "images": {"format": "png", "frames": F, "data": [base64 PNG, ...]}          # B*F entries
            or {"format": "raw", "frames": F, "shape": [B*F, H, W, 3], "data": base64 uint8},
     "sources": {..., "frames": 1, "per_sample": K}}                              # optional: B*K entries

``sources`` (optional) carries an edit model's input images (``uses_sources`` in ``rewards/base.py``):
an ``images`` object of ``B*K`` stills, sample-major (sample 0's K images first), plus ``per_sample``;
it decodes to ``[B, K, 3, H, W]``.

Response: ``{"scores": [float, ...]}`` with status 200, or ``{"error": str}`` with 4xx/5xx. Images are
8-bit RGB; nothing is ever unpickled, and the server caps the body size.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch
from PIL import Image

from digenrl.rewards.base import RewardError, as_frames, to_uint8_hwc

__all__ = ["IMAGE_FORMATS", "encode_images", "decode_images", "encode_sources", "decode_sources"]

IMAGE_FORMATS = ("png", "raw")


def encode_images(images: torch.Tensor, fmt: str = "png") -> dict[str, Any]:
    """``[B, 3, H, W]`` / ``[B, 3, F, H, W]`` in [0, 1] -> the JSON ``images`` object.

    Raises:
        ValueError: unknown format.
    """
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"image format must be one of {IMAGE_FORMATS}, got {fmt!r}")
    frames, f = as_frames(images)
    arr = to_uint8_hwc(frames).numpy()
    if fmt == "raw":
        return {"format": "raw", "frames": f, "shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode()}
    data = []
    for im in arr:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="PNG")
        data.append(base64.b64encode(buf.getvalue()).decode())
    return {"format": "png", "frames": f, "data": data}


def decode_images(obj: Any, field: str = "images") -> torch.Tensor:
    """The JSON ``images`` object -> ``[B, 3, H, W]`` (or ``[B, 3, F, H, W]``) float in [0, 1].

    ``field`` is the request key the object came from, so that errors name it (``sources.shape``).

    Raises:
        RewardError: malformed object (the message names the field).
    """
    if not isinstance(obj, dict):
        raise RewardError(f"{field}: expected an object")
    fmt, f = obj.get("format"), obj.get("frames", 1)
    if not isinstance(f, int) or f < 1:
        raise RewardError(f"{field}.frames: expected a positive int, got {f!r}")
    try:
        if fmt == "raw":
            shape = obj["shape"]
            if not (isinstance(shape, list) and len(shape) == 4 and shape[3] == 3 and all(isinstance(s, int) and s >= 0 for s in shape)):
                raise RewardError(f"{field}.shape: expected [N, H, W, 3], got {shape!r}")
            raw = base64.b64decode(obj["data"], validate=True)
            if len(raw) != int(np.prod(shape)):
                raise RewardError(f"{field}.data: {len(raw)} bytes do not match shape {shape}")
            arr = np.frombuffer(raw, dtype=np.uint8).reshape(shape)
        elif fmt == "png":
            ims = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d, validate=True))).convert("RGB")) for d in obj["data"]]
            if not ims:
                raise RewardError(f"{field}.data: empty")
            arr = np.stack(ims)
        else:
            raise RewardError(f"{field}.format: expected one of {IMAGE_FORMATS}, got {fmt!r}")
    except (KeyError, ValueError, OSError) as exc:  # binascii.Error is a ValueError
        raise RewardError(f"{field}: cannot decode ({type(exc).__name__}: {exc})") from exc
    if arr.shape[0] % f:
        raise RewardError(f"{field}: {arr.shape[0]} frames is not a multiple of frames={f}")
    # Contiguous, as the local callers hand rewards their images: a reduction over a permuted view adds in
    # another order, so a served reward would differ from the same reward run locally in the last bit.
    t = torch.from_numpy(arr.copy()).permute(0, 3, 1, 2).float() / 255.0
    if f == 1:
        return t.contiguous()
    n, c, h, w = t.shape
    return t.reshape(n // f, f, c, h, w).permute(0, 2, 1, 3, 4).contiguous()


def encode_sources(sources: torch.Tensor, batch: int, fmt: str = "png") -> dict[str, Any]:
    """``[B, K, 3, H, W]`` input images in [0, 1] -> the JSON ``sources`` object (``B*K`` stills + ``per_sample``).

    Raises:
        RewardError: ``sources`` is not ``[batch, K, 3, H, W]`` with values in [0, 1].
        ValueError: unknown format.
    """
    if not isinstance(sources, torch.Tensor) or sources.ndim != 5 or sources.shape[0] != batch or sources.shape[2] != 3:
        got = tuple(sources.shape) if isinstance(sources, torch.Tensor) else type(sources).__name__
        raise RewardError(f"sources: expected each sample's input images as [B={batch}, K, 3, H, W], got {got}")
    b, k, c, h, w = sources.shape
    if k < 1:
        raise RewardError(f"sources: expected at least one input image per sample, got shape {tuple(sources.shape)}")
    if sources.numel() and (float(sources.min()) < -1e-4 or float(sources.max()) > 1 + 1e-4):
        lo, hi = float(sources.min()), float(sources.max())
        raise RewardError(f"sources: values must lie in [0, 1], got [{lo:.3f}, {hi:.3f}]")
    return {**encode_images(sources.reshape(b * k, c, h, w), fmt), "per_sample": k}


def decode_sources(obj: Any, batch: int) -> torch.Tensor:
    """The JSON ``sources`` object of a request with ``batch`` prompts -> ``[batch, K, 3, H, W]`` float in [0, 1].

    Raises:
        RewardError: malformed object, or not ``batch * per_sample`` images (the message names the field).
    """
    if not isinstance(obj, dict):
        raise RewardError("sources: expected an object")
    k = obj.get("per_sample")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise RewardError(f"sources.per_sample: expected a positive int (input images per sample), got {k!r}")
    if obj.get("frames", 1) != 1:
        raise RewardError(f"sources.frames: input images are stills, expected 1, got {obj.get('frames')!r}")
    stills = decode_images(obj, "sources")
    if stills.shape[0] != batch * k:
        raise RewardError(f"sources: {stills.shape[0]} images, expected {batch} prompts x per_sample={k} = {batch * k}")
    return stills.reshape(batch, k, *stills.shape[1:])
