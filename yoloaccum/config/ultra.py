"""The one door to ultralytics: make it offline and quiet before it is imported, and translate our config to its args.

Ultralytics downloads fonts, weights and datasets, sends analytics and pip-installs missing packages by default.
yoloaccum never does any of that: these switches are set in-process before the first `import ultralytics`.

Ultralytics also sets OMP_NUM_THREADS=1 in the environment when it is imported. A torch imported after that, and every
process started later (subprocesses), would then compute on one thread, markedly slower on the CPU
(docs/performance.md). So torch is imported first, and the variable is removed again unless the user had set it. This
does nothing on CUDA or to forked loader workers: a worker inherits the parent's thread pools, which PyTorch sets to
one thread in each worker, and torchrun sets OMP_NUM_THREADS=1 for its ranks itself when the variable is unset.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("YOLO_OFFLINE", "1")  # is_online() -> False: no analytics, no hub, no update checks
os.environ.setdefault("YOLO_AUTOINSTALL", "false")  # never pip-install a missing requirement at run time
os.environ.setdefault("YOLO_VERBOSE", "false")  # yoloaccum prints its own progress
_USER_THREADS = os.environ.get("OMP_NUM_THREADS")

import torch  # noqa: E402, F401  (before ultralytics, which sets OMP_NUM_THREADS=1)
import ultralytics  # noqa: E402
from ultralytics.cfg import get_cfg  # noqa: E402
from ultralytics.utils import checks, plotting  # noqa: E402

from yoloaccum.config.settings import Config, ultralytics_defaults  # noqa: E402

if _USER_THREADS is None:
    os.environ.pop("OMP_NUM_THREADS", None)

VERSION = ultralytics.__version__


def _local_font(font: str = "Arial.ttf") -> str:
    """check_font without the download: Ultralytics fetches Arial.ttf when it is missing; matplotlib ships DejaVu."""
    from matplotlib import font_manager

    return font_manager.findfont("DejaVu Sans")


# Annotator calls check_font when it draws labels with PIL; replace both references so nothing is fetched.
checks.check_font = _local_font
plotting.check_font = _local_font


def ultralytics_args(cfg: Config, **extra: Any) -> SimpleNamespace:
    """Ultralytics' args namespace: its defaults, overlaid with every yoloaccum key that Ultralytics also has."""
    shared = {k: v for k, v in cfg.items() if k in ultralytics_defaults()}
    shared.update({"task": "detect", "mode": "train", "rect": False, "plots": False, "save": False, "verbose": False})
    shared.update(extra)
    return get_cfg(overrides=shared)
