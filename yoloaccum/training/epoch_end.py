"""What happens after an epoch's last window, as small steps run in order (detectron2's hooks): precise BatchNorm
statistics, every rank's state gathered for the checkpoint, validation, the results row, TensorBoard, early stopping
and saving. Each is a callable `step(run, end)` that reads what it needs of the run (the Run protocol below) and
writes what it decides (validated, best, stop, the results row) into `end`, the epoch's record, on which the trainer
acts; what the run has decided so far lives in its TrainingState. The deciding steps are tested on small fakes.

The steps every rank takes (they hold collectives) come first; the others belong to rank 0, which owns the run
folder. `steps()` builds each rank's list once, so no step asks which rank it runs on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from yoloaccum.batchnorm import precise as precise_bn
from yoloaccum.data import datasets as data
from yoloaccum.evaluation.validate import show_metrics
from yoloaccum.model import checkpoint
from yoloaccum.training import state
from yoloaccum.training.progress import EXTRA_COLUMNS

if TYPE_CHECKING:
    from yoloaccum.config.settings import Config
    from yoloaccum.core.engine import Engine
    from yoloaccum.core.schedule import Schedule
    from yoloaccum.distributed.ddp import Context
    from yoloaccum.training.progress import StepLog
    from yoloaccum.training.runs import RunDir
    from yoloaccum.training.training_state import TrainingState


class Run(Protocol):
    """What the end-of-epoch steps (and state.py's checkpoint, and the TensorBoard log) read of a run in training:
    its parts (components.Parts), its TrainingState, and what the epoch just trained left. The trainer is one; a
    test may pass any object with these."""

    cfg: Config
    ctx: Context
    spec: Any
    train_set: Any
    run: RunDir | None
    raw_model: torch.nn.Module
    ema: Any
    loss: Any
    schedule: Schedule
    loader: torch.utils.data.DataLoader
    engine: Engine
    evaluator: Any
    frozen: tuple[str, ...]
    bn: str
    state: TrainingState
    precise_bn: PreciseBN
    train_start: float
    train_losses: list[float]
    epoch_steps: list
    rank_states: list[dict] | None
    steps: StepLog | None

    @property
    def loss_names(self) -> tuple[str, ...]: ...

    def follow_back_offs(self) -> None: ...

    def gather_rank_states(self) -> None: ...


@dataclass
class EpochEnd:
    """One epoch's end, as the steps see it and fill it in."""

    epoch: int  # from 0
    final: bool  # the run's last epoch
    images_per_second: float  # over all devices
    validated: bool = False  # metrics are this epoch's (else the last validation's, or zeros before the first)
    best: bool = False  # fitness is the best so far: best.pt is written
    stop: str | None = None  # "patience": early stopping ends the run here
    row: dict[str, float] = field(default_factory=dict)  # results.csv's row


Step = Callable[[Run, EpochEnd], None]


class PreciseBN:
    """Recompute the EMA's BatchNorm statistics (precise_bn.py) before a validation reads them: on every rank, whose
    statistics are summed. A validation that only early stopping asks for (val=False) uses what training left.

    Its images are drawn at the first recompute, from the seed alone, and kept (N x 3 x imgsz^2 bytes: 20 MB for 256
    images at 160 px, 315 MB at 640); drawing them leaves training's random states as they were, so training is the
    same with and without precise_bn, and a resumed run draws the same images."""

    def __init__(self, num_images: int) -> None:
        self.num_images = num_images  # images the recompute passes (schedule.precise_bn_count): 0 recomputes nothing
        self.images: torch.Tensor | None = None
        self.batch = precise_bn.BATCH  # its micro-batch, until one runs out of memory

    def __call__(self, t: Run, end: EpochEnd) -> None:
        if self.num_images and (t.cfg.val or end.final):
            self.recompute(t)

    def draw(self, t: Run) -> torch.Tensor:
        """This rank's images, drawn once."""
        if self.images is None:
            self.images = data.precise_bn_images(t.cfg, t.spec, self.num_images, t.ctx.rank, t.ctx.world_size)
        return self.images

    def recompute(self, t: Run) -> None:
        self.draw(t)
        self.batch = precise_bn.recompute_images(t.ema.ema, self.images, t.ctx, self.batch, t.frozen)


def gather_rank_states(t: Run, end: EpochEnd) -> None:
    """Every rank's own state to rank 0, for the checkpoint. A collective, taken where each rank's random states are
    those the next epoch starts from."""
    t.gather_rank_states()


def validate(t: Run, end: EpochEnd) -> None:
    """Validate the EMA with val=True, at the final epoch, and (as Ultralytics) whenever early stopping could trigger
    now, so that it sees a fresh figure; then note whether the fitness is the best so far."""
    if t.cfg.val or end.final or t.state.possible_stop:
        t.follow_back_offs()
        t.state.record_validation(t.evaluator.evaluate(t.ema.ema, t.loss.criterion))
        end.validated = True
    end.best = t.state.note_best()


def results(t: Run, end: EpochEnd) -> None:
    """results.csv's row: time, mean training losses, metrics, lr per group, and the accumulation's own columns as
    they were after any out-of-memory back-off; and the metrics table when verbose."""
    s, row = t.schedule, end.row
    row.update({"epoch": end.epoch + 1, "time": round(time.perf_counter() - t.train_start, 3)})  # as Ultralytics
    row.update({f"train/{n}": v for n, v in zip(t.loss_names, t.train_losses)})
    row.update(t.state.metrics)
    row.pop("fitness", None)
    row.update({f"lr/pg{i}": g["lr"] for i, g in enumerate(t.engine.optimizer.param_groups)})
    extra = (t.engine.accumulate, s.effective_batch, s.weight_decay, end.images_per_second, t.engine.micro_batch)
    row.update(zip(EXTRA_COLUMNS, extra))
    t.run.results.append(row)
    if t.cfg.verbose and end.validated:
        show_metrics(t.run.console, t.state.metrics, f"epoch {end.epoch + 1}/{s.epochs}")


def early_stopping(t: Run, end: EpochEnd) -> None:
    if t.state.stop_early(end.epoch + 1) and not end.final:
        end.stop = "patience"


def save(t: Run, end: EpochEnd) -> None:
    """last.pt after every epoch, epochN.pt every save_period epochs, and best.pt when fitness improved."""
    if not t.cfg.save:
        return
    w = t.run.weights
    paths = [w / "last.pt"]
    if t.cfg.save_period > 0 and (end.epoch + 1) % t.cfg.save_period == 0:
        paths.append(w / f"epoch{end.epoch + 1}.pt")
    ckpt = state.of(t, (end.epoch + 1, 0), finished=end.final or end.stop is not None)
    checkpoint.save_atomic(ckpt, *paths)
    if end.best:
        checkpoint.save_atomic(checkpoint.stripped(ckpt), w / "best.pt")


def steps(t: Run) -> list[Step]:
    """This rank's steps, in order: the collective ones on every rank, then rank 0's."""
    from yoloaccum.training.tensorboard import TensorBoard

    every: list[Step] = [t.precise_bn, gather_rank_states]
    if t.run is None:
        return every
    board = TensorBoard.for_run(t) if t.cfg.tensorboard else None  # None also without the package
    return [*every, validate, results, *([board] if board else []), early_stopping, save]
