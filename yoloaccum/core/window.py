"""What an accumulation window counts and what each optimizer step leaves behind: WindowCounts (summed on the
device, all-reduced once at the window's end), StepRecord (one per step, for schedule.csv and TensorBoard), and
EpochResult (how far an epoch got); and a window's batches fetched ahead of its micro-steps (windows_ahead)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from yoloaccum.core.schedule import Schedule


class WindowCounts:
    """What a window sums on the device and all-reduces once at its end, as one tensor with named views:
    [images, target-score sum per loss branch..., non-finite losses, stop votes, save votes]."""

    def __init__(self, num_branches: int, device: torch.device):
        self.tensor = torch.zeros(num_branches + 4, device=device)
        self.normaliser = self.tensor[: num_branches + 1]  # images, then per-branch sums: what the loss divides by
        self.images = self.tensor[:1]
        self.non_finite_losses = self.tensor[num_branches + 1 : num_branches + 2]
        self.stop_votes = self.tensor[num_branches + 2 : num_branches + 3]  # ranks asked to stop (a signal, time=)
        self.save_votes = self.tensor[num_branches + 3 :]  # ranks asking for last.pt now (save_minutes=)


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
    replays: int = 0  # times the window ran again after an AMP overflow before this step

    @classmethod
    def of(
        cls, ni: int, micro_batches: int, images: int, optimizer: torch.optim.Optimizer, finite: bool, replays: int = 0
    ) -> StepRecord:
        g = optimizer.param_groups
        momentum = g[0]["momentum"] if "momentum" in g[0] else g[0].get("betas", (math.nan,))[0]
        return cls(ni, micro_batches, images, tuple(x["lr"] for x in g), momentum, not finite, replays)


@dataclass(frozen=True)
class EpochResult:
    """How far an epoch got: micro-batches done, and why it ended early (None when it completed)."""

    done: int
    stopped: str | None  # "interrupted" (a signal) or "diverged" (nan_patience skipped windows in a row)


def one_by_one(numbered: Iterable[tuple[int, dict]]) -> Iterator[tuple[int, dict, list[dict]]]:
    """(i, batch, []) for each numbered batch: nothing fetched ahead."""
    return ((i, batch, []) for i, batch in numbered)


def windows_ahead(
    schedule: Schedule, epoch: int, numbered: Iterable[tuple[int, dict]]
) -> Iterator[tuple[int, dict, list[dict]]]:
    """(i, batch, upcoming) for each numbered batch of `epoch`; `upcoming` is, at a window's first batch in the epoch,
    the window's batches up to its end or the epoch's (fetched ahead from the loader; bn=window's statistics pass
    runs over them), and empty at the others."""
    numbered, first = iter(numbered), epoch * schedule.batches_per_epoch
    for i, batch in numbered:
        window = [(i, batch)]
        while not schedule.steps_after(first + window[-1][0]):
            following = next(numbered, None)
            if following is None:  # the epoch ends inside the window (remainder=carry)
                break
            window.append(following)
        batches = [b for _, b in window]
        for k, (j, b) in enumerate(window):
            yield j, b, batches if k == 0 else []
