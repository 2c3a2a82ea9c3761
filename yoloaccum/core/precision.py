"""amp= as a dtype: which precision autocast trains in on a device, and the autocast context for it."""

from __future__ import annotations

import contextlib

import torch

from yoloaccum.errors import UserError


def autocast_dtype(amp: bool | str, device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs the forward in, or None for float32.

    True and fp16 mean float16 with a GradScaler on CUDA and, as in Ultralytics, float32 on the CPU, where float16
    kernels are slow; bf16 means bfloat16 on either, without a scaler (its exponent range is float32's)."""
    if amp in (False, "fp32"):
        return None
    if amp == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError(f"amp=bf16: {torch.cuda.get_device_name(device)} has no bfloat16; use amp=fp16")
        return torch.bfloat16
    return torch.float16 if device.type == "cuda" else None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """torch.autocast in `dtype` on the device, or nothing (float32) for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
