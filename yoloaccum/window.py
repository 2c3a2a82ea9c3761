"""What an accumulation window counts and what each optimizer step leaves behind: WindowCounts (summed on the
device, all-reduced once at the window's end), StepRecord (one per step, for schedule.csv and TensorBoard), and
EpochResult (how far an epoch got)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class WindowCounts:
    """What a window sums on the device and all-reduces once at its end, as one tensor with named views:
    [images, target-score sum per loss branch..., non-finite losses, stop votes]."""

    def __init__(self, num_branches: int, device: torch.device):
        self.tensor = torch.zeros(num_branches + 3, device=device)
        self.normaliser = self.tensor[: num_branches + 1]  # images, then per-branch sums: what the loss divides by
        self.images = self.tensor[:1]
        self.non_finite_losses = self.tensor[num_branches + 1 : num_branches + 2]
        self.stop_votes = self.tensor[num_branches + 2 :]  # ranks asked to stop (a signal) in this window


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as it was taken: after iteration ni, over `micro_batches` micro-batches holding `images`
    images on all devices, with each group's lr and the momentum (Adam's beta1); skipped when the window was not
    finite (the optimizer then did not step)."""

    ni: int
    micro_batches: int
    images: int
    lrs: tuple[float, ...]
    momentum: float
    skipped: bool

    @classmethod
    def of(cls, ni: int, micro_batches: int, images: int, optimizer: torch.optim.Optimizer, finite: bool) -> StepRecord:
        g = optimizer.param_groups
        momentum = g[0]["momentum"] if "momentum" in g[0] else g[0].get("betas", (math.nan,))[0]
        return cls(ni, micro_batches, images, tuple(x["lr"] for x in g), momentum, not finite)


@dataclass(frozen=True)
class EpochResult:
    """How far an epoch got: micro-batches done, and why it ended early (None when it completed)."""

    done: int
    stopped: str | None  # "interrupted" (a signal) or "diverged" (nan_patience skipped windows in a row)
