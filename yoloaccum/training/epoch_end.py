"""What happens after an epoch's last window, as small steps run in order (detectron2's hooks): precise BatchNorm
statistics, the EMA's buffers made rank 0's, validation, early stopping, every rank's state gathered for the checkpoint,
the results row, TensorBoard and saving. Each step is built with the parts it reads and called as `step(end, decided) ->
decided`: `end` is what the epoch left, `decided` what the steps before it decided, and it returns that with its own
decisions added (validated, best, stop, the results row), on which the trainer acts. What the run has decided so far
lives in its TrainingState, which the deciding steps update.

The steps every rank takes (they hold collectives: validation is shared by the ranks) come first; the others belong to
rank 0, which owns the run folder. The trainer builds each rank's list once (Trainer._steps), so no step asks which
rank it runs on; a step can be added to a trainer's list from outside (Trainer.add_step), as the benchmarks add theirs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yoloaccum.batchnorm import precise as precise_bn
from yoloaccum.core import timing
from yoloaccum.data import datasets as data
from yoloaccum.distributed import ddp
from yoloaccum.distributed.ddp import Context
from yoloaccum.evaluation.validate import show_metrics
from yoloaccum.model import checkpoint
from yoloaccum.training.progress import EXTRA_COLUMNS

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from yoloaccum.config.settings import Config
    from yoloaccum.core.engine import Engine
    from yoloaccum.core.timing import PhaseTimer
    from yoloaccum.core.window import StepRecord
    from yoloaccum.evaluation.validate import Evaluator
    from yoloaccum.training.progress import Results
    from yoloaccum.training.training_state import TrainingState


@dataclass(frozen=True)
class EpochEnd:
    """What an epoch left, as the steps read it."""

    epoch: int  # from 0
    final: bool  # the run's last epoch
    images_per_second: float  # over all devices
    train_losses: tuple[float, ...] = ()  # the epoch's mean training losses, in the loss's order of names
    train_seconds: float = 0.0  # the epoch's micro-batches and steps, loader included; not its end's steps
    steps: tuple[StepRecord, ...] = ()  # the epoch's optimizer steps, as the engine took them
    skipped: tuple[int, ...] = ()  # every window of the run skipped as non-finite, also those before a resume


@dataclass(frozen=True)
class Decided:
    """What the steps decided at an epoch's end, each adding its own."""

    validated: bool = False  # metrics are this epoch's (else the last validation's, or zeros before the first)
    best: bool = False  # fitness is the best so far: best.pt is written
    stop: str | None = None  # "patience": early stopping ends the run here
    row: Mapping[str, float] = field(default_factory=dict)  # results.csv's row


Step = Callable[[EpochEnd, Decided], Decided]
# A step's `phase` attribute says where its time goes in the run's time split (core/timing.py); one without, "other".


class PreciseBN:
    """Recompute the EMA's BatchNorm statistics (batchnorm/precise.py) before a validation reads them: on every rank,
    whose statistics are summed. A validation that only early stopping asks for (val=False) uses what training left.

    Its images are drawn at the first recompute, from the seed alone, and kept (N x 3 x imgsz^2 bytes: 20 MB for 256
    images at 160 px, 315 MB at 640); drawing them leaves training's random states as they were, so training is the
    same with and without precise_bn, and a resumed run draws the same images."""

    phase = "precise_bn"

    def __init__(self, num_images: int, cfg: Config, spec: data.DatasetSpec, ctx: Context, ema: Any, frozen=()):
        self.num_images = num_images  # images the recompute passes (schedule.precise_bn_count): 0 recomputes nothing
        self.cfg, self.spec, self.ctx, self.ema, self.frozen = cfg, spec, ctx, ema, frozen
        self.images: torch.Tensor | None = None
        self.batch = precise_bn.BATCH  # its micro-batch, until one runs out of memory

    def __call__(self, end: EpochEnd, decided: Decided) -> Decided:
        if self.num_images and (self.cfg.val or end.final):
            self.recompute()
        return decided

    def draw(self) -> torch.Tensor:
        """This rank's images, drawn once."""
        if self.images is None:
            ctx = self.ctx
            self.images = data.precise_bn_images(self.cfg, self.spec, self.num_images, ctx.rank, ctx.world_size)
        return self.images

    def recompute(self) -> None:
        self.draw()
        self.batch = precise_bn.recompute_images(self.ema.ema, self.images, self.ctx, self.batch, self.frozen)


class SameBuffers:
    """The EMA's buffers (BatchNorm's running statistics) made rank 0's on every rank before validation: the ranks
    validate one model, the one last.pt and best.pt save (rank 0's, as when rank 0 validated alone). Each rank
    trains with its own BatchNorm statistics (DDP does not broadcast buffers at each forward here, to keep one
    collective per window), so the EMAs' statistics drift apart; their parameters are the same on every rank. After a
    precise_bn recompute, which sums every rank's statistics, they are the same already."""

    phase = "validation"

    def __init__(self, ema: Any, ctx: Context):
        self.ema, self.ctx = ema, ctx

    def __call__(self, end: EpochEnd, decided: Decided) -> Decided:
        ddp.broadcast_buffers(self.ema.ema, self.ctx)
        return decided


