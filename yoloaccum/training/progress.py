"""Progress and results: a rich bar in a terminal, plain lines elsewhere, results.csv and results.png, and
schedule.csv (one row per optimizer step).

Loss values live on the device and are read back (a host sync) only when a line or the bar is refreshed, every
`log_every` micro-batches, never per micro-batch.
"""

from __future__ import annotations

import csv
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from yoloaccum.model.checkpoint import disk_errors, open_in_run

# The phases' short names in the progress line (core/timing.py has the phases).
SHORT = {"forward_backward": "fwd+bwd", "to_device": "h2d", "bn_window": "bn-pass", "precise_bn": "precise-bn"}
# accumulate and micro_batch (per device) are those the epoch ended with: an out-of-memory back-off changes them.
EXTRA_COLUMNS = ("accumulate", "effective_batch", "weight_decay", "images_per_second", "micro_batch")


def memory_gb(device: torch.device) -> float:
    """Memory in use: CUDA's reserved memory, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


class EpochProgress:
    """One epoch's display. `update()` is called every micro-batch and is cheap; it reads values back rarely."""

    def __init__(
        self,
        epoch: int,
        epochs: int,
        num_batches: int,
        loss_names: tuple[str, ...],
        log_every: int,
        device: torch.device,
        enabled: bool = True,
        console: Console | None = None,
        split: Callable[[], dict[str, float]] | None = None,
    ):
        self.split = split  # where the time since the last results row went (timing.PhaseTimer.current)
        self.epoch, self.epochs, self.nb, self.names = epoch, epochs, num_batches, loss_names
        self.log_every, self.device, self.enabled = log_every, device, enabled
        self.console = console or Console()
        self.interactive = enabled and self.console.is_terminal
        # Loss sums on the device: of the windows that stepped, and of the open window, whose fate its end decides.
        self.loss_sum: torch.Tensor | None = None
        self.window_sum: torch.Tensor | None = None
        self.count, self.window_count = 0, 0  # micro-batches in each
        self.images, self.start = 0, time.perf_counter()
        self.bar: Progress | None = None
        if self.interactive:
            columns = (BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), TextColumn("{task.fields[stats]}"))
            self.bar = Progress(TextColumn("{task.description}"), *columns, console=self.console)
            self.task = self.bar.add_task(f"epoch {epoch + 1}/{epochs}", total=num_batches, stats="")
            self.bar.start()

    def update(
        self, i: int, items: torch.Tensor, num_images: int, fill: int, accumulate: int, effective_batch: int, lr: float
    ) -> None:
        """Record micro-batch i (0-based); fill/accumulate is the window's progress; items are the loss terms."""
        self.window_sum = items.detach() if self.window_sum is None else self.window_sum + items.detach()
        self.images, self.window_count = self.images + num_images, self.window_count + 1
        if not self.enabled:
            return
        last = i + 1 == self.nb
        refresh = last or (i + 1) % self.log_every == 0
        if self.bar is not None:
            fields = {"stats": self._stats(i, fill, accumulate, effective_batch, lr)} if refresh else {}
            self.bar.update(self.task, completed=i + 1, **fields)
        elif refresh:
            print(
                f"epoch {self.epoch + 1}/{self.epochs} {i + 1}/{self.nb} "
                f"{self._stats(i, fill, accumulate, effective_batch, lr)}",
                flush=True,
            )

    def end_window(self, skipped: bool) -> None:
        """The window closed: its losses count towards the epoch's mean unless it was skipped as non-finite."""
        if not skipped and self.window_sum is not None:
            self.loss_sum = self.window_sum if self.loss_sum is None else self.loss_sum + self.window_sum
            self.count += self.window_count
        self.window_sum, self.window_count = None, 0

    def _stats(self, i: int, fill: int, accumulate: int, effective_batch: int, lr: float) -> str:
        losses = " ".join(f"{n.replace('_loss', '')}={v:.3f}" for n, v in zip(self.names, self.mean_losses()))
        return (
            f"window {fill}/{accumulate} eff_batch={effective_batch} lr={lr:.3g} {losses} "
            f"{self.images_per_second():.1f} img/s mem={memory_gb(self.device):.2f}G{self._split()}"
        )

    def _split(self) -> str:
        """The three largest shares of the time so far: " fwd+bwd 71% data 12% step 9%"."""
        split = self.split() if self.split else {}
        total = sum(split.values())
        if not total:
            return ""
        top = sorted(((seconds, phase) for phase, seconds in split.items()), reverse=True)[:3]
        return "".join(f" {SHORT.get(phase, phase)} {seconds / total:.0%}" for seconds, phase in top)

    def mean_losses(self) -> list[float]:
        """Mean loss terms per micro-batch over the windows that stepped and the open one (nan when none did)."""
        sums = [t for t in (self.loss_sum, self.window_sum) if t is not None]
        if not sums:
            return [float("nan")] * len(self.names)
        return (sum(sums) / (self.count + self.window_count)).tolist()

    def images_per_second(self) -> float:
        return self.images / max(time.perf_counter() - self.start, 1e-9)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class Results:
    """results.csv with Ultralytics' column names plus yoloaccum's, one row per epoch, and results.png from it."""

    def __init__(self, save_dir: Path):
        self.file = save_dir / "results.csv"

    def append(self, row: dict[str, float]) -> None:
        new = not self.file.exists()
        if not new:
            with self.file.open() as f:
                header = f.readline().strip().split(",")
            if header != list(row) and header == [k for k in row if not k.startswith("time/")]:
                row = {k: row[k] for k in header}  # a run resumed from before the time split keeps its columns
            assert header == list(row), f"results.csv columns changed: {header} -> {list(row)}"
        with open_in_run(self.file, "a") as f:
            writer = csv.DictWriter(f, fieldnames=list(row))
            if new:
                writer.writeheader()
            writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})

    def truncate(self, epochs: int) -> None:
        """Keep the rows of the first `epochs` epochs: a resumed run rewrites what came after its checkpoint."""
        if not self.file.exists():
            return
        with self.file.open() as f:
            rows = list(csv.reader(f))
        # whole rows only: a disk that filled up may have cut the last one
        whole = [r for r in rows[1:] if len(r) == len(rows[0])]
        kept = [rows[0]] + [r for r in whole if int(float(r[0])) <= epochs] if rows else []
        with open_in_run(self.file, "w") as f:
            csv.writer(f).writerows(kept)

    def plot(self) -> None:
        from ultralytics.utils.plotting import plot_results

        with disk_errors(self.file.with_suffix(".png"), trained=True):  # drawn once training has finished
            plot_results(file=self.file)  # matplotlib only: draws every *loss* and metrics/* column


