"""The Python API, yoloaccum's front door: train, val, predict and plan, with the CLI's keys as keyword arguments.

    from yoloaccum import train
    r = train(data="my.yaml", model="yolo26n.pt", batch=4)   # also in a notebook
    r.metrics["metrics/mAP50-95(B)"], r.best, r.last

Values are Python values (batch=4, freeze=[0, 1], device=0, data=Path(...)); `cfg` names a recipe YAML, as cfg= does
on the command line. A mistake raises UserError with the CLI's one-line message; nothing here exits the process or
reads sys.argv (the CLI parses argv into these calls and owns the exit codes). The configuration is resolved before
torch is imported, so a typo answers at once. Each call leaves the process's global settings as it found them
(process/global_settings.py), also when it raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yoloaccum.commands.result import TrainResult
from yoloaccum.config import settings as config
from yoloaccum.process.global_settings import backend_kept, kept

__all__ = ["TrainResult", "plan", "predict", "train", "val"]


def train(
    cfg: str | Path | None = None, *, callbacks: Mapping[str, Any] | str | Path | None = None, **overrides: Any
) -> TrainResult:
    """Train a detector with gradient accumulation, e.g. train(data="coco.yaml", batch=8, nbs=64).

    `callbacks`: Ultralytics' training events to functions (one or a list each), called on rank 0 with an object that
    has the attributes of Ultralytics' trainer, e.g. callbacks={"on_fit_epoch_end": lambda t: print(t.metrics)}; or
    a Python file whose functions are named after the events (docs/callbacks.md)."""
    given = _given(cfg, overrides)
    resolved = config.resolve(overrides=given)  # a mistake answers here, before torch and Ultralytics load
    from yoloaccum.commands import train as train_  # torch and Ultralytics: kept() leaves what importing them sets

    with kept():
        return train_.run(resolved, given, callbacks)


def val(cfg: str | Path | None = None, **overrides: Any) -> dict[str, float]:
    """Validate weights on a dataset, e.g. val(model="runs/train/exp/weights/best.pt", data="coco.yaml")."""
    given = _given(cfg, overrides)
    resolved = config.resolve(overrides=given)
    from yoloaccum.commands import val as val_

    with kept():
        return val_.run(resolved, given)


def predict(cfg: str | Path | None = None, **overrides: Any) -> list[dict[str, Any]]:
    """Detect objects in an image or a folder, e.g. predict(model="best.pt", source="images/"); returns one record
    per image, as predictions.json holds them."""
    resolved = config.resolve(overrides=_given(cfg, overrides))
    from yoloaccum.commands import predict as predict_

    with kept():
        return predict_.run(resolved)


def plan(
    cfg: str | Path | None = None,
    *,
    images: int | None = None,
    as_json: bool = False,
    plot: str | Path | None = None,
    **overrides: Any,
):
    """What a recipe will do, printed (as a table, or JSON): accumulate, effective batch, weight decay, the warmup
    ramp. images=N stands in for counting the dataset's training images. Returns the Schedule."""
    from yoloaccum.commands import plan as plan_

    resolved = config.resolve(overrides=_given(cfg, overrides))
    # plot= switches matplotlib's backend, plan's one global setting. Not all of kept(): counting the images of data=
    # imports Ultralytics here, and the environment its import sets (config/ultra.py) must stay.
    with backend_kept():
        return plan_.run(resolved, images, as_json, Path(plot) if plot else None)


def _given(cfg: str | Path | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments as config keys: paths as text, and the recipe as cfg."""
    given = {k: str(v) if isinstance(v, Path) else v for k, v in overrides.items()}
    if cfg is not None:
        given["cfg"] = str(cfg)
    return given
