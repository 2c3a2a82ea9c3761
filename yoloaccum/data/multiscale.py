"""multi_scale=: each training micro-batch resized to a random size, as Ultralytics' DetectionTrainer does it.

Two differences, both so that the sizes are part of the data: the resize happens where a batch leaves the loader, so
bn=window's statistics pass sees each micro-batch at the size its micro-step trains it; and each size is drawn from
(seed, epoch, batch index) alone, so a resumed run, or one on other devices, draws the same sizes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.nn import functional as F

from yoloaccum.core.micro_batch import model_input

STRIDE = 32  # the largest model stride: every size is a multiple of it


def draw(imgsz: int, multi_scale: float, seed: int, epoch: int, i: int) -> int:
    """Ultralytics' size rule, randrange(imgsz (1 - m), imgsz (1 + m) + stride) rounded down to the stride, drawn
    from a generator of its own seeded by (seed, epoch, i)."""
    low = max(STRIDE, int(imgsz * (1.0 - multi_scale)))
    high = int(imgsz * (1.0 + multi_scale) + STRIDE)
    return random.Random(f"{seed}/{epoch}/{i}").randrange(low, high) // STRIDE * STRIDE


def resize(batch: dict[str, Any], size: int, device: torch.device) -> dict[str, Any]:
    """The batch with its images (on `device`, as the model takes them) scaled so the longer side is `size`; the
    labels are normalised to the image, so they stay."""
    img = model_input(batch["img"], device)
    factor = size / max(img.shape[2:])
    if factor != 1:
        shape = [math.ceil(x * factor / STRIDE) * STRIDE for x in img.shape[2:]]
        img = F.interpolate(img, size=shape, mode="bilinear", align_corners=False)
    return {**batch, "img": img}


def resized(
    batches: Iterable[dict[str, Any]], imgsz: int, multi_scale: float, seed: int, epoch: int, start: int, device
) -> Iterator[dict[str, Any]]:
    """The epoch's batches from index `start` on, each at its drawn size."""
    for i, batch in enumerate(batches, start):
        yield resize(batch, draw(imgsz, multi_scale, seed, epoch, i), device)
