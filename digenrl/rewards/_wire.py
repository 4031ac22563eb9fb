"""The JSON wire format of the HTTP reward service (client and server share it).

Request (``POST /score``)::

    {"prompts": [str, ...],
     "images": {"format": "png", "frames": F, "data": [base64 PNG, ...]}          # B*F entries
            or {"format": "raw", "frames": F, "shape": [B*F, H, W, 3], "data": base64 uint8}}

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

__all__ = ["IMAGE_FORMATS", "encode_images", "decode_images"]

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


def decode_images(obj: Any) -> torch.Tensor:
    """The JSON ``images`` object -> ``[B, 3, H, W]`` (or ``[B, 3, F, H, W]``) float in [0, 1].

    Raises:
        RewardError: malformed object (the message names the field).
    """
    if not isinstance(obj, dict):
        raise RewardError("images: expected an object")
    fmt, f = obj.get("format"), obj.get("frames", 1)
    if not isinstance(f, int) or f < 1:
        raise RewardError(f"images.frames: expected a positive int, got {f!r}")
    try:
        if fmt == "raw":
            shape = obj["shape"]
            if not (isinstance(shape, list) and len(shape) == 4 and shape[3] == 3 and all(isinstance(s, int) and s >= 0 for s in shape)):
                raise RewardError(f"images.shape: expected [N, H, W, 3], got {shape!r}")
            raw = base64.b64decode(obj["data"], validate=True)
            if len(raw) != int(np.prod(shape)):
                raise RewardError(f"images.data: {len(raw)} bytes do not match shape {shape}")
            arr = np.frombuffer(raw, dtype=np.uint8).reshape(shape)
        elif fmt == "png":
            ims = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d, validate=True))).convert("RGB")) for d in obj["data"]]
            if not ims:
                raise RewardError("images.data: empty")
            arr = np.stack(ims)
        else:
            raise RewardError(f"images.format: expected one of {IMAGE_FORMATS}, got {fmt!r}")
    except (KeyError, ValueError, OSError) as exc:  # binascii.Error is a ValueError
        raise RewardError(f"images: cannot decode ({type(exc).__name__}: {exc})") from exc
    if arr.shape[0] % f:
        raise RewardError(f"images: {arr.shape[0]} frames is not a multiple of frames={f}")
    t = torch.from_numpy(arr.copy()).permute(0, 3, 1, 2).float() / 255.0
    if f == 1:
        return t
    n, c, h, w = t.shape
    return t.reshape(n // f, f, c, h, w).permute(0, 2, 1, 3, 4)
