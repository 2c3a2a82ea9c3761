"""yoloaccum: a gradient-accumulating trainer for YOLO object detectors, built on Ultralytics' model, loss and data.

The front door is the Python API (`from yoloaccum import train`); the `yoloaccum` command parses argv into it."""

__version__ = "0.1.0"

from yoloaccum.api import TrainResult, plan, predict, train, val  # noqa: E402
from yoloaccum.errors import UserError  # noqa: E402

__all__ = ["TrainResult", "UserError", "plan", "predict", "train", "val"]
