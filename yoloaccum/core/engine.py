"""The accumulation loop itself, independent of detection: micro-steps, and one optimizer step per window.

The Engine knows nothing of datasets, YOLO or checkpoints. It takes any model, batches that are dicts with an "img"
tensor (cut into micro-batches by micro_batch.split_batch when it backs off), and any loss that follows the WindowLoss
protocol (`loss(preds, batch) -> (loss, items, counts)` and `loss.normalise_gradients(counts, world)`), so tests can
drive the same code with a toy model. It owns its out-of-memory back-off: a window that runs out of device memory
is dropped and run again at half the micro-batch (_back_off), and what that leaves is in rank_state_dict().
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from yoloaccum.core import backoff, optim
from yoloaccum.core.buffers import Kept
from yoloaccum.core.micro_batch import model_input, split_batch
from yoloaccum.core.schedule import Schedule
from yoloaccum.core.timing import PhaseTimer
from yoloaccum.core.window import EpochResult, StepRecord, WindowCounts, one_by_one, windows_ahead
from yoloaccum.distributed import ddp as distributed
from yoloaccum.distributed.ddp import Context

# With AMP, a window whose gradients overflowed counts towards nan_patience only once the scaler has halved its scale
# below this: until then they overflowed because they were scaled up, which is GradScaler finding its scale (it starts
# at 2**16), not a divergence. A run whose gradients are NaN for ever gets there after 17 halvings.
AMP_SCALE_FLOOR = 1.0

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
    clip_grad: float = 10.0  # max norm of the window's gradient (Ultralytics' max_norm)
    scaler: torch.amp.GradScaler = field(default_factory=lambda: torch.amp.GradScaler("cuda", enabled=False))
    ema: Any = None  # ultralytics ModelEMA, or None
    amp: bool = False
    amp_dtype: torch.dtype = torch.float16  # autocast's type with amp: fp16, which GradScaler exists for
    no_sync: bool = True  # False all-reduces after every micro-batch, as Ultralytics does (for benchmarks)
    nan_patience: int = 0  # stop after this many consecutive skipped windows; 0 never stops
    log: Callable[[str], None] = lambda message: None
    skipped: list[int] = field(default_factory=list)  # iterations whose window was skipped as non-finite
    skipped_in_a_row: int = 0
    window_buffers: Kept | None = None  # the model's buffers as the open window found them
    window_counts: WindowCounts = field(init=False)
    history: list[StepRecord] = field(default_factory=list)  # one record per step; the trainer drains it
    micro_batches_in_window: int = 0  # of the open window; with remainder=carry it may have begun last epoch
    ni: int = -1  # the iteration in progress: where a rank that waits in vain for the others was
    split: int = 1  # micro-steps per loader batch: doubles at each out-of-memory back-off (_back_off)
    back_offs: list[int] = field(default_factory=list)  # iterations that ran out of memory
    # The open window's loader batches, kept until its step: after an out-of-memory error the window runs again.
    # None when the window was reopened from last.pt (remainder=carry), whose first batches are not at hand.
    window_batches: list[dict[str, Any]] | None = field(default_factory=list)
    after_back_off: Callable[[], None] | None = None  # called once a back-off has halved the micro-batch
    window_statistics: Callable[[list[dict[str, Any]]], None] | None = None  # bn=window's pass (batchnorm/window.py)
    window_ahead: list[dict[str, Any]] = field(default_factory=list)  # the batches the last statistics pass saw
    save_due: bool = False  # a rank asked, in the window just stepped, for last.pt at this boundary
    replays: list[int] = field(default_factory=list)  # iterations whose window ran again after an AMP overflow
    replayed: int = 0  # times the open window has run again
    # Where the time goes (timing.py): each part of a micro-step and the step, lapped; no host sync added.
    timer: PhaseTimer = field(default_factory=PhaseTimer.off)

    def __post_init__(self):
        self.window_counts = WindowCounts(len(self.loss.param_groups()), self.ctx.device)

    @classmethod
    def build(
        cls,
        raw_model: nn.Module,
        loss: Any,
        schedule: Schedule,
        ctx: Context,
        bn: str = "batch",
        amp: bool = False,
        **fields: Any,
    ) -> Engine:
        """The engine for raw_model as runs, tests and benchmarks use it: wrapped in DDP under torchrun (SyncBatchNorm
        first with bn=sync), the optimizer the schedule names, a GradScaler that is a no-op without AMP; `fields` are
        the dataclass's others (clip_grad, ema, nan_patience, log, ...)."""
        # GradScaler exists for float16, whose gradients underflow; bfloat16 has float32's range and needs none.
        dtype = fields.get("amp_dtype", torch.float16)
        fields.setdefault("scaler", torch.amp.GradScaler(ctx.device.type, enabled=amp and dtype == torch.float16))
        fields.setdefault("timer", PhaseTimer(ctx.device))
        return cls(
            model=distributed.wrap(raw_model, ctx, bn),
            raw_model=raw_model,
            loss=loss,
            optimizer=optim.build_optimizer(raw_model, schedule),
            schedule=schedule,
            ctx=ctx,
            amp=amp,
            **fields,
        )

    def train_epoch(
        self,
        epoch: int,
        batches: Iterable[dict],
        on_micro_step: OnMicroStep | None = None,
        start: int = 0,
        should_stop: Callable[[], bool] = lambda: False,
        should_save: Callable[[], bool] = lambda: False,
        on_save: Callable[[int], None] | None = None,
        before_micro_step: Callable[[int], None] | None = None,
    ) -> EpochResult:
        """The epoch's micro-batches from index `start` on: a micro-step each, an optimizer step at each window end.

        Returns early, at a window boundary, when should_stop() is true on any rank or after nan_patience skipped
        windows in a row. When should_save() is true on any rank, every rank calls on_save(micro-batches done) at the
        window's end, a boundary a run can resume from. before_micro_step(i), when given, is called as batch i's
        micro-steps are about to run (with bn=window, after its window's statistics pass).
        """
        s, nb, i = self.schedule, self.schedule.batches_per_epoch, start - 1
        numbered = enumerate(batches, start)
        looked = windows_ahead(s, epoch, numbered) if self.window_statistics else one_by_one(numbered)
        timer = self.timer
        for i, batch, upcoming in looked:
            timer.lap("data")  # the loader's next batch (with bn=window, the window's batches) was waited for
            self.ni = ni = epoch * nb + i
            last_in_window = s.steps_after(ni)
            if self.micro_batches_in_window == 0:  # a skipped window must not leave its statistics in BatchNorm
                self._snapshot_buffers()
                self.window_batches = []
            if upcoming:  # bn=window: the statistics of the window's images (this epoch's part of it), then its steps
                self.window_ahead = upcoming
                self.window_statistics(upcoming)
                timer.lap("bn_window")
            if before_micro_step is not None:
                before_micro_step(i)
            if self.window_batches is not None:
                self.window_batches.append(batch)
            if last_in_window:  # the window's collectives follow: gradients in backward(), then the counts
                distributed.arrive(self.ctx, ni)
            # The batch's micro-steps; DDP all-reduces gradients inside the backward of the window's last one only.
            items = self._micro_steps(ni, batch, last_in_window)
            fill = -(-self.micro_batches_in_window // self.split)  # in loader batches, as accumulate counts them
            stop = self._step(ni, should_stop(), should_save()) if last_in_window else False
            if last_in_window:
                timer.lap("step")
            if on_micro_step is not None:
                lr = self.optimizer.param_groups[0]["lr"]
                on_micro_step(i, items, batch["img"].shape[0], fill, s.accumulate_at(ni), lr)
            timer.lap("other")
            if last_in_window:
                if stop:
                    return EpochResult(i + 1, "interrupted")
                if self.nan_patience and self.skipped_in_a_row >= self.nan_patience:
                    return EpochResult(i + 1, "diverged")
                if self.save_due and on_save is not None:
                    on_save(i + 1)
                    timer.lap("save")
        assert i + 1 == nb, f"the loader gave {i + 1} batches, the schedule expects {nb}"
        return EpochResult(nb, None)

    def _snapshot_buffers(self) -> None:
        """Keep the model's buffers (BatchNorm's running statistics); after the first window, in the same tensors."""
        self.window_buffers = Kept(self.raw_model) if self.window_buffers is None else self.window_buffers.keep()

    def _micro_steps(self, ni: int, batch: dict[str, Any], last_in_window: bool) -> torch.Tensor:
        """Forward and backward loader batch ni, the newest of window_batches. On an out-of-memory error, back off
        and run the window again from its first batch, as often as it takes; returns the loss items of batch ni."""
        try:
            return self.iteration(ni, batch, last_in_window)
        except RuntimeError as e:
            if not backoff.is_out_of_memory(e):
                raise
        # Outside the except block: its traceback, whose frames hold the failed step's tensors, is gone.
        backoff.check_can_back_off(self, ni, last_in_window)
        failed = ni
        while True:
            self._back_off(failed)
            self.ni = ni - len(self.window_batches) + 1
            try:
                if self.after_back_off is not None:  # compile=: the new micro-batch sizes, before they run
                    self.after_back_off()
                return self._run_window_again(ni, last_in_window)
            except RuntimeError as e:
                if not backoff.is_out_of_memory(e):
                    raise
                failed = self.ni

    def _drop_window(self) -> None:
        """Drop what the open window has accumulated (gradients, counts, BatchNorm statistics), to run it again."""
        self.optimizer.zero_grad(set_to_none=True)
        self.window_counts.tensor.zero_()
        self.micro_batches_in_window = 0
        if self.window_buffers is not None:
            self.window_buffers.put_back()

    def _run_window_again(self, ni: int, last_in_window: bool) -> torch.Tensor:
        """Run the open window's loader batches again, its first to ni, after an out-of-memory back-off or an AMP
        overflow: bn=window's statistics pass first (the buffers were put back: the same images' again), then each
        micro-step. self.ni follows the batch in progress, so a failure names it. Returns batch ni's loss items."""
        window = self.window_batches
        first = ni - len(window) + 1
        if self.window_statistics is not None:
            self.window_statistics(self.window_ahead)
        for k, batch in enumerate(window):
            self.ni = first + k
            items = self.iteration(self.ni, batch, last_in_window and k == len(window) - 1)
        return items

    def _back_off(self, ni: int) -> None:
        """Drop the window so far (its gradients, counts and BatchNorm statistics) and halve the micro-batch."""
        backoff.check_room(self.micro_batch, ni)
        self._drop_window()
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # give the failed step's cached blocks back before the smaller micro-batches run
        before, self.split = self.micro_batch, self.split * 2
        self.back_offs.append(ni)
        self.log(
            f"iteration {ni}: out of memory at {before} images per device; the window runs again at "
            f"{self.micro_batch} per device, accumulate {self.accumulate}, the same "
            f"{self.schedule.effective_batch} images per step"
        )

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """What the forward runs in: amp_dtype with AMP, else None (float32)."""
        return self.amp_dtype if self.amp else None

    @property
    def micro_batch(self) -> int:
        """Images per forward pass now: the schedule's micro-batch cut `split` ways (rounded up)."""
        return -(-self.schedule.micro_batch // self.split)

    @property
    def accumulate(self) -> int:
        """Micro-batches per window now: the schedule's, times `split`."""
        return self.schedule.accumulate * self.split

    def iteration(self, ni: int, batch: dict[str, Any], last_in_window: bool) -> torch.Tensor:
        """Loader batch ni as `split` micro-steps; DDP all-reduces in the backward of the window's last one only.
        Returns the loss items averaged over the batch's images. faults.install wraps it on an engine whose run
        injects a failure (YOLOACCUM_FAULT); no other engine checks for one."""
        parts = split_batch(batch, self.split)
        items = 0.0
        for j, part in enumerate(parts):
            skip = self.no_sync and not (last_in_window and j == len(parts) - 1)
            with distributed.no_sync(self.model, skip=skip):
                items = items + self.micro_step(part) * part["img"].shape[0]
        return items / batch["img"].shape[0]

    def micro_step(self, batch: dict[str, Any]) -> torch.Tensor:
        """Forward and backward one micro-batch; backward() adds into .grad, so nothing is normalised here."""
        batch["img"] = model_input(batch["img"], self.ctx.device)
        self.timer.lap("to_device")
        with torch.autocast(self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp):
            preds = self.model(batch["img"])
            loss, items, counts = self.loss(preds, batch)
        c = self.window_counts
        c.normaliser += counts  # images and target-score sums, kept on the device: no sync
        c.non_finite_losses += (~torch.isfinite(loss.detach())).float()
        self.micro_batches_in_window += 1
        self.scaler.scale(loss).backward()
        self.timer.lap("forward_backward")
        return items

    def _step(self, ni: int, stop_requested: bool, save_requested: bool = False) -> bool:
        """step(), with running out of memory there (AdamW allocates its state at its first step) a clear stop: the
        weights or the EMA may be half updated, so the window cannot run again as a micro-step can."""
        try:
            return self.step(ni, stop_requested, save_requested)
        except RuntimeError as e:
            if not backoff.is_out_of_memory(e):
                raise
            raise backoff.in_the_step(ni) from e

    def step(self, ni: int, stop_requested: bool = False, save_requested: bool = False) -> bool:
        """End a window: normalise, unscale, clip, step, zero_grad, EMA, once each. Returns whether to stop.

        A window whose loss or unscaled gradient is not finite is skipped: no step, no EMA update, BatchNorm
        statistics put back, gradients zeroed. With AMP an overflow shows as a non-finite norm of the unscaled
        gradients, the same test GradScaler.step makes, so one rule covers both; the scaler then halves its scale.
        """
        c = self.window_counts
        c.stop_votes.fill_(float(stop_requested))
        c.save_votes.fill_(float(save_requested))
        distributed.all_reduce_sum(c.tensor, self.ctx)  # one all-reduce, in place: the global normaliser and votes
        self.loss.normalise_gradients(c.normaliser, self.ctx.world_size)
        self.scaler.unscale_(self.optimizer)
        # foreach: on the CPU torch would otherwise take each gradient's norm and scale it one by one; same values
        norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm=self.clip_grad, foreach=True)
        votes = [c.images, c.non_finite_losses, c.stop_votes, c.save_votes, norm.float().reshape(1)]
        images, bad_losses, stop_votes, save_votes, norm = torch.cat(votes).tolist()  # sync: the window's one
        finite = bad_losses == 0 and math.isfinite(norm)
        if not finite and self._can_replay(bad_losses):
            return self._replay(ni, stop_requested, save_requested)
        optim.set_hyperparameters(self.optimizer, self.schedule, ni)  # also for a skipped step: schedule.csv logs it
        if finite:
            self.scaler.step(self.optimizer)  # the gradients are finite, so it steps
        self.scaler.update()  # after unscale_, also when skipped: an overflow halves the scale (a no-op without AMP)
        self.optimizer.zero_grad(set_to_none=True)
        if finite:
            if self.ema is not None:
                self.ema.update(self.raw_model)
            self.skipped_in_a_row = 0
        else:
            self._skip(ni, "loss" if bad_losses else "gradient")
        record = StepRecord.of(ni, self.micro_batches_in_window, int(images), self.optimizer, finite, self.replayed)
        self.history.append(record)
        c.tensor.zero_()
        self.micro_batches_in_window = 0
        self.replayed = 0
        self.save_due = save_votes > 0
        return stop_votes > 0

    def _can_replay(self, bad_losses: float) -> bool:
        """Whether a window that overflowed runs again: with AMP's scaler, a finite loss whose scaled gradients
        overflowed is the scaler finding its scale (it starts at 2**16), not the data's fault. The window's images
        must be at hand (not a window reopened from last.pt), and half the scale at least AMP_SCALE_FLOOR, below which
        the overflow counts as a non-finite window. Every rank decides alike: the norm is of all-reduced gradients."""
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else 0.0
        return bad_losses == 0 and bool(self.window_batches) and scale * 0.5 >= AMP_SCALE_FLOOR

    def _replay(self, ni: int, stop_requested: bool, save_requested: bool) -> bool:
        """Run the window again at half the scale, as the out-of-memory back-off runs a window again: gradients,
        counts and BatchNorm statistics dropped, the statistics pass and every micro-step run anew on the same
        images; then step() it. No image of the window is lost to the scaler's search."""
        self.scaler.update()  # unscale_ found the overflow: this halves the scale
        self._drop_window()
        self.replayed += 1
        self.replays.append(ni)
        self.log(f"iteration {ni}: AMP overflow, the window runs again at scale {self.scaler.get_scale():g}")
        self._run_window_again(ni, last_in_window=True)
        return self.step(ni, stop_requested, save_requested)

    def _skip(self, ni: int, what: str) -> None:
        """A window not stepped: its BatchNorm statistics put back, and counted towards nan_patience unless it is AMP
        calibrating its scale (an overflow of gradients that were scaled up; GradScaler starts at 2**16)."""
        if self.window_buffers is not None:  # None: a window of micro-steps alone, as tests drive the engine
            self.window_buffers.put_back()
        self.skipped.append(ni)
        scaled = self.scaler.is_enabled()
        scale = self.scaler.get_scale() if scaled else 1.0  # after update(): halved if it overflowed
        if not (scaled and what == "gradient" and scale >= AMP_SCALE_FLOOR):
            self.skipped_in_a_row += 1
        amp = f"; AMP scale now {scale:g}" if scaled else ""
        self.log(f"iteration {ni}: non-finite {what}, window skipped ({len(self.skipped)} so far{amp})")

    def open_window(self) -> dict[str, Any] | None:
        """This rank's part of a window still open (remainder=carry at an epoch's end), on the host, for last.pt: its
        accumulated gradients (scaled by `scale` under AMP), counts and the BatchNorm buffers from its start; None when
        no window is open."""
        if self.micro_batches_in_window == 0:
            return None
        grads = [None if p.grad is None else p.grad.detach().cpu() for p in self.raw_model.parameters()]
        return {
            "grads": grads,
            "counts": self.window_counts.tensor.cpu(),
            "scale": self._scale(),
            "micro_batches": self.micro_batches_in_window,
            "buffers": [b.cpu() for b in self.window_buffers.tensors] if self.window_buffers else [],
        }

    def restore_window(self, window: dict[str, Any] | None) -> None:
        """Reopen a window saved by open_window(): the next micro-batches add to its gradients and counts, which are
        brought to this run's AMP scale (AMP switched on or off, or another scale), as theirs will be."""
        if window is None:
            return
        rescale = self._scale() / window.get("scale", 1.0)  # a window written before "scale" was kept: without AMP
        for p, g in zip(self.raw_model.parameters(), window["grads"], strict=True):
            p.grad = None if g is None else torch.empty_like(p).copy_(g)  # empty_like: the parameter's layout
            if p.grad is not None and rescale != 1.0:
                p.grad.mul_(rescale)
        counts = window["counts"]  # a last.pt from before the save votes' slot holds one number fewer, all counts
        self.window_counts.tensor[: len(counts)].copy_(counts)
        self.window_buffers = Kept(self.raw_model, [b.to(self.ctx.device) for b in window["buffers"]])
        self.micro_batches_in_window = window["micro_batches"]
        self.window_batches = None  # its first batches ran before the stop: an out-of-memory error cannot replay it

    def state_dict(self) -> dict[str, Any]:
        """The state every rank shares, for last.pt: the optimizer, the loss scale, the windows skipped as non-finite
        and how many of the last ones in a row (nan_patience's count goes on across a resume)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "skipped_windows": list(self.skipped),
            "skipped_in_a_row": self.skipped_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if note := load_scaler_state(self.scaler, state["scaler"]):
            self.log(note)
        self.skipped = list(state["skipped_windows"])
        self.skipped_in_a_row = state["skipped_in_a_row"]

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own state for last.pt: its part of an open window, and its back-offs (each halves on resume)."""
        return {"open_window": self.open_window(), "back_offs": list(self.back_offs)}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        self.restore_window(state["open_window"])
        self.back_offs = list(state["back_offs"])
        self.split = 2 ** len(self.back_offs)

    def _scale(self) -> float:
        """What the loss is multiplied by before backward: GradScaler's scale with AMP, else 1."""
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0


def load_scaler_state(scaler: torch.amp.GradScaler, state: dict[str, Any]) -> str | None:
    """Load last.pt's GradScaler state into `scaler`, across AMP settings; returns a line saying what changed, if
    anything. A run saved without AMP (every CPU run) holds an empty state, which GradScaler.load_state_dict refuses:
    resumed with AMP, its scale starts where GradScaler starts. A run saved with AMP and resumed without drops it."""
    if not scaler.is_enabled():
        return "resuming without AMP: the saved loss scale is not used" if state else None
    if not state:
        return f"resuming with AMP a run that trained without it: the loss scale starts at {scaler.get_scale():g}"
    scaler.load_state_dict(state)
    return None
