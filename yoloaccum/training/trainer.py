"""The trainer: runs a run's parts (components.py) epoch by epoch: train, then the end-of-epoch steps
(epoch_end.py: precise BatchNorm statistics, validation, logs, early stopping, saving).

The accumulation loop itself is engine.Engine; *when* to step comes from schedule, the loss normaliser from
loss.WindowLoss, last.pt's layout from state. Rank 0 alone validates, logs and writes; every rank trains. A run can
stop at any window boundary (a signal, or a diverging loss) and resume from last.pt to the same weights.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from yoloaccum.config.settings import Config
from yoloaccum.core import schedule as schedule_
from yoloaccum.core.schedule import PRECISE_BN_FROM_WEIGHTS_WHY, bn_auto_reason, precise_bn_count
from yoloaccum.core.window import EpochResult, StepRecord
from yoloaccum.data import multiscale
from yoloaccum.distributed import ddp as distributed
from yoloaccum.errors import Diverged
from yoloaccum.evaluation import plots
from yoloaccum.evaluation.validate import METRIC_KEYS, show_metrics
from yoloaccum.model import build as model_
from yoloaccum.model import checkpoint, compiler
from yoloaccum.process.memory import frozen_heap
from yoloaccum.process.signals import GracefulStop, Interrupted
from yoloaccum.training import components, epoch_end, faults, state
from yoloaccum.training.clock import RunClock
from yoloaccum.training.components import Parts
from yoloaccum.training.progress import EpochProgress, StepLog
from yoloaccum.training.training_state import TrainingState


class Trainer(Parts):
    """Trains cfg.model on cfg.data with gradient accumulation (see Engine for the step contract).

    Outputs, on rank 0 under project/name: args.yaml, results.csv, schedule.csv, weights/last.pt (everything an exact
    resume needs) and best.pt (stripped for shipping); with plots, the pictures of plots.py; with tensorboard, its log.
    With `ckpt` (a last.pt read by state.read, and the parts built for it), it continues that run from where it was.
    """

    def __init__(self, parts: Parts, ckpt: dict[str, Any] | None = None):
        vars(self).update(vars(parts))  # the run's parts, as components.build made them
        faults.install(self.engine)  # YOLOACCUM_FAULT, if set: failures injected for failure tests
        # Until the first validation, as Ultralytics: zeros, so that every row of results.csv has the same columns.
        zeros = {**dict.fromkeys((*METRIC_KEYS, "fitness"), 0.0), **{f"val/{n}": 0.0 for n in self.loss_names}}
        self.state = TrainingState(patience=self.cfg.patience, metrics=zeros)
        self.train_losses: list[float] = []  # the last epoch's means
        self.epoch_steps: list[StepRecord] = []  # the last epoch's optimizer steps, as the engine took them
        self.steps = StepLog(self.run.path) if self.run else None
        plotted = self.cfg.plots
        self.plot_at = plots.train_batch_indices(self.schedule, self.cfg.close_mosaic) if plotted else frozenset()
        self.rank_states: list[dict] | None = None  # on rank 0, every rank's, gathered before each save
        self.compiled: compiler.Compiled | None = None  # compile=: compiled at the start of train()
        self.drawing: plots.Background | None = None  # labels.jpg, drawn in the background
        self.precise_bn = epoch_end.PreciseBN(
            precise_bn_count(
                self.cfg.precise_bn, len(self.train_set), from_weights=self.cfg.from_weights, bn=self.cfg.bn
            )
        )
        self.clock = RunClock(None, 0)  # time= and save_minutes=: started with train()
        self.epoch_end = epoch_end.steps(self)
        if ckpt is not None:
            state.restore(self, ckpt)

    @classmethod
    def from_config(cls, cfg: Config, ckpt: dict[str, Any] | None = None, ckpt_path: Path | None = None) -> Trainer:
        return cls(components.build(cfg, ckpt, ckpt_path), ckpt)

    def train(self) -> dict[str, float]:
        """Run the remaining epochs; returns the final metrics (best.pt's, as Ultralytics' final_eval)."""
        cfg = self.cfg
        self._announce()
        if cfg.compile:  # before the clock starts: compile time is reported on its own, not in the first epoch's
            self._compile()
        self.train_start = time.perf_counter()
        self.clock = RunClock(cfg.time, cfg.save_minutes, is_main=self.ctx.is_main)
        bounded = distributed.bounded(self.ctx, lambda: self.engine.ni, cfg.ddp_timeout)  # a hung rank: named
        with GracefulStop() as stop_signal, frozen_heap(), bounded, self._closing_steps():

            def should_stop() -> bool:  # a signal, or time= spent
                return stop_signal() or self.clock.over_time()

            if self.run and cfg.plots and self.state.position == (0, 0):  # drawn while the first epoch trains
                self.drawing = plots.Background(plots.labels, self.train_set, self.spec.names, self.run.path)
            epoch, start = self.state.position
            first_epoch = epoch
            while True:
                s = self.schedule  # time= re-estimates its epochs after each epoch
                if cfg.close_mosaic and epoch >= s.epochs - cfg.close_mosaic and not self.state.mosaic_closed:
                    self._close_mosaic()
                result, images_per_second = self.train_epoch(epoch, start, should_stop)
                ended = None
                if result.done < s.batches_per_epoch:  # stopped inside the epoch, at a window boundary
                    self.save_position(epoch, result.done)
                else:
                    self.loss.end_epoch()
                    if cfg.time:  # before the epoch's end steps, which ask whether it was the last
                        self._fit_epochs_to_time(epoch + 1, epoch + 1 - first_epoch)
                    ended = self.end_epoch(epoch, images_per_second)
                    # A signal after the epoch's last window (during validation, say) stops here, last.pt just saved,
                    # rather than after one more window.
                    if ended is None and result.stopped is None and self._agree(should_stop()):
                        result = EpochResult(result.done, "interrupted")
                if reason := stop_reason(result.stopped, ended):
                    break
                epoch, start = epoch + 1, 0
        distributed.barrier(self.ctx)
        if reason == "interrupted" and cfg.time and not self._agree(stop_signal()):
            self._say_time_spent(epoch, result.done)  # time= ends a run as its last epoch would: best.pt validated
        elif reason in {"diverged", "interrupted"}:
            self._raise_stopped(reason, stop_signal)
        return self.final_eval()

    def _fit_epochs_to_time(self, epochs_done: int, epochs_done_here: int) -> None:
        """time=: as many epochs as the time left holds at this process's mean epoch time, as Ultralytics' trainer
        re-estimates them; the lr decay follows the new count. Rank 0's estimate is every rank's."""
        estimate = self.clock.epochs_for_budget(epochs_done, epochs_done_here) if self.ctx.is_main else 0
        flag = torch.tensor([float(estimate)], device=self.ctx.device)
        epochs = int(distributed.all_reduce_sum(flag, self.ctx).item())
        if epochs != self.schedule.epochs:
            self.schedule = self.engine.schedule = schedule_.extend(self.schedule, epochs)

    def _say_time_spent(self, epoch: int, done: int) -> None:
        if self.run is None:
            return
        s, last = self.schedule, self.run.weights / "last.pt"
        where = (
            f"in epoch {epoch + 1}/{s.epochs} at micro-batch {done}"
            if done < s.batches_per_epoch
            else (f"after epoch {epoch + 1}/{s.epochs}")
        )
        self.run.console.print(
            f"time={self.cfg.time:g} hours spent: stopped {where}; to train on, yoloaccum train resume={last} "
            f"time=HOURS"
        )

    def _save_now(self, epoch: int, done: int) -> None:
        """save_minutes=: last.pt at this window boundary, every rank together; training goes on."""
        self._flush_steps()
        self.save_position(epoch, done)
        self.clock.saved()

    @contextmanager
    def _closing_steps(self) -> Iterator[None]:
        """The end-of-epoch steps that hold a file (TensorBoard's) close it when training ends, however it ends."""
        try:
            yield
        finally:
            for step in self.epoch_end:
                getattr(step, "close", lambda: None)()

    def _announce(self) -> None:
        """The run's first lines: what it trains, with which schedule, and the BatchNorm mode's choice."""
        s, cfg = self.schedule, self.cfg
        if self.run is None:
            return
        self.run.announce(
            s, len(self.train_set), self.ctx, self.loader.num_workers, self.precise_bn.num_images, self.batch_choice
        )
        pool = self.train_set.max_buffer_length
        theirs = min(len(self.train_set), s.micro_batch * 8, 1000)  # Ultralytics' sizing, by the micro-batch
        if cfg.mosaic and cfg.mosaic_buffer == "window" and pool > theirs:
            self.run.console.print(
                f"mosaic: each image's partners come from the last {pool} images loaded, as a real "
                f"batch of {s.effective_batch} draws them (mosaic_buffer=window; sized by the "
                f"micro-batch, as Ultralytics does, it would be {theirs})"
            )
        if self.frozen:
            layers = _layer_list(self.frozen)
            self.run.console.print(
                f"freeze={cfg.freeze}: layers {layers} frozen: no gradient, no update, and their BatchNorm statistics "
                "kept as loaded" + (" (bn=window and precise_bn leave them alone)" if self.bn == "window" else "")
            )
        reason = bn_auto_reason(s.micro_batch, cfg.from_weights)
        chosen = f"bn=auto chose bn={self.bn} {reason}" if cfg.bn == "auto" else ""
        if self.bn == "window":
            window = s.effective_batch // self.ctx.world_size
            images = f"first {min(cfg.bn_window, window)}" if cfg.bn_window else str(window)
            self.run.console.print(
                f"BatchNorm: {chosen or 'bn=window'}: each micro-batch of {s.micro_batch} "
                f"normalised with the statistics of its window's {images} images on its device, "
                "from a forward pass over them before the window's first micro-step"
            )
        elif chosen:
            self.run.console.print(
                f"BatchNorm: {chosen}: each micro-batch normalised with its own statistics, as Ultralytics does"
            )
        elif self.bn == "frozen":
            start = "as loaded" if cfg.from_weights else "as initialised (mean 0, variance 1)"
            trained = "its weight and bias train" + (" (outside freeze=)" if self.frozen else "")
            auto = cfg.precise_bn == "auto"
            kept = "; precise_bn=auto recomputes none, as its weights train against them" if auto else ""
            self.run.console.print(
                f"BatchNorm: bn=frozen: every BatchNorm layer normalises with its running statistics {start} and "
                f"keeps them; {trained}{kept}"
            )
        if cfg.precise_bn == "auto" and cfg.from_weights and cfg.bn != "frozen":
            self.run.console.print(PRECISE_BN_FROM_WEIGHTS_WHY)

    def _compile(self) -> None:
        say = self.run.console.print if self.run else (lambda message: None)
        self.compiled = compiler.for_run(self.cfg, self.engine, len(self.train_set), say)
        if self.compiled is not None:
            self.engine.after_back_off = lambda: self._compile_after_back_off(say)

    def _compile_after_back_off(self, say) -> None:
        self.compiled = compiler.after_back_off(self.compiled, self.engine, len(self.train_set), self.cfg.imgsz, say)

    def train_epoch(self, epoch: int, start: int, should_stop) -> tuple[EpochResult, float]:
        """The epoch's micro-batches from `start` on, through the engine; also images per second over all devices."""
        s, cfg = self.schedule, self.cfg
        self.loader.batch_sampler.set_epoch(epoch, start)
        self.engine.model.train()
        model_.set_bn_mode(self.engine.model, cfg.bn, self.frozen)
        progress = EpochProgress(
            epoch,
            s.epochs,
            s.batches_per_epoch,
            self.loss_names,
            self.cfg.log_every,
            self.ctx.device,
            enabled=self.run is not None,
        )

        def on_micro_step(i, items, images, fill, accumulate, lr):
            progress.update(i, items, images, fill, accumulate, s.batch * accumulate, lr)
            if s.steps_after(ni := epoch * s.batches_per_epoch + i):
                progress.end_window(skipped=ni in self.engine.skipped[-1:])

        batches = self.loader
        if self.run and self.plot_at:
            batches = plots.train_batches(
                batches, epoch * s.batches_per_epoch + start, self.plot_at, self.run.path, self.spec.names
            )
        if cfg.multi_scale:  # where batches leave the loader: bn=window's pass sees the sizes the micro-steps train
            batches = multiscale.resized(batches, cfg.imgsz, cfg.multi_scale, cfg.seed, epoch, start, self.ctx.device)
        try:
            result = self.engine.train_epoch(
                epoch,
                batches,
                on_micro_step,
                start,
                should_stop,
                should_save=self.clock.save_due,
                on_save=lambda done: self._save_now(epoch, done),
            )
        finally:
            progress.close()
        self._flush_steps()
        self.train_losses = progress.mean_losses()
        return result, progress.images_per_second() * self.ctx.world_size

    def _flush_steps(self) -> None:
        """The optimizer steps the engine took since the last flush, into schedule.csv (and epoch_steps)."""
        self.epoch_steps = list(self.engine.history)
        self.engine.history.clear()
        if self.steps:
            self.steps.append(self.epoch_steps, self.schedule.batches_per_epoch)

    def _raise_stopped(self, reason: str, stop_signal: GracefulStop) -> None:
        weights = self.run.weights / "last.pt" if self.run else "last.pt"
        saved = Path(weights).exists() and self.cfg.save
        if reason == "diverged":
            skipped = self.engine.skipped[-self.cfg.nan_patience :]
            kept = f"{weights} holds the last good state" if saved else "nothing was saved (save=False)"
            raise Diverged(
                f"training diverged: {self.cfg.nan_patience} windows in a row had a non-finite loss or gradient "
                f"(iterations {', '.join(map(str, skipped))}); {kept}; lower lr0 or clip_grad, or check the data"
            )
        hint = f"; resume with: yoloaccum train resume={weights}" if saved else " (save=False)"
        raise Interrupted(stop_signal.signum, f"stopped{hint}")

    def final_eval(self) -> dict[str, float]:
        """As Ultralytics: the final figures are best.pt's, validated on rank 0 after training; with plots=True this
        validation also draws its batches, confusion matrices and curves."""
        if self.run is None:
            return self.state.metrics
        best = self.run.weights / "best.pt"
        if self.cfg.save and best.exists():
            model, title = checkpoint.model_of(checkpoint.load(best)), f"final figures: {best} validated"
        else:
            model, title = copy.deepcopy(self.ema.ema), "final figures: the last epoch's EMA (save=False)"
        self.follow_back_offs()
        if self.drawing is not None:
            self.drawing.join()  # labels.jpg is done before the validation draws its curves
        metrics = self.evaluator.evaluate(model.fuse(verbose=False).to(self.ctx.device), plots=self.cfg.plots)
        show_metrics(self.run.console, metrics, title)
        return metrics

    @property
    def loss_names(self) -> tuple[str, ...]:
        return tuple(getattr(self.loss.criterion, "one2one", self.loss.criterion).loss_names)

    def _close_mosaic(self) -> None:
        from yoloaccum.config.ultra import ultralytics_args

        self.train_set.close_mosaic(hyp=ultralytics_args(self.cfg))  # sets mosaic, mixup, cutmix to 0
        self.loader = components.build_loader(self)  # workers hold a copy of the dataset: start them again
        self.state.mosaic_closed = True

    def end_epoch(self, epoch: int, images_per_second: float) -> str | None:
        """The end-of-epoch steps (epoch_end.steps), then the one decision every rank takes together: "final" or
        "patience" when training ends here, else None."""
        end = epoch_end.EpochEnd(epoch, final=epoch + 1 == self.schedule.epochs, images_per_second=images_per_second)
        for step in self.epoch_end:
            step(self, end)
        ended = "final" if end.final else end.stop
        return ("patience", "final")[end.final] if self._agree(ended is not None) else None

    def follow_back_offs(self) -> None:
        """Validation batches of twice the micro-batch, as at the start, also after an out-of-memory back-off."""
        val_batch = max(1, 2 * self.engine.micro_batch)
        if val_batch < self.evaluator.batch:
            self.evaluator.set_batch(val_batch)

    def _agree(self, stop: bool) -> bool:
        """Every rank stops together: rank 0 decided; the others wait here while it validated and saved."""
        flag = torch.tensor([float(stop)], device=self.ctx.device)
        return bool(distributed.all_reduce_sum(flag, self.ctx).item())

    def save_position(self, epoch: int, done: int) -> None:
        """last.pt at a window boundary inside an epoch (a stop): no partial gradients, the next image's position."""
        for step in self.epoch_end:
            getattr(step, "write_steps", lambda t: None)(self)  # the TensorBoard log's steps so far
        self.gather_rank_states()
        if self.run is not None and self.cfg.save:
            ckpt = state.of(self, (epoch, done), interrupted=True)
            checkpoint.save_atomic(ckpt, self.run.weights / "last.pt")
        distributed.barrier(self.ctx)

    def gather_rank_states(self) -> None:
        """Every rank's state.rank_state() to rank 0, for the next save. A collective: every rank calls it, at the
        point of the epoch (or stop) where its random states are those the next epoch starts from."""
        if self.cfg.save:  # the same on every rank, so all of them skip it together
            self.rank_states = distributed.gather_to_main(state.rank_state(self), self.ctx)

    def plot_schedule(self) -> None:
        """schedule.png, from the optimizer steps the run logged in schedule.csv (plots=True)."""
        if self.cfg.plots:
            plots.schedule(self.steps.file, self.run.path / "schedule.png")


def _layer_list(frozen: tuple[str, ...]) -> str:
    """freeze's prefixes as a user reads them: "0-9", or "0, 2, 23.cv2"."""
    names = [p.removeprefix("model.").rstrip(".") for p in frozen]
    if all(n.isdigit() for n in names) and [int(n) for n in names] == list(range(len(names))) and len(names) > 2:
        return f"0-{len(names) - 1}"
    return ", ".join(names)


def stop_reason(stopped: str | None, ended: str | None) -> str | None:
    """The one decision to stop, and why. `stopped` is the engine's ("interrupted" by a signal, "diverged"), `ended`
    the epoch's end ("final" epoch, or early stopping's "patience"). A divergence wins; a run whose last epoch is done
    has finished, even if a signal arrived in its last window."""
    if stopped == "diverged":
        return stopped
    return ended or stopped
