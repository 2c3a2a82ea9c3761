"""The trainer: runs a run's parts (components.py) epoch by epoch: train, then the end-of-epoch steps (epoch_end.py:
precise BatchNorm statistics, validation, logs, early stopping, saving).

The accumulation loop itself is engine.Engine; *when* to step comes from schedule, the loss normaliser from
loss.WindowLoss, last.pt's layout from state. Every rank trains and validates its share of the images; rank 0 alone logs
and writes. A run can stop at any window boundary (a signal, or a diverging loss) and resume from last.pt to the same
weights.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from yoloaccum.batchnorm import precise as precise_bn
from yoloaccum.config.settings import Config
from yoloaccum.core import schedule as schedule_
from yoloaccum.core.schedule import PRECISE_BN_FROM_WEIGHTS_WHY, bn_auto_reason, precise_bn_count
from yoloaccum.core.window import EpochResult, StepRecord
from yoloaccum.data import datasets as data
from yoloaccum.data import multiscale
from yoloaccum.distributed import ddp as distributed
from yoloaccum.errors import Diverged
from yoloaccum.evaluation import plots
from yoloaccum.evaluation.validate import METRIC_KEYS, show_metrics
from yoloaccum.model import build as model_
from yoloaccum.model import checkpoint, compiler
from yoloaccum.process.memory import frozen_heap
from yoloaccum.process.signals import GracefulStop, Interrupted
from yoloaccum.training import callbacks as callbacks_
from yoloaccum.training import components, epoch_end, faults, state, time_report
from yoloaccum.training.clock import RunClock
from yoloaccum.training.parts import Parts
from yoloaccum.training.progress import EpochProgress, StepLog
from yoloaccum.training.tensorboard import TensorBoard
from yoloaccum.training.training_state import TrainingState


class Trainer:
    """Trains cfg.model on cfg.data with gradient accumulation (see Engine for the step contract).

    Outputs, on rank 0 under project/name: args.yaml, results.csv, schedule.csv, weights/last.pt (everything an exact
    resume needs) and best.pt (stripped for shipping); with plots, the pictures of plots.py; with tensorboard, its log.
    With `ckpt` (a last.pt read by state.read, and the parts built for it), it continues that run from where it was.
    The trainer composes the run's parts (parts.Parts) and its own: the training state, the end-of-epoch steps.
    """

    def __init__(self, parts: Parts, ckpt: dict[str, Any] | None = None, callbacks: callbacks_.Callbacks | None = None):
        self.parts = parts
        p = parts
        faults.install(p.engine)  # YOLOACCUM_FAULT, if set: failures injected for failure tests
        # Until the first validation, as Ultralytics: zeros, so that every row of results.csv has the same columns.
        zeros = {**dict.fromkeys((*METRIC_KEYS, "fitness"), 0.0), **{f"val/{n}": 0.0 for n in self.loss_names}}
        self.state = TrainingState(patience=p.cfg.patience, metrics=zeros)
        self.epoch_steps: list[StepRecord] = []  # the last epoch's optimizer steps, as the engine took them
        self.train_losses: list[float] = []  # the last epoch's means
        self.train_seconds = 0.0  # the last epoch's training time
        self.steps = StepLog(p.run.path) if p.run else None
        plotted = p.cfg.plots
        self.plot_at = plots.train_batch_indices(p.schedule, p.cfg.close_mosaic) if plotted else frozenset()
        self.compiled: compiler.Compiled | None = None  # compile=: compiled at the start of train()
        self.drawing: plots.Background | None = None  # labels.jpg, drawn in the background
        count = precise_bn_count(p.cfg.precise_bn, len(p.train_set), from_weights=p.cfg.from_weights, bn=p.bn)
        self.precise_bn = epoch_end.PreciseBN(count, p.cfg, p.spec, p.ctx, p.ema, p.frozen)
        self.rank_states = epoch_end.RankStates(lambda: state.rank_state(self.parts), p.ctx, enabled=p.cfg.save)
        self.clock = RunClock(None, 0)  # time= and save_minutes=: started with train()
        self.train_start = 0.0
        self.epochs_run = 0  # by this process (the time report's)
        # Ultralytics' events: one's own callbacks, then the trackers its settings enable; rank 0's alone
        self.events = callbacks_.Events.for_run(callbacks or {}, parts.ctx.is_main and parts.run is not None)
        self.epoch_end = self._steps()
        if ckpt is not None:
            self._restore(ckpt)
        self.events.attach(self)

    def _steps(self) -> list[epoch_end.Step]:
        """This rank's end-of-epoch steps, in order: the collective ones on every rank, then rank 0's."""
        p = self.parts
        every: list[epoch_end.Step] = [
            self.precise_bn,
            epoch_end.SameBuffers(p.ema, p.ctx),
            epoch_end.Validate(p.evaluator, p.ema, p.loss.criterion, self.state, p.cfg.val, self.follow_back_offs),
            epoch_end.EarlyStopping(self.state),
            self.rank_states,
        ]
        if p.run is None:
            return every
        board = TensorBoard.for_run(p.run) if p.cfg.tensorboard else None  # None also without the package
        console = p.run.console if p.cfg.verbose else None
        steps = [
            *every,
            epoch_end.ResultsRow(p.run.results, p.engine, self.state, self.loss_names, console, self._elapsed),
            *([board] if board else []),
        ]
        if p.cfg.save:
            steps.append(epoch_end.Save(p.run.weights, p.cfg.save_period, self.checkpoint))
        if self.events.callbacks:
            steps.append(callbacks_.EpochEnded(self.events, saved=p.cfg.save))
        return steps

    def add_step(self, step: epoch_end.Step, before: type | None = None) -> None:
        """Run `step(end, decided) -> decided` at every epoch's end on this rank: before the first step of type
        `before` (say epoch_end.Save, to see the row before last.pt is written), else after the others."""
        at = next((i for i, s in enumerate(self.epoch_end) if before and isinstance(s, before)), len(self.epoch_end))
        self.epoch_end.insert(at, step)

    def checkpoint(self, finished: bool = False, interrupted: bool = False) -> dict[str, Any]:
        """last.pt's content now: the parts' states at the training state's position (state.of)."""
        return state.of(self.parts, self.state, self.rank_states.for_save(), finished, interrupted)

    def _restore(self, ckpt: dict[str, Any]) -> None:
        """Continue from a checkpoint: the parts' and the training state's states, and the logs cut back to it."""
        state.restore(self.parts, self.state, ckpt)
        epoch, batch = self.state.position
        if self.parts.run is not None:
            self.parts.run.results.truncate(epoch)
            self.steps.truncate(epoch * self.parts.schedule.batches_per_epoch + batch)
            self.parts.run.console.print(f"resuming {self.parts.run.path} at epoch {epoch + 1}, micro-batch {batch}")

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        ckpt: dict[str, Any] | None = None,
        ckpt_path: Path | None = None,
        callbacks: callbacks_.Callbacks | None = None,
    ) -> Trainer:
        return cls(components.build(cfg, ckpt, ckpt_path), ckpt, callbacks)

    def train(self) -> dict[str, float]:
        """Run the remaining epochs; returns the final metrics (best.pt's, as Ultralytics' final_eval)."""
        cfg, events = self.parts.cfg, self.events
        events.run("on_pretrain_routine_start")
        self._announce()
        if cfg.compile:  # before the clock starts: compile time is reported on its own, not in the first epoch's
            self._compile()
        events.run("on_pretrain_routine_end")
        events.run("on_train_start")
        self.train_start = time.perf_counter()
        self.parts.engine.timer.restart()  # the time split counts from here (compile time is reported on its own)
        if cfg.bn_adapt and self.state.position == (0, 0):  # a resumed run has them in last.pt already
            self.adapt_batchnorm()
        self.clock = RunClock(cfg.time, cfg.save_minutes, is_main=self.parts.ctx.is_main)
        p = self.parts
        bounded = distributed.bounded(p.ctx, lambda: p.engine.ni, cfg.ddp_timeout)  # a hung rank: named
        with GracefulStop() as stop_signal, frozen_heap(), bounded, self._closing_steps():

            def should_stop() -> bool:  # a signal, or time= spent
                return stop_signal() or self.clock.over_time()

            if self.parts.run and cfg.plots and self.state.position == (0, 0):  # drawn while the first epoch trains
                self.drawing = plots.Background(
                    plots.labels, self.parts.train_set, self.parts.spec.names, self.parts.run.path
                )
            epoch, start = self.state.position
            first_epoch = epoch
            while True:
                s = self.parts.schedule  # time= re-estimates its epochs after each epoch
                if cfg.close_mosaic and epoch >= s.epochs - cfg.close_mosaic and not self.state.mosaic_closed:
                    self._close_mosaic()
                events.run("on_train_epoch_start", epoch)
                result, images_per_second = self.train_epoch(epoch, start, should_stop)
                ended = None
                if result.done < s.batches_per_epoch:  # stopped inside the epoch, at a window boundary
                    self.save_position(epoch, result.done)
                else:
                    self.parts.loss.end_epoch()
                    if cfg.time:  # before the epoch's end steps, which ask whether it was the last
                        self._fit_epochs_to_time(epoch + 1, epoch + 1 - first_epoch)
                    events.run("on_train_epoch_end", epoch)  # as Ultralytics: before validation
                    ended = self.end_epoch(epoch, images_per_second)
                    # A signal after the epoch's last window (during validation, say) stops here, last.pt just saved,
                    # rather than after one more window.
                    if ended is None and result.stopped is None and self._agree(should_stop()):
                        result = EpochResult(result.done, "interrupted")
                if reason := stop_reason(result.stopped, ended):
                    break
                epoch, start = epoch + 1, 0
        distributed.barrier(self.parts.ctx)
        if reason == "interrupted" and cfg.time and not self._agree(stop_signal()):
            self._say_time_spent(epoch, result.done)  # time= ends a run as its last epoch would: best.pt validated
        elif reason in {"diverged", "interrupted"}:
            self._raise_stopped(reason, stop_signal)
        return self.final_eval()

    def _fit_epochs_to_time(self, epochs_done: int, epochs_done_here: int) -> None:
        """time=: as many epochs as the time left holds at this process's mean epoch time, as Ultralytics' trainer
        re-estimates them; the lr decay follows the new count. Rank 0's estimate is every rank's."""
        estimate = self.clock.epochs_for_budget(epochs_done, epochs_done_here) if self.parts.ctx.is_main else 0
        flag = torch.tensor([float(estimate)], device=self.parts.ctx.device)
        epochs = int(distributed.all_reduce_sum(flag, self.parts.ctx).item())
        if epochs != self.parts.schedule.epochs:
            self.parts.schedule = self.parts.engine.schedule = schedule_.extend(self.parts.schedule, epochs)

    def _say_time_spent(self, epoch: int, done: int) -> None:
        if self.parts.run is None:
            return
        s, last = self.parts.schedule, self.parts.run.weights / "last.pt"
        where = (
            f"in epoch {epoch + 1}/{s.epochs} at micro-batch {done}"
            if done < s.batches_per_epoch
            else (f"after epoch {epoch + 1}/{s.epochs}")
        )
        self.parts.run.console.print(
            f"time={self.parts.cfg.time:g} hours spent: stopped {where}; to train on, yoloaccum train resume={last} "
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
        s, cfg = self.parts.schedule, self.parts.cfg
        if self.parts.run is None:
            return
        self.parts.run.announce(
            s,
            len(self.parts.train_set),
            self.parts.ctx,
            self.parts.loader.num_workers,
            self.precise_bn.num_images,
            self.parts.batch_choice,
        )
        if trackers := self.events.trackers:
            names = ", ".join(trackers)
            off = " ".join(f"{t}=False" for t in trackers)
            self.parts.run.console.print(
                f"trackers: {names}, as Ultralytics' settings switch them on (`yolo settings {off}` switches them off)"
            )
        pool = self.parts.train_set.max_buffer_length
        theirs = min(len(self.parts.train_set), s.micro_batch * 8, 1000)  # Ultralytics' sizing, by the micro-batch
        if cfg.mosaic and cfg.mosaic_buffer == "window" and pool > theirs:
            self.parts.run.console.print(
                f"mosaic: each image's partners come from the last {pool} images loaded, as a real "
                f"batch of {s.effective_batch} draws them (mosaic_buffer=window; sized by the "
                f"micro-batch, as Ultralytics does, it would be {theirs})"
            )
        if self.parts.frozen:
            layers = _layer_list(self.parts.frozen)
            self.parts.run.console.print(
                f"freeze={cfg.freeze}: layers {layers} frozen: no gradient, no update, and their BatchNorm statistics "
                "kept as loaded" + (" (bn=window and precise_bn leave them alone)" if self.parts.bn == "window" else "")
            )
        reason = bn_auto_reason(s.micro_batch, cfg.from_weights)
        chosen = f"bn=auto chose bn={self.parts.bn} {reason}" if cfg.bn == "auto" else ""
        if self.parts.bn == "window":
            window = s.effective_batch // self.parts.ctx.world_size
            images = f"first {min(cfg.bn_window, window)}" if cfg.bn_window else str(window)
            self.parts.run.console.print(
                f"BatchNorm: {chosen or 'bn=window'}: each micro-batch of {s.micro_batch} "
                f"normalised with the statistics of its window's {images} images on its device, "
                "from a forward pass over them before the window's first micro-step"
            )
        elif chosen:
            self.parts.run.console.print(
                f"BatchNorm: {chosen}: each micro-batch normalised with its own statistics, as Ultralytics does"
            )
        elif self.parts.bn == "frozen":
            start = "as loaded" if cfg.from_weights else "as initialised (mean 0, variance 1)"
            if cfg.bn_adapt:
                start = f"adapted to this data over {cfg.bn_adapt} training images before the first step"
            trained = "its weight and bias train" + (" (outside freeze=)" if self.parts.frozen else "")
            auto = cfg.precise_bn == "auto"
            kept = "; precise_bn=auto recomputes none, as its weights train against them" if auto else ""
            self.parts.run.console.print(
                f"BatchNorm: bn=frozen: every BatchNorm layer normalises with its running statistics {start} and "
                f"keeps them; {trained}{kept}"
            )
        if cfg.precise_bn == "auto" and cfg.from_weights and self.parts.bn != "frozen":
            self.parts.run.console.print(PRECISE_BN_FROM_WEIGHTS_WHY)

    def adapt_batchnorm(self) -> None:
        """bn_adapt=N (with bn=frozen): every BatchNorm's running statistics outside freeze= recomputed over N
        training images before the first step (precise BatchNorm's machinery and images: drawn from the seed alone,
        each rank its share, summed over the ranks), then kept by bn=frozen; the EMA takes them too. Adaptive
        BatchNorm (Li et al., 2016): the weights then train against the statistics they will be validated with."""
        p, start = self.parts, time.perf_counter()
        images = data.precise_bn_images(p.cfg, p.spec, p.cfg.bn_adapt, p.ctx.rank, p.ctx.world_size)
        precise_bn.recompute_images(p.raw_model, images, p.ctx, frozen=p.frozen)
        for mine, theirs in zip(precise_bn.bn_layers(p.ema.ema, p.frozen), precise_bn.bn_layers(p.raw_model, p.frozen)):
            mine.running_mean.copy_(theirs.running_mean)
            mine.running_var.copy_(theirs.running_var)
        p.engine.timer.lap("precise_bn")
        if p.run is not None:
            p.run.console.print(
                f"BatchNorm: running statistics adapted to this data over {p.cfg.bn_adapt} training images "
                f"({len(images) * p.ctx.world_size} drawn) in {time.perf_counter() - start:.1f} s; bn=frozen keeps them"
            )

    def _compile(self) -> None:
        say = self.parts.run.console.print if self.parts.run else (lambda message: None)
        p = self.parts
        self.compiled = compiler.for_run(p.cfg, p.engine, len(p.train_set), say, p.bn, p.frozen)
        if self.compiled is not None:
            self.parts.engine.after_back_off = lambda: self._compile_after_back_off(say)

    def _compile_after_back_off(self, say) -> None:
        self.compiled = compiler.after_back_off(
            self.compiled, self.parts.engine, len(self.parts.train_set), self.parts.cfg.imgsz, say
        )

    def train_epoch(self, epoch: int, start: int, should_stop) -> tuple[EpochResult, float]:
        """The epoch's micro-batches from `start` on, through the engine; also images per second over all devices."""
        s, cfg = self.parts.schedule, self.parts.cfg
        self.parts.loader.batch_sampler.set_epoch(epoch, start)
        self.parts.engine.model.train()
        model_.set_bn_mode(self.parts.engine.model, self.parts.bn, self.parts.frozen)
        progress = EpochProgress(
            epoch,
            s.epochs,
            s.batches_per_epoch,
            self.loss_names,
            self.parts.cfg.log_every,
            self.parts.ctx.device,
            enabled=self.parts.run is not None,
            split=self.parts.engine.timer.current,
        )

        batch_ended = "on_train_batch_end" in self.events

        def on_micro_step(i, items, images, fill, accumulate, lr):
            progress.update(i, items, images, fill, accumulate, s.batch * accumulate, lr)
            if batch_ended:
                self.events.run("on_train_batch_end", epoch)
            if s.steps_after(ni := epoch * s.batches_per_epoch + i):
                progress.end_window(skipped=ni in self.parts.engine.skipped[-1:])
                self.state.position = (epoch, i + 1)  # a window boundary: where a resume would continue

        batches = self.parts.loader
        if self.parts.run and self.plot_at:
            batches = plots.train_batches(
                batches,
                epoch * s.batches_per_epoch + start,
                self.plot_at,
                self.parts.run.path,
                self.parts.spec.names,
                self.parts.engine.timer,
            )
        if cfg.multi_scale:  # where batches leave the loader: bn=window's pass sees the sizes the micro-steps train
            batches = multiscale.resized(
                batches, cfg.imgsz, cfg.multi_scale, cfg.seed, epoch, start, self.parts.ctx.device
            )
        batch_starts = "on_train_batch_start" in self.events
        started = time.perf_counter()
        try:
            result = self.parts.engine.train_epoch(
                epoch,
                batches,
                on_micro_step,
                start,
                should_stop,
                should_save=self.clock.save_due,
                on_save=lambda done: self._save_now(epoch, done),
                before_micro_step=(lambda i: self.events.run("on_train_batch_start", epoch)) if batch_starts else None,
            )
        finally:
            progress.close()
        self._flush_steps()
        self.train_losses = progress.mean_losses()
        self.train_seconds = time.perf_counter() - started
        return result, progress.images_per_second() * self.parts.ctx.world_size

    def _flush_steps(self) -> None:
        """The optimizer steps the engine took since the last flush, into schedule.csv (and epoch_steps)."""
        self.epoch_steps = list(self.parts.engine.history)
        self.parts.engine.history.clear()
        if self.steps:
            self.steps.append(self.epoch_steps, self.parts.schedule.batches_per_epoch)

    def _raise_stopped(self, reason: str, stop_signal: GracefulStop) -> None:
        weights = self.parts.run.weights / "last.pt" if self.parts.run else "last.pt"
        saved = Path(weights).exists() and self.parts.cfg.save
        if reason == "diverged":
            skipped = self.parts.engine.skipped[-self.parts.cfg.nan_patience :]
            kept = f"{weights} holds the last good state" if saved else "nothing was saved (save=False)"
            raise Diverged(
                f"training diverged: {self.parts.cfg.nan_patience} windows in a row had a non-finite loss or gradient "
                f"(iterations {', '.join(map(str, skipped))}); {kept}; lower lr0 or clip_grad, or check the data"
            )
        hint = f"; resume with: yoloaccum train resume={weights}" if saved else " (save=False)"
        raise Interrupted(stop_signal.signum, f"stopped{hint}")

    def final_eval(self) -> dict[str, float]:
        """As Ultralytics: the final figures are best.pt's, validated after training, each rank its share of the
        images; with plots=True rank 0 also draws its batches, confusion matrices and curves. best.pt is on rank 0's
        machine: its weights reach the other ranks from there."""
        p = self.parts
        p.engine.timer.lap("other")
        best = p.run.weights / "best.pt" if p.run else None
        from_best = distributed.from_main(bool(p.cfg.save and best and best.exists()), p.ctx)
        model, title = copy.deepcopy(p.ema.ema), "final figures: the last epoch's EMA (save=False)"
        if from_best:
            weights = self._best_weights(best) if p.ctx.is_main else None
            model.load_state_dict(distributed.from_main(weights, p.ctx))
            title = f"final figures: {best} validated"
        else:  # rank 0's buffers, as at every validation (epoch_end.SameBuffers)
            distributed.broadcast_buffers(model, p.ctx)
        self.follow_back_offs()
        if self.drawing is not None:
            self.drawing.join()  # labels.jpg is done before the validation draws its curves
        metrics = p.evaluator.evaluate(model.fuse(verbose=False).to(p.ctx.device), plots=p.cfg.plots)
        if p.run is not None:
            show_metrics(p.run.console, metrics, title)
        p.engine.timer.lap("validation")
        self.events.after_fitting(metrics, self.state.position[0] - 1)  # as Ultralytics' final_eval
        return metrics

    def _best_weights(self, best: Path) -> dict[str, torch.Tensor]:
        """best.pt's weights, in full precision on the CPU: as this process wrote them (the same half-precision
        tensors, converted as reading the file converts them, 0.2 s of reading and unpickling spared), or read from the
        file, which an earlier process of a resumed run wrote."""
        save = next((s for s in self.epoch_end if isinstance(s, epoch_end.Save)), None)
        if save is not None and save.best_model is not None:
            weights = save.best_model.state_dict().items()
            return {k: (v.float() if v.is_floating_point() else v).cpu() for k, v in weights}
        return checkpoint.model_of(checkpoint.load(best)).state_dict()

    def _elapsed(self) -> float:
        """Seconds since training started (results.csv's `time`)."""
        return time.perf_counter() - self.train_start

    def time_report(self) -> time_report.Report:
        """Where this process's time went since training started, and what bound it (rank 0 says it at the end)."""
        p, timer = self.parts, self.parts.engine.timer
        timer.take()
        return time_report.Report.of(
            timer.total,
            timer.total_host,
            p.cfg,
            p.ctx.device,
            p.loader.num_workers,
            self.epochs_run,
        )

    @property
    def loss_names(self) -> tuple[str, ...]:
        return tuple(getattr(self.parts.loss.criterion, "one2one", self.parts.loss.criterion).loss_names)

    def _close_mosaic(self) -> None:
        from yoloaccum.config.ultra import ultralytics_args

        self.parts.train_set.close_mosaic(hyp=ultralytics_args(self.parts.cfg))  # sets mosaic, mixup, cutmix to 0
        self.parts.loader = components.build_loader(self.parts)  # workers hold a copy of the dataset: start them again
        self.state.mosaic_closed = True

    def end_epoch(self, epoch: int, images_per_second: float) -> str | None:
        """The end-of-epoch steps (epoch_end.py), then the one decision every rank takes together: "final" or
        "patience" when training ends here, else None."""
        self.state.position = (epoch + 1, 0)
        self.epochs_run += 1
        end = epoch_end.EpochEnd(
            epoch,
            final=epoch + 1 == self.parts.schedule.epochs,
            images_per_second=images_per_second,
            train_losses=tuple(self.train_losses),
            train_seconds=self.train_seconds,
            steps=tuple(self.epoch_steps),
            skipped=tuple(self.parts.engine.skipped),
        )
        self.parts.engine.timer.lap("other")  # the epoch's bookkeeping after its last window
        decided = epoch_end.run_steps(self.epoch_end, end, self.parts.engine.timer)
        ended = "final" if end.final else decided.stop
        return ("patience", "final")[end.final] if self._agree(ended is not None) else None

    def follow_back_offs(self) -> None:
        """Validation batches of twice the micro-batch, as at the start, also after an out-of-memory back-off: the
        smallest over the ranks, which cut their shares of the images by it. A collective, as validation is."""
        val_batch = distributed.min_over_ranks(max(1, 2 * self.parts.engine.micro_batch), self.parts.ctx)
        if val_batch < self.parts.evaluator.share_batch:
            self.parts.evaluator.set_batch(val_batch)

    def _agree(self, stop: bool) -> bool:
        """Every rank stops together: rank 0 decided; the others wait here while it logs and saves."""
        flag = torch.tensor([float(stop)], device=self.parts.ctx.device)
        return bool(distributed.all_reduce_sum(flag, self.parts.ctx).item())

    def save_position(self, epoch: int, done: int) -> None:
        """last.pt at a window boundary inside an epoch (a stop): no partial gradients, the next image's position."""
        self.state.position = (epoch, done)
        for step in self.epoch_end:  # the TensorBoard log's steps so far
            getattr(step, "write_steps", lambda steps, skipped: None)(self.epoch_steps, self.parts.engine.skipped)
        self.rank_states.gather()
        if self.parts.run is not None and self.parts.cfg.save:
            checkpoint.save_atomic(self.checkpoint(interrupted=True), self.parts.run.weights / "last.pt")
        distributed.barrier(self.parts.ctx)

    def plot_schedule(self) -> None:
        """schedule.png, from the optimizer steps the run logged in schedule.csv (plots=True)."""
        if self.parts.cfg.plots:
            plots.schedule(self.steps.file, self.parts.run.path / "schedule.png")


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
