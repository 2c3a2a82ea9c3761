"""The trainer: builds a run (data, model, engine), then each epoch trains, validates, logs and saves.

The accumulation loop itself is engine.Engine; *when* to step comes from schedule, the loss normaliser from
loss.WindowLoss. Rank 0 alone validates, logs and writes; every rank trains. A run can stop at any window boundary
(a signal, or a diverging loss) and resume from last.pt to the same weights.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from yoloaccum import (
    autobatch,
    backoff,
    checkpoint,
    compiler,
    data,
    distributed,
    faults,
    loss,
    norm,
    optim,
    plots,
    precise_bn,
    resume,
)
from yoloaccum import model as model_
from yoloaccum import schedule as schedule_
from yoloaccum.config import Config, is_auto_batch, resolve
from yoloaccum.engine import Engine, EpochResult, load_scaler_state, merge_windows
from yoloaccum.errors import Diverged, UserError
from yoloaccum.progress import EXTRA_COLUMNS, EpochProgress, StepLog
from yoloaccum.runs import RunDir, keep_freed_memory, seed_everything
from yoloaccum.signals import GracefulStop, Interrupted
from yoloaccum.validate import METRIC_KEYS, Evaluator, show_metrics


class Trainer:
    """Trains cfg.model on cfg.data with gradient accumulation (see Engine for the step contract).

    Outputs, on rank 0 under project/name: args.yaml, results.csv, schedule.csv, weights/last.pt (everything an exact
    resume needs) and best.pt (stripped for shipping); with plots, the pictures of plots.py.
    With `ckpt` (a yoloaccum last.pt, loaded), it continues that run in its folder from the saved position.
    """

    def __init__(self, cfg: Config, ckpt: dict[str, Any] | None = None, ckpt_path: Path | None = None):
        from ultralytics.utils.torch_utils import EarlyStopping, ModelEMA

        self.cfg = cfg
        self.ctx = distributed.setup(cfg.device, cfg.ddp_timeout)
        # Augmentation draws differ per rank, as in Ultralytics; DDP broadcasts rank 0's initial weights.
        seed_everything(cfg.seed + self.ctx.rank, cfg.deterministic)
        if self.ctx.device.type == "cpu":  # measured where it was tuned: training on the CPU (docs/performance.md)
            keep_freed_memory()
        with distributed.main_first(self.ctx):  # rank 0 generates shapes and writes the label cache; then the others
            self.spec = data.load_spec(cfg.data, cfg.split)
            self.train_set = data.build_dataset(cfg, self.spec, "train")
        if not str(cfg.model).endswith(".pt"):
            model_.resolve_yaml(cfg.model)  # a wrong name fails here, before a run folder is made
        if self.ctx.is_main:
            self.run = RunDir.reopen(ckpt_path.parent.parent) if ckpt_path else RunDir.create(cfg)
            print(data.summary("train", self.train_set), flush=True)
        else:
            self.run = None
        self.raw_model = model_.build(cfg, self.spec, verbose=False, announce=self.ctx.is_main).to(self.ctx.device)
        if cfg.channels_last:  # NHWC convolutions run forward and backward faster (docs/performance.md)
            self.raw_model.to(memory_format=torch.channels_last)
        self.ema = ModelEMA(self.raw_model)  # before the criterion is attached, so the EMA copy carries none
        if cfg.grad_checkpointing:  # after the EMA copy, which only evaluates
            model_.checkpoint_blocks(self.raw_model)
        self.loss = loss.WindowLoss(self.raw_model, cfg.norm)
        if self.run:
            self.loss.set_log(self.run.console.print)
        amp = cfg.amp and self.ctx.device.type == "cuda"  # AMP is a CUDA feature; on the CPU it stays fp32
        # batch=-1 or a fraction: measured with the model as it trains, or on resume the run's first choice
        self.batch_choice = autobatch.for_run(cfg, self.ctx, ckpt, self.raw_model, self.loss, amp, self.train_set)
        batch = self.batch_choice.batch if self.batch_choice else cfg.batch
        self.schedule = schedule_.build(
            cfg.replace(batch=batch), len(self.train_set), self.ctx.world_size, self.spec.nc
        )
        per_device = batch // self.ctx.world_size
        window = self.schedule.effective_batch // self.ctx.world_size if cfg.mosaic_buffer == "window" else per_device
        data.set_batch(self.train_set, per_device, window)
        if ckpt is not None:
            self.schedule = resume.resumed_schedule(ckpt["yoloaccum"], self.schedule, self.spec.nc)
            if self.run and resume.extension_note(ckpt["yoloaccum"], cfg):
                with checkpoint.open_in_run(self.run.path / "args.yaml", "w") as f:
                    f.write(cfg.to_yaml())  # the run's settings now: its new epochs
        self.loader = self._loader()
        if cfg.bn == "window":  # before the optimizer is built: the layers are replaced, their parameters kept
            norm.convert(self.raw_model, model_.bn_window(cfg, self.ctx.world_size))
        self.engine = Engine(
            model=distributed.wrap(self.raw_model, self.ctx, cfg.bn),  # SyncBatchNorm, if any, before compiling
            raw_model=self.raw_model,
            loss=self.loss,
            optimizer=optim.build_optimizer(self.raw_model, self.schedule),
            schedule=self.schedule,
            ctx=self.ctx,
            clip_grad=cfg.clip_grad,
            scaler=torch.amp.GradScaler("cuda", enabled=amp),
            ema=self.ema,
            amp=amp,
            nan_patience=cfg.nan_patience,
            log=self.run.console.print if self.run else (lambda message: None),
        )
        faults.install(self.engine)  # YOLOACCUM_FAULT, if set: failures injected for failure tests
        self.optimizer = self.engine.optimizer
        self.stopper = EarlyStopping(patience=cfg.patience)
        val_batch = self.schedule.micro_batch * 2  # rank 0 validates alone, on one device
        self.bn_images: torch.Tensor | None = None  # precise_bn's images: drawn at its first recompute, then kept
        self.bn_batch = precise_bn.BATCH  # its micro-batch, until one runs out of memory
        self.evaluator = (Evaluator(cfg, self.spec, self.run.path, val_batch, self.ctx.device, self.run.console.print)
                          if self.run else None)  # fmt: skip
        # Until the first validation, as Ultralytics: zeros, so that every row of results.csv has the same columns.
        self.metrics = {**dict.fromkeys((*METRIC_KEYS, "fitness"), 0.0), **{f"val/{n}": 0.0 for n in self.loss_names}}
        self.best_fitness, self.fitness, self.mosaic_closed = None, None, False  # fitness: of the last validation
        self.position = (0, 0)  # (epoch, micro-batches of it done): where training continues
        self.steps = StepLog(self.run.path) if self.run else None
        self.plot_at = plots.train_batch_indices(self.schedule, cfg.close_mosaic) if cfg.plots else frozenset()
        self.rank_states: list[dict] | None = None  # on rank 0, every rank's, gathered before each save
        self.compiled: compiler.Compiled | None = None  # compile=: compiled at the start of train()
        self.drawing: plots.Background | None = None  # labels.jpg, drawn in the background
        if ckpt is not None:
            self.load_state(ckpt["yoloaccum"], ckpt)

    def _loader(self):
        s = self.schedule
        return data.build_loader(
            self.train_set, self.cfg, s.micro_batch, self.ctx.rank, self.ctx.world_size, self.ctx.device
        )

    def train(self) -> dict[str, float]:
        """Run the remaining epochs; returns the final metrics (best.pt's, as Ultralytics' final_eval)."""
        s, cfg = self.schedule, self.cfg
        if self.run:
            precise = precise_bn.sample_size(cfg.precise_bn, len(self.train_set))
            self.run.announce(s, len(self.train_set), self.ctx, self.loader.num_workers, precise, self.batch_choice)
            if cfg.bn == "window":
                window, per_device = model_.bn_window(cfg, self.ctx.world_size), s.micro_batch // self.ctx.world_size
                self.run.console.print(f"BatchNorm: bn={cfg.bn}, each layer normalises micro-batches of {per_device} "
                                       f"with the statistics of its last {window} images on each "
                                       "device")  # fmt: skip
                if window <= per_device:
                    self.run.console.print(f"[yellow]warning:[/] bn_window={window} holds no more than one micro-batch "
                                           f"of {per_device}: each is normalised with its own statistics, as with "
                                           "bn=batch; give bn_window above it")  # fmt: skip
        if cfg.compile:  # before the clock starts: compile time is reported on its own, not in the first epoch's
            say = self.run.console.print if self.run else (lambda message: None)
            self.compiled = compiler.for_run(cfg, self.engine, len(self.train_set), say)
            if self.compiled is not None:
                self.engine.after_back_off = lambda: self._compile_after_back_off(say)
        self.train_start = time.perf_counter()
        bounded = distributed.bounded(self.ctx, lambda: self.engine.ni, cfg.ddp_timeout)  # a hung rank: named
        with GracefulStop() as stop_signal, frozen_heap(), bounded:
            if self.run and cfg.plots and self.position == (0, 0):  # drawn while the first epoch trains
                self.drawing = plots.Background(plots.labels, self.train_set, self.spec.names, self.run.path)
            epoch, start = self.position
            while True:
                if cfg.close_mosaic and epoch >= s.epochs - cfg.close_mosaic and not self.mosaic_closed:
                    self._close_mosaic()
                result, images_per_second = self.train_epoch(epoch, start, stop_signal)
                ended = None
                if result.done < s.batches_per_epoch:  # stopped inside the epoch, at a window boundary
                    self.save_position(epoch, result.done)
                else:
                    self.loss.end_epoch()
                    ended = self.end_epoch(epoch, images_per_second)
                    # A signal after the epoch's last window (during validation, say) stops here, last.pt just saved,
                    # rather than after one more window.
                    if ended is None and result.stopped is None and self._agree(stop_signal()):
                        result = EpochResult(result.done, "interrupted")
                if reason := stop_reason(result.stopped, ended):
                    break
                epoch, start = epoch + 1, 0
        distributed.barrier(self.ctx)
        if reason in {"diverged", "interrupted"}:
            self._raise_stopped(reason, stop_signal)
        return self.final_eval()

    def _compile_after_back_off(self, say) -> None:
        self.compiled = compiler.after_back_off(self.compiled, self.engine, len(self.train_set), self.cfg.imgsz, say)

    def train_epoch(self, epoch: int, start: int, should_stop) -> tuple[EpochResult, float]:
        """The epoch's micro-batches from `start` on, through the engine; also images per second over all devices."""
        s = self.schedule
        self.loader.batch_sampler.set_epoch(epoch, start)
        self.engine.model.train()
        model_.set_bn_mode(self.engine.model, self.cfg.bn)
        progress = EpochProgress(epoch, s.epochs, s.batches_per_epoch, self.loss_names, self.cfg.log_every,
                                 self.ctx.device, enabled=self.run is not None)  # fmt: skip

        def on_micro_step(i, items, images, fill, accumulate, lr):
            progress.update(i, items, images, fill, accumulate, s.batch * accumulate, lr)
            if s.steps_after(ni := epoch * s.batches_per_epoch + i):
                progress.end_window(skipped=ni in self.engine.skipped[-1:])

        batches = self.loader
        if self.run and self.plot_at:
            batches = plots.train_batches(batches, epoch * s.batches_per_epoch + start, self.plot_at, self.run.path,
                                          self.spec.names)  # fmt: skip
        try:
            result = self.engine.train_epoch(epoch, batches, on_micro_step, start, should_stop)
        finally:
            progress.close()
        if self.steps:
            self.steps.append(self.engine.history, s.batches_per_epoch)
        self.engine.history.clear()
        self.train_losses = progress.mean_losses()
        return result, progress.images_per_second() * self.ctx.world_size

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
            return self.metrics
        best = self.run.weights / "best.pt"
        if self.cfg.save and best.exists():
            model, title = checkpoint.model_of(checkpoint.load(best)), f"final figures: {best} validated"
        else:
            model, title = copy.deepcopy(self.ema.ema), "final figures: the last epoch's EMA (save=False)"
        self._follow_back_offs()
        if self.drawing is not None:
            self.drawing.join()  # labels.jpg is done before the validation draws its curves
        self.metrics = self.evaluator.evaluate(model.fuse(verbose=False).to(self.ctx.device), plots=self.cfg.plots)
        show_metrics(self.run.console, self.metrics, title)
        return self.metrics

    @property
    def loss_names(self) -> tuple[str, ...]:
        return tuple(getattr(self.loss.criterion, "one2one", self.loss.criterion).loss_names)

    def _close_mosaic(self) -> None:
        from yoloaccum.ultra import ultralytics_args

        self.train_set.close_mosaic(hyp=ultralytics_args(self.cfg))  # sets mosaic, mixup, cutmix to 0
        self.loader = self._loader()  # workers hold a copy of the dataset: start them again
        self.mosaic_closed = True

    def end_epoch(self, epoch: int, images_per_second: float) -> str | None:
        """Validate, log and save on rank 0; returns "final" or "patience" when training should end here."""
        final = epoch + 1 == self.schedule.epochs
        ended = "final" if final else None
        # Every rank takes part (the statistics are summed over ranks), so this rests on what every rank knows; a
        # validation that only early stopping asks for (val=False) uses the statistics training left.
        if self.cfg.precise_bn and (self.cfg.val or final):
            self.recompute_bn()
        self._gather_rank_states()
        if self.run is not None:
            # As Ultralytics, also validate when early stopping could trigger now, so that it sees a fresh figure.
            validate = self.cfg.val or final or self.stopper.possible_stop
            if validate:
                self._follow_back_offs()
                self.metrics = self.evaluator.evaluate(self.ema.ema, self.loss.criterion)
                self.fitness = self.metrics.get("fitness", 0.0)
            fitness = self.fitness or 0.0
            if self.best_fitness is None or fitness > self.best_fitness:
                self.best_fitness = fitness
            self.run.results.append(self._row(epoch, time.perf_counter() - self.train_start, images_per_second))
            if self.cfg.verbose and validate:
                show_metrics(self.run.console, self.metrics, f"epoch {epoch + 1}/{self.schedule.epochs}")
            if self.stopper(epoch + 1, self.fitness) and not final:
                ended = "patience"
            self.save(epoch, best=fitness == self.best_fitness, finished=ended is not None)
        return ("patience", "final")[final] if self._agree(ended is not None) else None

    def _follow_back_offs(self) -> None:
        """Validation batches of twice the micro-batch, as at the start, also after an out-of-memory back-off."""
        val_batch = max(1, 2 * backoff.micro_batch(self.engine))
        if val_batch < self.evaluator.batch:
            self.evaluator.set_batch(val_batch)

    def recompute_bn(self) -> None:
        """Precise BatchNorm statistics for the EMA model, the one validated and saved. Its images are drawn at the
        first recompute, from the seed alone, and kept (N x 3 x imgsz^2 bytes: 20 MB for 256 images at 160 px, 315 MB
        at 640); drawing them leaves training's random states as they were, so training is the same with and
        without precise_bn, and a resumed run draws the same images."""
        if self.bn_images is None:
            self.bn_images = data.precise_bn_images(self.cfg, self.spec, self.ctx.rank, self.ctx.world_size)
        self.bn_batch = precise_bn.recompute_images(self.ema.ema, self.bn_images, self.ctx, self.bn_batch)

    def _agree(self, stop: bool) -> bool:
        """Every rank stops together: rank 0 decided; the others wait here while it validated and saved."""
        flag = torch.tensor([float(stop)], device=self.ctx.device)
        return bool(distributed.all_reduce_sum(flag, self.ctx).item())

    def _row(self, epoch: int, seconds: float, images_per_second: float) -> dict[str, float]:
        s = self.schedule
        row: dict[str, float] = {"epoch": epoch + 1, "time": round(seconds, 3)}  # since train() began, as Ultralytics
        row.update({f"train/{n}": v for n, v in zip(self.loss_names, self.train_losses)})
        row.update(self.metrics)
        row.pop("fitness", None)
        row.update({f"lr/pg{i}": g["lr"] for i, g in enumerate(self.optimizer.param_groups)})
        accumulate, micro_batch = s.accumulate * self.engine.split, backoff.micro_batch(self.engine)  # after back-offs
        row.update(zip(EXTRA_COLUMNS, (accumulate, s.effective_batch, s.weight_decay, images_per_second, micro_batch)))
        return row

    def save(self, epoch: int, best: bool, finished: bool) -> None:
        """last.pt after every epoch (and best.pt when fitness improved), in Ultralytics' layout."""
        if not self.cfg.save:
            return
        w = self.run.weights
        paths = [w / "last.pt"]
        if self.cfg.save_period > 0 and (epoch + 1) % self.cfg.save_period == 0:
            paths.append(w / f"epoch{epoch + 1}.pt")
        state = self.state((epoch + 1, 0), finished=finished)
        checkpoint.save_atomic(state, *paths)
        if best:
            checkpoint.save_atomic(checkpoint.stripped(state), w / "best.pt")

    def save_position(self, epoch: int, done: int) -> None:
        """last.pt at a window boundary inside an epoch (a stop): no partial gradients, the next image's position."""
        self._gather_rank_states()
        if self.run is not None and self.cfg.save:
            checkpoint.save_atomic(self.state((epoch, done), interrupted=True), self.run.weights / "last.pt")
        distributed.barrier(self.ctx)

    def state(self, position: tuple[int, int], finished: bool = False, interrupted: bool = False) -> dict[str, Any]:
        """The checkpoint: Ultralytics' entries for predict and export, and ours for an exact resume."""
        from yoloaccum.ultra import VERSION, ultralytics_args

        self.ema.update_attr(self.raw_model, include=["yaml", "nc", "args", "names", "stride"])
        return {
            "epoch": position[0] - 1,  # Ultralytics: the last completed epoch
            "best_fitness": self.best_fitness,
            "model": None,
            "ema": checkpoint.ultralytics_model(self.ema.ema),
            "updates": self.ema.updates,
            "optimizer": None,  # kept in full precision under "yoloaccum" for an exact resume
            "train_args": vars(ultralytics_args(self.cfg)),
            "train_metrics": dict(self.metrics),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "version": VERSION,
            "license": "AGPL-3.0",
            "yoloaccum": {
                "format": checkpoint.FORMAT,
                "config": dict(self.cfg),
                "schedule": dataclasses.asdict(self.schedule),  # as resolved (auto's choice): an extension keeps it
                "position": {"epoch": position[0], "batch": position[1]},
                "finished": finished,
                "interrupted": interrupted,
                "model": self.raw_model.state_dict(),
                "ema": self.ema.ema.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.engine.scaler.state_dict(),
                "stopper": {"best_fitness": self.stopper.best_fitness, "best_epoch": self.stopper.best_epoch},
                "skipped_windows": list(self.engine.skipped),
                "ranks": [self._rank_state(), *self.rank_states[1:]],  # rank 0's as of now, after validation
            },
        }

    def plot_schedule(self) -> None:
        """schedule.png, from the optimizer steps the run logged in schedule.csv (plots=True)."""
        if self.cfg.plots:
            plots.schedule(self.steps.file, self.run.path / "schedule.png")

    def _rank_state(self) -> dict[str, Any]:
        """What each rank holds apart from the others: random states, mosaic buffer, its part of an open window, and
        the iterations where it ran out of memory (its micro-batch stays halved once for each)."""
        return {"rng": resume.rng_state(self.loader.generator), "open_window": self.engine.open_window(),
                "mosaic_buffer": list(getattr(self.train_set, "buffer", [])),
                "back_offs": list(self.engine.back_offs),
                "bn_window": norm.state(self.raw_model)}  # fmt: skip

    def _gather_rank_states(self) -> None:
        """Every rank's _rank_state() to rank 0, for the next save. A collective: every rank calls it, at the point
        of the epoch (or stop) where its random states are those the next epoch starts from."""
        if self.cfg.save:  # the same on every rank, so all of them skip it together
            self.rank_states = distributed.gather_to_main(self._rank_state(), self.ctx)

    def _restore_rank_state(self, ranks: list[dict[str, Any]]) -> None:
        """This rank's own states. On another number of ranks the weights, optimizer, image order and any open window
        continue exactly; the augmentation draws cannot, since each rank now sees other images."""
        rank, same = self.ctx.rank, len(ranks) == self.ctx.world_size
        if not same and self.run is not None:
            self.run.console.print(f"resuming {len(ranks)} rank(s) on {self.ctx.world_size}: the weights, optimizer, "
                                   "image order and schedule continue exactly; augmentation draws differ from the "
                                   "uninterrupted run")  # fmt: skip
        mine = ranks[rank] if rank < len(ranks) else None
        if same:
            self.engine.restore_window(mine["open_window"])
        elif rank == 0:  # the saved ranks' window, summed, goes to one rank: the all-reduce sums it with the rest
            self.engine.restore_window(merge_windows([r["open_window"] for r in ranks]))
        if mine is not None:
            self.engine.back_offs = list(mine["back_offs"])
            self.engine.split = 2 ** len(self.engine.back_offs)
            resume.restore_mosaic_buffer(self.train_set, mine["mosaic_buffer"])
            if same:  # each rank's queues are its own images': on another number of ranks they start empty
                norm.load_state(self.raw_model, mine.get("bn_window", {}))
            resume.restore_rng(mine["rng"], self.loader.generator)  # last: building the run consumed random numbers

    def load_state(self, state: dict[str, Any], ckpt: dict[str, Any]) -> None:
        """Continue from a checkpoint written by state(): weights, optimizer, EMA, schedule position, RNG."""
        self.raw_model.load_state_dict(state["model"])
        self.ema.ema.load_state_dict(state["ema"])
        self.ema.updates = ckpt["updates"]
        self.optimizer.load_state_dict(state["optimizer"])
        if (note := load_scaler_state(self.engine.scaler, state["scaler"])) and self.run is not None:
            self.run.console.print(note)
        self.stopper.best_fitness = state["stopper"]["best_fitness"]
        self.stopper.best_epoch = state["stopper"]["best_epoch"]
        self.best_fitness = ckpt["best_fitness"]
        self.metrics.update(ckpt.get("train_metrics") or {})
        self.engine.skipped = list(state["skipped_windows"])
        self.position = (state["position"]["epoch"], state["position"]["batch"])
        for _ in range(self.position[0]):  # E2ELoss decays its one-to-many gain once per finished epoch
            self.loss.end_epoch()
        if self.run is not None:
            self.run.results.truncate(self.position[0])
            self.steps.truncate(self.position[0] * self.schedule.batches_per_epoch + self.position[1])
            self.run.console.print(f"resuming {self.run.path} at epoch {self.position[0] + 1}, "
                                   f"micro-batch {self.position[1]}")  # fmt: skip
        self._restore_rank_state(state["ranks"])


