"""The run folder (project/name, exp2, exp3, ...) with args.yaml, weights/ and results; the run's seeding, memory
allocator and garbage collector settings."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from yoloaccum import elastic
from yoloaccum.checkpoint import open_in_run
from yoloaccum.config import Config
from yoloaccum.errors import UserError
from yoloaccum.progress import Results


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed python, numpy and torch; with deterministic, ask torch for deterministic kernels where it has them."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Deterministic mode also fills every new tensor with NaN, to expose reads of uninitialised memory. That is a
        # debugging aid, not part of determinism, and costs a fill kernel per allocation (docs/performance.md).
        # Ultralytics turns it off too.
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.deterministic = True
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


# glibc's mallopt() parameters (malloc.h). 32 MiB is the largest mmap threshold older glibc accepts (HEAP_MAX_SIZE / 2);
# tensors above it still come and go with mmap, as by default.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_BYTES, _TRIM_BYTES = 32 << 20, 256 << 20


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse, instead of giving it back to the kernel after every micro-batch.

    By default glibc serves each large tensor with a fresh mmap, or trims the heap when a micro-batch's activations
    are freed, and the next micro-batch faults every page in again; with these thresholds the faults and their kernel
    time mostly go (measured on 2 CPU cores, docs/performance.md). The setting is process-wide and stays, so the
    trainer applies it only when training on the CPU, where it was measured: on CUDA the activations live on the
    device, and each forked loader worker would keep up to the trim threshold of freed heap. Returns whether glibc
    accepted it: False where the C library is not glibc (with jemalloc or tcmalloc preloaded it returns True but
    changes nothing).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES))


def next_free(base: Path, exist_ok: bool) -> Path:
    """base itself if free (or exist_ok), else base2, base3, ... as Ultralytics names runs."""
    if exist_ok or not base.exists():
        return base
    n = 2
    while (path := base.with_name(f"{base.name}{n}")).exists():
        n += 1
    return path


@dataclass
class RunDir:
    """A run's output folder; created and checked for writability before training starts."""

    path: Path
    console: Console = field(default_factory=lambda: Console(soft_wrap=True))  # logs keep whole lines
    created: bool = False  # made by this run, not reused (exist_ok) or reopened (resume)

    @classmethod
    def create(cls, cfg: Config) -> RunDir:
        project = Path(cfg.project or "runs/train")
        name = cfg.name or "exp"
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise UserError(
                f"name={name} would put the run outside project={project}; give a plain name such as "
                f"name=exp, and choose the folder with project="
            )
        path = next_free(project / name, cfg.exist_ok)
        created = not path.exists()
        try:
            (path / "weights").mkdir(parents=True, exist_ok=True)
            probe = path / ".write_test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise UserError(f"cannot write the run folder {path} ({e.strerror}); choose another project=") from e
        run = cls(path, created=created)
        run.write_args(cfg)
        elastic.mark(path)  # under torchrun: a job it restarts finds its run here
        for log in ("results.csv", "schedule.csv"):
            (path / log).unlink(missing_ok=True)  # exist_ok reuses the folder, not an old run's rows
        return run

    @classmethod
    def reopen(cls, path: Path) -> RunDir:
        """The folder of a run being resumed, as it is."""
        if not (path / "weights").is_dir():
            raise UserError(f"{path} is not a run folder (no weights/ in it); resume needs a run's weights/last.pt")
        return cls(path)

    def discard(self) -> None:
        """Remove the folder of a run that failed before it trained, if this run made it."""
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)

    def write_args(self, cfg: Config) -> None:
        """args.yaml: the run's settings (again when a resume extends its epochs)."""
        with open_in_run(self.path / "args.yaml", "w") as f:
            f.write(cfg.to_yaml())

    @property
    def weights(self) -> Path:
        return self.path / "weights"

    @property
    def results(self) -> Results:
        return Results(self.path)

    def announce(self, schedule, num_images: int, ctx, workers: int, bn_images: int = 0, batch_choice=None) -> None:
        s = schedule
        loading = f"{workers} loader workers" if workers else "data loaded in the training process"
        precise = f"BatchNorm statistics recomputed over {bn_images} images before validation; " if bn_images else ""
        chosen = f"; micro-batch from memory: {batch_choice.reason}" if batch_choice else ""
        self.console.print(
            f"[bold]yoloaccum[/] {num_images} images, {s.epochs} epochs on {ctx.world_size} × {ctx.device}: "
            f"micro-batch {s.micro_batch} × accumulate {s.accumulate} × {ctx.world_size} device(s) = effective batch "
            f"{s.effective_batch}; weight decay {s.weight_decay:g}; {s.optimizer} lr0={s.lr0:g}"
            f"{f' x {s.lr_multiplier:.4g} (lr_scale={s.lr_scale})' if s.lr_scale != 'ultralytics' else ''}; {loading}; "
            f"{precise}results in {self.path}{chosen}"
        )

    def finish(self, evaluator, cfg: Config) -> None:
        """results.png and the final per-class table."""
        if cfg.plots and self.results.file.exists():
            self.results.plot()
        if evaluator is not None and cfg.verbose:
            self.console.print(evaluator.class_table())
        if cfg.save:
            self.console.print(f"weights: {self.weights / 'best.pt'} and {self.weights / 'last.pt'}")
        else:
            self.console.print(f"no weights saved (save=False); results in {self.path}")


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
