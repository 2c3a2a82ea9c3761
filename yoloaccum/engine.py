"""The accumulation loop itself, independent of detection: micro-steps, and one optimizer step per window.

The Engine knows nothing of datasets, YOLO or checkpoints. It takes any model and any loss that follows the WindowLoss
protocol (`loss(preds, batch) -> (loss, items, counts)` and `loss.normalise_gradients(counts, world)`), so tests can
drive the same code with a toy model.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from yoloaccum import distributed, optim
from yoloaccum.distributed import Context
from yoloaccum.schedule import Schedule

# Called after every micro-batch: (i, loss items, images, window fill, window size, lr).
OnMicroStep = Callable[[int, torch.Tensor, int, int, int, float], None]


@dataclass
class Engine:
    """Runs micro-batches forward and backward, sums their gradients, and steps the optimizer per window.

    Contract: the optimizer steps exactly after the schedule's window ends; normalise, unscale, clip, step, zero_grad
    and the EMA update each happen once per step, in that order; activation memory holds one micro-batch.
    """

    model: nn.Module  # what runs forward: the DDP wrapper under torchrun, else raw_model
    raw_model: nn.Module  # the parameters: clipped, stepped, averaged into the EMA
    loss: Any  # WindowLoss protocol
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    ctx: Context
    clip_grad: float
    scaler: torch.amp.GradScaler
    ema: Any = None  # ultralytics ModelEMA, or None
    amp: bool = False
    no_sync: bool = True  # False all-reduces after every micro-batch, as Ultralytics does (for benchmarks)
    window_counts: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.window_counts = torch.zeros(1 + len(self.loss.param_groups()), device=self.ctx.device)
        self.fault = Fault.from_env(self.ctx.rank)

    def train_epoch(self, epoch: int, batches: Iterable[dict], on_micro_step: OnMicroStep | None = None) -> None:
        """One pass over the epoch's micro-batches: a micro-step each, an optimizer step at each window end."""
        s, nb, window_start = self.schedule, self.schedule.batches_per_epoch, 0
        for i, batch in enumerate(batches):
            ni = epoch * nb + i
            last_in_window = s.steps_after(ni)
            # DDP all-reduces gradients inside backward(); skip that on all but the window's last micro-batch.
            if self.fault and self.fault.ni == ni:
                self.fault.trigger(batch)
            with distributed.no_sync(self.model, skip=self.no_sync and not last_in_window):
                items = self.micro_step(batch)
            if last_in_window:
                self.step(ni)
            if on_micro_step is not None:
                lr = self.optimizer.param_groups[0]["lr"]
                on_micro_step(i, items, batch["img"].shape[0], i - window_start + 1, s.accumulate_at(ni), lr)
            if last_in_window:
                window_start = i + 1
        assert i + 1 == nb, f"the loader gave {i + 1} batches, the schedule expects {nb}"

    def micro_step(self, batch: dict[str, Any]) -> torch.Tensor:
        """Forward and backward one micro-batch; backward() adds into .grad, so nothing is normalised here."""
        img = batch["img"].to(self.ctx.device, non_blocking=True)
        batch["img"] = img.float() / 255 if img.dtype == torch.uint8 else img
        with torch.autocast(self.ctx.device.type, enabled=self.amp):
            preds = self.model(batch["img"])
            loss, items, counts = self.loss(preds, batch)
        self.window_counts += counts  # images and target-score sums of the window, kept on the device
        self.scaler.scale(loss).backward()
        return items

    def step(self, ni: int) -> None:
        """End a window: normalise, unscale, clip, optimizer step, zero_grad, EMA update, once each."""
        counts = distributed.all_reduce_sum(self.window_counts, self.ctx)  # the global normaliser: one all-reduce
        self.loss.normalise_gradients(counts, self.ctx.world_size)
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm=self.clip_grad)
        optim.set_hyperparameters(self.optimizer, self.schedule, ni)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.raw_model)
        self.window_counts.zero_()


@dataclass(frozen=True)
class Fault:
    """A test hook: YOLOACCUM_FAULT=KIND@NI[:RANK] makes iteration NI fail on RANK (every rank when omitted).

    KIND is `raise` (an exception, as a crashing rank), `kill` (SIGKILL, as a lost machine) or `nan` (a non-finite
    input, hence a non-finite loss).
    """

    kind: str
    ni: int

    @classmethod
    def from_env(cls, rank: int) -> Fault | None:
        spec = os.environ.get("YOLOACCUM_FAULT")
        if not spec:
            return None
        kind, _, where = spec.partition("@")
        ni, _, only_rank = where.partition(":")
        assert kind in {"raise", "kill", "nan"} and ni.isdigit(), f"YOLOACCUM_FAULT={spec} is not KIND@NI[:RANK]"
        return cls(kind, int(ni)) if not only_rank or int(only_rank) == rank else None

    def trigger(self, batch: dict[str, Any]) -> None:
        if self.kind == "raise":
            raise RuntimeError(f"YOLOACCUM_FAULT: injected failure at iteration {self.ni}")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        batch["img"] = batch["img"].float() * float("nan")