class StepLog:
    """schedule.csv: one row per optimizer step as the engine took it (window.StepRecord), appended once per epoch
    from records kept in memory, so logging adds no host sync and no file write inside an epoch. `replays` counts
    the times a window ran again after an AMP overflow before it stepped."""

    def __init__(self, save_dir: Path):
        self.file = save_dir / "schedule.csv"
        self.replays_column: bool | None = None  # known at the first append

    def append(self, records: list, batches_per_epoch: int) -> None:
        if not records:
            return
        new = not self.file.exists()
        if self.replays_column is None:  # a run resumed from before the replays column keeps its file's columns
            self.replays_column = new or "replays" in self.file.read_text().partition("\n")[0]
        replays = self.replays_column
        with open_in_run(self.file, "a") as f:
            writer = csv.writer(f)
            if new:
                lrs = [f"lr/pg{i}" for i in range(len(records[0].lrs))]
                writer.writerow(
                    ["ni", "epoch", "accumulate", "effective_batch", *lrs, "momentum", "skipped", "replays"]
                )
            for r in records:
                row = [r.ni, r.ni // batches_per_epoch + 1, r.micro_batches, r.images, *(f"{x:.6g}" for x in r.lrs)]
                writer.writerow([*row, f"{r.momentum:.6g}", int(r.skipped), *([r.replays] if replays else [])])

    def truncate(self, ni: int) -> None:
        """Keep the steps taken before iteration ni: a resumed run rewrites what came after its checkpoint."""
        if not self.file.exists():
            return
        with self.file.open() as f:
            rows = list(csv.reader(f))
        kept = [rows[0]] + [r for r in rows[1:] if len(r) == len(rows[0]) and int(r[0]) < ni] if rows else []
        with open_in_run(self.file, "w") as f:
            csv.writer(f).writerows(kept)
