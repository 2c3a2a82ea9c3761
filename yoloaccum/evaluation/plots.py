"""The run folder's pictures (plots=True): Ultralytics' own plotting code for the labels, batches, confusion
matrices and curves, and schedule.png, drawn from what the run logged in schedule.csv.

Importing yoloaccum.config.ultra first replaces Ultralytics' font download with a font matplotlib ships, so nothing here
reaches the network. The training-batch grids are drawn in a background thread (Ultralytics' plot_images does so by
default), so training does not wait for them; so is labels.jpg, which is finished before the final validation draws
with matplotlib (pyplot is not thread-safe).
"""

from __future__ import annotations

import csv
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import yoloaccum.config.ultra  # noqa: F401  (offline, and check_font patched, before any Ultralytics plotting import)
from yoloaccum.core.schedule import Schedule
from yoloaccum.core.timing import PhaseTimer
from yoloaccum.model.checkpoint import disk_errors


def labels(dataset, names: dict[int, str], save_dir: Path) -> None:
    """labels.jpg: class counts and box centres and sizes of the training labels, as Ultralytics' trainer draws it."""
    from ultralytics.utils.plotting import plot_labels

    boxes = np.concatenate([lb["bboxes"] for lb in dataset.labels], 0)
    cls = np.concatenate([lb["cls"] for lb in dataset.labels], 0)
    if len(cls):  # a set of background images only has nothing to draw
        plot_labels(boxes, cls.squeeze(-1), names=names, save_dir=save_dir)


class Background:
    """draw(*args) in a thread of its own, started now; join() it before anything else draws with pyplot, and to
    raise what it raised. Not a daemon, as Ultralytics' threaded plots: a picture being written when training ends
    is finished, not cut."""

    def __init__(self, draw: Callable[..., None], *args):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(draw, *args), name=f"plot-{draw.__name__}")
        self.thread.start()

    def _run(self, draw: Callable[..., None], *args) -> None:
        try:
            draw(*args)
        except BaseException as e:  # raised in the training thread, at join()
            self.error = e

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def train_batch_indices(schedule: Schedule, close_mosaic: int) -> frozenset[int]:
    """Iterations whose batch Ultralytics draws: the first three, and the first three after close_mosaic."""
    nb = schedule.batches_per_epoch
    first = (0, 1, 2)
    closed = (max(schedule.epochs - close_mosaic, 0) * nb + k for k in first) if close_mosaic else ()
    return frozenset((*first, *closed))


def train_batches(
    batches: Iterable[dict],
    first_ni: int,
    plot_at: frozenset[int],
    save_dir: Path,
    names: dict[int, str],
    timer: PhaseTimer | None = None,
) -> Iterator[dict]:
    """The loader's batches, unchanged; those at an iteration in plot_at are also drawn into train_batch{ni}.jpg (the
    time that takes lapped as plots, the wait for the batch before it as data)."""
    from ultralytics.utils.plotting import plot_images

    for ni, batch in enumerate(batches, first_ni):
        if ni in plot_at:
            if timer is not None:
                timer.lap("data")
            # A shallow copy: the engine replaces batch["img"] with the model's input while the thread still draws.
            plot_images(
                labels=dict(batch), paths=batch["im_file"], fname=save_dir / f"train_batch{ni}.jpg", names=names
            )
            if timer is not None:
                timer.lap("plots")
        yield batch


def schedule(steps_csv: Path, path: Path) -> None:
    """schedule.png: accumulate, effective batch, lr per group and momentum of every optimizer step the run took,
    by iteration, with the skipped (non-finite) windows marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_csv(steps_csv)
    if not rows:
        return
    ni = [r["ni"] for r in rows]
    skipped = [r["ni"] for r in rows if r["skipped"]]
    lr_columns = [k for k in rows[0] if k.startswith("lr/")]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    panels = (
        ("accumulate", ["accumulate"]),
        ("effective batch", ["effective_batch"]),
        ("lr", lr_columns),
        ("momentum", ["momentum"]),
    )
    for ax, (title, columns) in zip(axes, panels):
        for column in columns:
            ax.step(ni, [r[column] for r in rows], where="pre", label=column.removeprefix("lr/"))
        for x in skipped:
            ax.axvline(x, color="red", alpha=0.5, lw=1)
        ax.set_ylabel(title)
        if len(columns) > 1:
            ax.legend(fontsize=8)
    axes[0].set_title(f"as run: {len(rows)} optimizer steps" + (f", {len(skipped)} skipped (red)" if skipped else ""))
    axes[-1].set_xlabel("iteration (ni) at the end of the window")
    fig.tight_layout()
    with disk_errors(path, trained=True):  # drawn once training has finished
        fig.savefig(path, dpi=100)
    plt.close(fig)


def read_csv(path: Path) -> list[dict[str, Any]]:
    """schedule.csv as numbers: ints where whole, floats elsewhere, `skipped` as a bool."""
    if not path.is_file():
        return []
    with path.open() as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        values = {k: float(v) for k, v in r.items()}
        values.update({k: int(values[k]) for k in ("ni", "epoch", "accumulate", "effective_batch")})
        values["skipped"] = bool(values["skipped"])
        out.append(values)
    return out
