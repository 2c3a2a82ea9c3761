"""tensorboard=True: a TensorBoard log in the run folder, written by an end-of-epoch step (epoch_end.py).

Per optimizer step (x: the iteration it followed): each group's lr, the momentum (Adam's beta1), the window's
micro-batches and images, and the windows skipped so far. Per epoch (x: the epoch): every column of results.csv
(training and validation losses, metrics, lr, accumulate, effective batch, weight decay, images/s). The log is
Ultralytics' optional extra: without the tensorboard package the run says so once and trains without it.
"""

from __future__ import annotations

import bisect
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from yoloaccum.core.window import StepRecord
    from yoloaccum.training.epoch_end import Decided, EpochEnd
    from yoloaccum.training.runs import RunDir


class TensorBoard:
    """Writes the epoch's optimizer steps and results row, then flushes, so the log is whole after every epoch."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    @classmethod
    def for_run(cls, run: RunDir) -> TensorBoard | None:
        if importlib.util.find_spec("tensorboard") is None:
            run.console.print(
                "[yellow]warning:[/] tensorboard=True, but the tensorboard package is not installed "
                "(pip install tensorboard); training without a TensorBoard log"
            )
            return None
        return cls(run.path)

    def __call__(self, end: EpochEnd, decided: Decided) -> Decided:
        self.write_steps(end.steps, end.skipped)
        for key, value in decided.row.items():
            if key != "epoch":
                self.writer.add_scalar(key, value, end.epoch + 1)
        self.writer.flush()
        return decided

    def write_steps(self, steps: Iterable[StepRecord], skipped: Iterable[int]) -> None:
        """The optimizer steps of the epoch so far: at its end, or at a stop inside it (where last.pt is written, so
        that the resumed run logs on from there and no step is logged twice). `skipped`: every skipped window of the
        run, also before a resume."""
        w, skipped = self.writer, sorted(skipped)
        for r in steps:
            for i, lr in enumerate(r.lrs):
                w.add_scalar(f"step/lr/pg{i}", lr, r.ni)
            w.add_scalar("step/momentum", r.momentum, r.ni)
            w.add_scalar("step/accumulate", r.micro_batches, r.ni)
            w.add_scalar("step/effective_batch", r.images, r.ni)
            w.add_scalar("step/skipped_windows", bisect.bisect_right(skipped, r.ni), r.ni)
        w.flush()

    def close(self) -> None:
        self.writer.close()