class RankStates:
    """Every rank's own state (`of()`: random states, mosaic buffer, the engine's part) gathered to rank 0 for the next
    save. A collective: every rank calls it, at the point of the epoch (or stop) where its random states are those the
    next epoch starts from. Without saving (save=False, the same on every rank) no rank gathers."""

    phase = "save"

    def __init__(self, of: Callable[[], dict[str, Any]], ctx: Context, enabled: bool):
        self.of, self.ctx, self.enabled = of, ctx, enabled
        self.gathered: list[dict[str, Any]] | None = None  # on rank 0, after gather()

    def gather(self) -> None:
        if self.enabled:
            self.gathered = ddp.gather_to_main(self.of(), self.ctx)

    def __call__(self, end: EpochEnd, decided: Decided) -> Decided:
        self.gather()
        return decided

    def for_save(self) -> list[dict[str, Any]]:
        """Every rank's state for the checkpoint, rank 0's as of now (after the steps, whatever they drew)."""
        return [self.of(), *self.gathered[1:]]


class Validate:
    """Validate the EMA with val=True, at the final epoch, and (as Ultralytics) whenever early stopping could trigger
    now, so that it sees a fresh figure; then note whether the fitness is the best so far."""

    phase = "validation"

    def __init__(self, evaluator: Evaluator, ema: Any, criterion: Any, state: TrainingState, val: bool, before=None):
        self.evaluator, self.ema, self.criterion, self.state, self.val = evaluator, ema, criterion, state, val
        self.before = before or (lambda: None)  # the validation batch after an out-of-memory back-off (the trainer's)

    def __call__(self, end: EpochEnd, decided: Decided) -> Decided:
        validated = self.val or end.final or self.state.possible_stop
        if validated:
            self.before()
            self.state.record_validation(self.evaluator.evaluate(self.ema.ema, self.criterion))
        return dataclasses.replace(decided, validated=validated, best=self.state.note_best())


class ResultsRow:
    """results.csv's row: time, mean training losses, metrics, lr per group, the accumulation's own columns as they
    were after any out-of-memory back-off, and where the time since the last row went (`time/<phase>`, seconds: the
    previous epoch's save, this epoch's training and its end up to this row); and the metrics table when verbose.
    `elapsed()` is the seconds since training started, as Ultralytics' `time` column, taken when the row is made."""

    phase = "logs"

    def __init__(
        self,
        results: Results,
        engine: Engine,
        state: TrainingState,
        loss_names,
        console: Console | None,
        elapsed: Callable[[], float],
    ):
        self.results, self.engine, self.state = results, engine, state
        self.loss_names, self.console, self.elapsed = loss_names, console, elapsed

    def __call__(self, end: EpochEnd, decided: Decided) -> Decided:
        e, s = self.engine, self.engine.schedule
        split = e.timer.take()  # the time since the last row, every step before this one lapped (run_steps)
        row = {"epoch": end.epoch + 1, "time": round(self.elapsed(), 3)}  # as Ultralytics
        row.update({f"train/{n}": v for n, v in zip(self.loss_names, end.train_losses)})
        row.update(self.state.metrics)
        row.pop("fitness", None)
        row.update({f"lr/pg{i}": g["lr"] for i, g in enumerate(e.optimizer.param_groups)})
        extra = (e.accumulate, s.effective_batch, s.weight_decay, end.images_per_second, e.micro_batch)
        row.update(zip(EXTRA_COLUMNS, extra))
        row.update({f"time/{phase}": round(split.get(phase, 0.0), 4) for phase in timing.PHASES})
        self.results.append(row)
        if self.console is not None and decided.validated:
            show_metrics(self.console, self.state.metrics, f"epoch {end.epoch + 1}/{s.epochs}")
        return dataclasses.replace(decided, row=row)


class EarlyStopping:
    """Ultralytics' early stopping (TrainingState.stop_early): "patience" ends the run, except at its final epoch."""

    phase = "other"

    def __init__(self, state: TrainingState):
        self.state = state

    def __call__(self, end: EpochEnd, decided: Decided) -> Decided:
        if self.state.stop_early(end.epoch + 1) and not end.final:
            return dataclasses.replace(decided, stop="patience")
        return decided


class Save:
    """last.pt after every epoch, epochN.pt every save_period epochs, and best.pt when fitness improved. `checkpoint_of`
    gives the run's checkpoint at its training state's position (state.of), finished or not. `best_model` is the
    model of the best.pt this process wrote last (its half-precision EMA, which nothing changes afterwards), so that
    the final validation need not read the file back; None until one is written."""

    phase = "save"

    def __init__(self, weights: Path, save_period: int, checkpoint_of: Callable[[bool], dict[str, Any]]):
        self.weights, self.save_period, self.checkpoint_of = weights, save_period, checkpoint_of
        self.best_model: torch.nn.Module | None = None

    def __call__(self, end: EpochEnd, decided: Decided) -> Decided:
        paths = [self.weights / "last.pt"]
        if self.save_period > 0 and (end.epoch + 1) % self.save_period == 0:
            paths.append(self.weights / f"epoch{end.epoch + 1}.pt")
        ckpt = self.checkpoint_of(end.final or decided.stop is not None)
        checkpoint.save_atomic(ckpt, *paths)
        if decided.best:
            best = checkpoint.stripped(ckpt)
            checkpoint.save_atomic(best, self.weights / "best.pt")
            self.best_model = best["model"]
        return decided


def run_steps(steps: list[Step], end: EpochEnd, timer: PhaseTimer | None = None) -> Decided:
    """The steps in order, each given what the ones before it decided; each one's time lapped to its phase."""
    decided = Decided()
    for step in steps:
        decided = step(end, decided)
        if timer is not None:
            timer.lap(getattr(step, "phase", "other"))
    return decided


def timed(step: Step, seconds: list[float]) -> Step:
    """`step`, appending the seconds each call takes to `seconds` (for benchmarks that time a step in a real run)."""

    def run(end: EpochEnd, decided: Decided) -> Decided:
        start = time.perf_counter()
        try:
            return step(end, decided)
        finally:
            seconds.append(time.perf_counter() - start)

    return run
