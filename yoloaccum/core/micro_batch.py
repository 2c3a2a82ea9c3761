"""A collated detection batch as micro-batches: cut by image with its labels (an out-of-memory back-off runs each
batch in parts), and its images as the model takes them."""

from __future__ import annotations

from typing import Any

import torch

from yoloaccum.core.schedule import even_cuts

# Per-label tensors of a collated detection batch, indexed by batch_idx rather than by image.
LABEL_KEYS = ("batch_idx", "cls", "bboxes")


def split_batch(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """A collated batch cut into `parts` batches of consecutive images, sizes differing by at most one; none empty.

    New dicts, so that micro_step, which replaces "img" by the device copy, leaves the kept batch on the host."""
    n = batch["img"].shape[0]
    if parts == 1:
        return [dict(batch)]
    out = []
    cuts = even_cuts(n, parts)
    for a, b in zip(cuts, cuts[1:]):
        if a == b:
            continue
        part = {}
        if "batch_idx" in batch:
            keep = (batch["batch_idx"] >= a) & (batch["batch_idx"] < b)
            part.update({k: batch[k][keep] for k in LABEL_KEYS if k in batch})
            part["batch_idx"] = part["batch_idx"] - a
        for k, v in batch.items():
            if k not in part:
                part[k] = v[a:b] if isinstance(v, (torch.Tensor, list, tuple)) and len(v) == n else v
        out.append(part)
    return out


def model_input(img: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A loader's images as the model takes them: on the device, float in [0, 1].

    They stay NCHW even for a channels-last model: its first convolution lays them out as its weights, with identical
    results (tests/test_speed_settings.py) and, on the CPU, at no measurable cost.
    """
    img = img.to(device, non_blocking=True)
    return img.float() / 255 if img.dtype == torch.uint8 else img
