"""The autocast dtype of an evaluation: one rule for every caller."""

from __future__ import annotations

import contextlib

import torch

from ...cache.target import DTYPES

# Names an evaluation's autocast dtype may be given by: the project's dtype table plus short spellings.
AUTOCAST_NAMES = {**DTYPES, "bf16": DTYPES["bfloat16"], "fp16": DTYPES["float16"], "fp32": DTYPES["float32"]}


def resolve_autocast(requested: str | torch.dtype | None, device: torch.device,
                     param_dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype of an evaluation: the one rule for the callback and ``eval_drafter.py``.

    ``"auto"``: bfloat16 on CUDA for a float32 drafter (speed where it is cheap), none elsewhere (CPU
    stays exact float32). None or float32: none. Another name (``AUTOCAST_NAMES``) or dtype: that one.
    """
    if requested is None:
        return None
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" and param_dtype == torch.float32 else None
    dt = requested if isinstance(requested, torch.dtype) else AUTOCAST_NAMES[requested]
    return None if dt == torch.float32 else dt


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
