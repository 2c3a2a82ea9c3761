"""The run folder (project/name, exp2, exp3, ...) with args.yaml, weights/ and results."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from yoloaccum.config.settings import Config
from yoloaccum.distributed import elastic
from yoloaccum.errors import UserError
from yoloaccum.model.checkpoint import open_in_run
from yoloaccum.training.progress import Results


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
    made: Path | None = None  # the outermost folder this run made (its own, or project= too); None when reused

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
        made = None if path.exists() else path
        while made is not None and not made.parent.exists():  # project= too, where this run makes it
            made = made.parent
        try:
            (path / "weights").mkdir(parents=True, exist_ok=True)
            probe = path / ".write_test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise UserError(f"cannot write the run folder {path} ({e.strerror}); choose another project=") from e
        run = cls(path, made=made)
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
        """Remove the folder of a run that failed before it trained, if this run made it, and project= with it where
        the run made that too."""
        if self.made is not None:
            shutil.rmtree(self.made, ignore_errors=True)

    def discard_if_empty(self) -> None:
        """Remove the folder of a run that stopped before it saved weights or a results row (a second Ctrl-C in its
        first epoch, or one while compile= compiles), if this run made it: args.yaml alone is nothing to resume."""
        if not any(self.weights.glob("*")) and not self.results.file.exists():
            self.discard()

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

    def finish(self, evaluator, cfg: Config, time_lines: Callable[[], list[str]] = list) -> None:
        """results.png, the final per-class table, where the run's time went (`time_lines()`, asked once the pictures
        are drawn, so that they count), and where its weights are, last."""
        if cfg.plots and self.results.file.exists():
            self.results.plot()
        if evaluator is not None and cfg.verbose:
            self.console.print(evaluator.class_table())
        for line in time_lines():
            self.console.print(line)
        if cfg.save:
            self.console.print(f"weights: {self.weights / 'best.pt'} and {self.weights / 'last.pt'}")
        else:
            self.console.print(f"no weights saved (save=False); results in {self.path}")
