"""Ultralytics' training events in yoloaccum's runs: one's own callbacks (`train(callbacks={...})`) and the experiment
trackers that Ultralytics' settings switch on (`yolo settings mlflow=True`), run through them as `yolo train` runs them.

Every callback is called with a `RunView`: an object with the attributes Ultralytics' callbacks read from its trainer,
meaning what they mean there (`epoch` from 0, `metrics` with Ultralytics' keys, `tloss` the epoch's mean losses,
`save_dir`, `best`, `last`, `lr`, `label_loss_items`, `validator`, ...), so that code written for Ultralytics' callbacks
runs unchanged. The events come in Ultralytics' order; callbacks run on rank 0 only, as Ultralytics' integrations
log from there. A callback that raises ends the run as any error does: last.pt holds the last completed save.

The trackers are chosen as Ultralytics' `add_integration_callbacks` chooses them: each of clearml, comet, dvc,
mlflow, raytune and wandb whose setting is True (the first five are by default; each acts only where its package is
installed). Unlike there, Ultralytics' usage events and its platform callbacks are never added: yoloaccum stays
offline. Its tensorboard setting is answered by yoloaccum's own log (`tensorboard=True`, training/tensorboard.py),
which writes what Ultralytics' writes and each optimizer step's schedule besides.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from yoloaccum.errors import UserError
from yoloaccum.training.progress import EXTRA_COLUMNS

# Ultralytics' trainer events (ultralytics/utils/callbacks/base.py), in the order a run meets them.
EVENTS = (
    "on_pretrain_routine_start",
    "on_pretrain_routine_end",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_fit_epoch_end",
    "on_model_save",
    "on_train_end",
    "on_params_update",
    "teardown",
)
# Ultralytics' setting: the module of its integration in ultralytics.utils.callbacks
TRACKERS = {
    "clearml": "clearml",
    "comet": "comet",
    "dvc": "dvc",
    "mlflow": "mlflow",
    "raytune": "raytune",
    "wandb": "wb",
}

Callbacks = dict[str, list[Callable[[Any], Any]]]


def checked(callbacks: Mapping[str, Any] | None) -> Callbacks:
    """`train(callbacks=...)` as {event: [callables]}; a mistake in it is a UserError that says what to give."""
    if callbacks is None:
        return {}
    if not isinstance(callbacks, Mapping):
        raise UserError(
            "callbacks= takes a dict from Ultralytics' event names to a function or a list of functions, e.g. "
            f"callbacks={{'on_fit_epoch_end': log_metrics}}; got {type(callbacks).__name__}"
        )
    out: Callbacks = {}
    for event, given in callbacks.items():
        if event not in EVENTS:
            raise UserError(
                f"callbacks: unknown event {event!r}; Ultralytics' training events are: {', '.join(EVENTS)}"
            )
        functions = list(given) if isinstance(given, list | tuple) else [given]
        for f in functions:
            if not callable(f):
                raise UserError(f"callbacks[{event!r}]: {f!r} is not callable; give a function that takes the trainer")
        out[event] = functions
    return out


def trackers() -> tuple[Callbacks, list[str]]:
    """The experiment trackers Ultralytics' settings enable, as `yolo train` adds them, without its usage events and
    platform callbacks; and the settings of those that act. Each one's module imports its package only where it is
    installed, and has no callbacks otherwise (nor under pytest, except MLflow's in tests named test_mlflow)."""
    from ultralytics.utils import SETTINGS

    out: Callbacks = defaultdict(list)
    acting = []
    for setting, module in TRACKERS.items():
        if SETTINGS.get(setting) is True:
            callbacks = importlib.import_module(f"ultralytics.utils.callbacks.{module}").callbacks
            for event, f in callbacks.items():
                out[event].append(f)
            if callbacks:
                acting.append(setting)
    return dict(out), acting


class RunView:
    """The run as Ultralytics' callbacks see a trainer, on rank 0 (which holds the run folder). Read live from the
    yoloaccum trainer; `epoch` is the epoch in progress, from 0 (the final validation's figures are reported one past
    the last epoch trained, as Ultralytics reports them)."""

    def __init__(self, trainer: Any, events: Events):
        self._trainer, self._events = trainer, events
        p = trainer.parts
        from yoloaccum.config.ultra import ultralytics_args

        self.save_dir = Path(p.run.path)
        # as Ultralytics' trainer sets them: the run folder's name (exp2, ...) names the trackers' run
        args = {"mode": "train", "plots": p.cfg.plots, "save": p.cfg.save, "name": self.save_dir.name}
        self.args = ultralytics_args(p.cfg, **args, project=str(self.save_dir.parent))
        self.wdir = self.save_dir / "weights"
        self.best, self.last = self.wdir / "best.pt", self.wdir / "last.pt"
        self.csv = self.save_dir / "results.csv"
        self.epoch = trainer.state.position[0]
        self.start_epoch = self.epoch
        self.plots: dict[Path, dict[str, Any]] = {}  # the run's pictures, for the trackers that upload them
        self.stop = False  # set by a callback: the run ends after this epoch's end steps
        self.epoch_time = 0.0  # seconds of the last epoch, its end steps up to its row included
        self._row: Mapping[str, float] = {}  # the last results.csv row
        self._final: dict[str, float] | None = None  # the final validation's figures, once training is over

    def __getattr__(self, name: str) -> Any:  # what Ultralytics' trainer has and this view does not: say so
        raise AttributeError(
            f"yoloaccum's run has no {name!r} for callbacks; it has: {', '.join(sorted(_ATTRIBUTES))} "
            "(docs/callbacks.md)"
        )

    @property
    def epochs(self) -> int:
        return self._trainer.parts.schedule.epochs

    def add_callback(self, event: str, callback: Callable[[Any], Any]) -> None:
        """Ultralytics' trainer.add_callback: W&B's integration adds its own at its start."""
        self._events.add(event, callback)

    def run_callbacks(self, event: str) -> None:
        self._events.run(event)

    @property
    def train_loader(self):
        return self._trainer.parts.loader

    @property
    def test_loader(self):
        return self._trainer.parts.evaluator.validator.dataloader

    @property
    def model(self):
        return self._trainer.parts.raw_model

    @property
    def ema(self):
        return self._trainer.parts.ema

    @property
    def optimizer(self):
        return self._trainer.parts.engine.optimizer

    @property
    def device(self):
        return self._trainer.parts.ctx.device

    @property
    def world_size(self) -> int:
        return self._trainer.parts.ctx.world_size

    @property
    def batch_size(self) -> int:
        return self._trainer.parts.schedule.batch

    @property
    def accumulate(self) -> int:
        return self._trainer.parts.engine.accumulate

    @property
    def data(self) -> dict[str, Any]:
        spec = self._trainer.parts.spec
        return {"names": dict(spec.names), "nc": len(spec.names), "channels": 3}

    @property
    def validator(self):
        """Ultralytics' DetectionValidator that computed the last validation's metrics (with its plots and
        confusion matrix), as Ultralytics' trainer.validator."""
        return self._trainer.parts.evaluator.validator

    @property
    def metrics(self) -> dict[str, float]:
        """The last validation's figures with Ultralytics' keys (metrics/*, val/*; no fitness, as there), and the
        epoch's accumulation columns of results.csv (accumulate, effective_batch, weight_decay, images_per_second,
        micro_batch, time/*), so that the trackers log them too. After training: the final validation's, as there."""
        if self._final is not None:
            return dict(self._final)
        figures = {k: v for k, v in self._trainer.state.metrics.items() if k != "fitness"}
        return figures | {k: v for k, v in self._row.items() if k in EXTRA_COLUMNS or k.startswith("time/")}

    @property
    def fitness(self) -> float:
        return self._trainer.state.fitness

    @property
    def best_fitness(self) -> float | None:
        return self._trainer.state.best_fitness

    @property
    def loss_names(self) -> tuple[str, ...]:
        return self._trainer.loss_names

    @property
    def tloss(self):
        """The epoch's mean training losses, a tensor in loss_names' order (None before the first epoch ends)."""
        import torch

        losses = self._trainer.train_losses
        return torch.tensor(losses) if losses else None

    @property
    def loss_items(self):
        return self.tloss

    @property
    def lr(self) -> dict[str, float]:
        return {f"lr/pg{i}": g["lr"] for i, g in enumerate(self.optimizer.param_groups)}

    def label_loss_items(self, loss_items=None, prefix: str = "train"):
        """Ultralytics' DetectionTrainer.label_loss_items: {"train/box_loss": ...}, or the keys alone."""
        keys = [f"{prefix}/{name}" for name in self.loss_names]
        if loss_items is None:
            return keys
        return dict(zip(keys, [round(float(x), 5) for x in loss_items]))


_ATTRIBUTES = {n for n in dir(RunView) if not n.startswith("_")} | set(
    ["args", "save_dir", "wdir", "best", "last", "csv", "epoch", "start_epoch", "plots", "stop", "epoch_time"]
)


class Events:
    """The callbacks of a run, by event, and the view they are called with; nothing runs off rank 0."""

    def __init__(self, callbacks: Callbacks):
        self.callbacks = {event: list(fs) for event, fs in callbacks.items() if fs}
        self.view: RunView | None = None
        self.trackers: list[str] = []  # Ultralytics' settings of the trackers that log this run

    @classmethod
    def for_run(cls, own: Callbacks, main: bool) -> Events:
        """One's own callbacks, then the trackers', per event, as Ultralytics orders them (a model's callbacks are
        the trainer's before add_integration_callbacks appends its integrations); none off rank 0."""
        if not main:
            return cls({})
        theirs, acting = trackers()
        merged: Callbacks = defaultdict(list)
        for source in (own, theirs):
            for event, functions in source.items():
                merged[event].extend(functions)
        events = cls(merged)
        events.trackers = acting
        return events

    def attach(self, trainer: Any) -> None:
        if self.callbacks:
            self.view = RunView(trainer, self)

    def add(self, event: str, callback: Callable[[Any], Any]) -> None:
        if event not in EVENTS:
            raise UserError(
                f"add_callback: unknown event {event!r}; Ultralytics' training events are: {', '.join(EVENTS)}"
            )
        self.callbacks.setdefault(event, []).append(callback)

    @property
    def stop_requested(self) -> bool:
        """A callback set trainer.stop (rank 0's; the trainer makes it every rank's decision)."""
        return self.view is not None and bool(self.view.stop)

    def __contains__(self, event: str) -> bool:
        return event in self.callbacks

    def run(self, event: str, epoch: int | None = None) -> None:
        """Every callback of `event`, in the order added, with the view (its `epoch` first set to `epoch`)."""
        if self.view is not None and epoch is not None:
            self.view.epoch = epoch
        for f in list(self.callbacks.get(event, ())):
            f(self.view)

    def after_fitting(self, metrics: Mapping[str, float], last_epoch: int) -> None:
        """on_fit_epoch_end once more, as Ultralytics' final_eval calls it when best.pt exists: the final figures
        (best.pt's), at one past the last epoch trained, which `epoch` is set back to afterwards."""
        if self.view is None or not self.view.best.exists():
            return
        self.view._final = {k: v for k, v in metrics.items() if k != "fitness"}
        self.run("on_fit_epoch_end", last_epoch + 1)
        self.view.epoch = last_epoch

    def at_the_end(self) -> None:
        """on_train_end, with the run's pictures registered as Ultralytics' trainer registers its plots."""
        if self.view is not None:
            pictures = sorted(self.view.save_dir.glob("*.png")) + sorted(self.view.save_dir.glob("*.jpg"))
            self.view.plots.update({p: {"data": None, "timestamp": p.stat().st_mtime} for p in pictures})
        self.run("on_train_end")


class EpochEnded:
    """The end-of-epoch step that runs on_model_save (after last.pt is written) and on_fit_epoch_end, last."""

    phase = "logs"

    def __init__(self, events: Events, saved: bool):
        self.events, self.saved = events, saved
        self.last_row_time = 0.0  # results.csv's `time` at the last row: seconds since training started

    def __call__(self, end, decided):
        view = self.events.view
        if view is not None:
            view._row = decided.row
            view.epoch_time = decided.row["time"] - self.last_row_time
            self.last_row_time = decided.row["time"]
        if self.saved:
            self.events.run("on_model_save", end.epoch)
        self.events.run("on_fit_epoch_end", end.epoch)
        if self.events.stop_requested and decided.stop is None and not end.final:
            return dataclasses.replace(decided, stop="callback")
        return decided


def from_file(path: str | Path) -> Callbacks:
    """`callbacks=file.py` (the CLI's way to them): a Python file whose functions named after Ultralytics' events are
    the callbacks, or which holds a `callbacks` dict as train(callbacks=...) takes. A function whose name starts with
    on_ and is no event is refused: a misspelt event would otherwise never run."""
    import importlib.util
    import inspect

    file = Path(path)
    if not file.is_file() or file.suffix != ".py":
        raise UserError(
            f"callbacks={path}: no such Python file; give a .py file whose functions are named after events"
        )
    spec = importlib.util.spec_from_file_location(f"yoloaccum_callbacks_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise UserError(
            f"callbacks={path}: importing it raised {type(e).__name__}: {e}; run `python {path}` to see where"
        ) from e
    if isinstance(getattr(module, "callbacks", None), Mapping):
        return checked(module.callbacks)
    functions = {n: f for n, f in vars(module).items() if inspect.isfunction(f) and f.__module__ == module.__name__}
    found = {n: f for n, f in functions.items() if n in EVENTS or n.startswith("on_")}
    if not found:
        raise UserError(
            f"callbacks={path} defines no function named after an event; name them so, e.g. "
            "def on_fit_epoch_end(trainer)"
        )
    return checked(found)
