"""yoloaccum: a gradient-accumulating trainer for YOLO object detectors, built on Ultralytics' model, loss and data."""

__version__ = "0.1.0"