def run(args: list[str]) -> dict[str, float]:
    """`yoloaccum train ...`: resolve the config (or the run to resume), train, and say where the weights are."""
    cfg, ckpt, path = resolve(args), None, None
    if cfg.resume:
        cfg, ckpt, path = resume.load(cfg, args)
    compiler.check(cfg)
    if cfg.data is None:
        raise UserError("train needs a dataset: give data=path/to/dataset.yaml (e.g. data=datasets/shapes.yaml)")
    devices = len(distributed.cuda_ids(cfg.device))
    if devices > 1 and "WORLD_SIZE" not in os.environ:
        if (
            not is_auto_batch(cfg.batch) and cfg.batch % devices
        ):  # checked once here, rather than in every rank torchrun would start
            raise UserError(f"batch={cfg.batch} does not divide over {devices} devices; use a multiple of {devices}")
        raise SystemExit(distributed.launch(args, cfg.device))  # several devices: one process each, via torchrun
    if (
        ckpt is not None
        and int(os.environ.get("RANK", "0")) == 0
        and (note := resume.extension_note(ckpt["yoloaccum"], cfg))
    ):
        print(note, flush=True)
    if cfg.ignored and int(os.environ.get("RANK", "0")) == 0:
        print(f"ignoring Ultralytics settings that yoloaccum does not use: {', '.join(cfg.ignored)}", flush=True)
    trainer = Trainer(cfg, ckpt, path)
    try:
        metrics = trainer.train()
        if trainer.run is not None:
            trainer.plot_schedule()
            trainer.run.finish(trainer.evaluator, trainer.cfg)
        return metrics
    finally:
        distributed.cleanup()


def stop_reason(stopped: str | None, ended: str | None) -> str | None:
    """The one decision to stop, and why. `stopped` is the engine's ("interrupted" by a signal, "diverged"), `ended`
    the epoch's end ("final" epoch, or early stopping's "patience"). A divergence wins; a run whose last epoch is done
    has finished, even if a signal arrived in its last window."""
    if stopped == "diverged":
        return stopped
    return ended or stopped


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Hide every object alive now (modules, dataset, labels: hundreds of thousands of them) from the cyclic garbage
    collector while training. A full collection would otherwise walk them all at some iteration, a stall measured on
    the CPU (docs/performance.md), and in each loader worker, forked from this process, copy every page it touched.

    It is kept on CUDA too: it changes no computation, only which objects the collector scans, and freezing before
    the loader forks its workers is what Python's gc documentation advises to keep the children's pages shared."""
    if gc.get_freeze_count():  # frozen by whoever runs us: theirs to undo, not ours
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
