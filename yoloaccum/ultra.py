"""The one door to ultralytics: make it offline and quiet before it is imported, and translate our config to its args.

Ultralytics downloads fonts, weights and datasets, sends analytics and pip-installs missing packages by default.
yoloaccum never does any of that: these switches are set in-process before the first `import ultralytics`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("YOLO_OFFLINE", "1")  # is_online() -> False: no analytics, no hub, no update checks
os.environ.setdefault("YOLO_AUTOINSTALL", "false")  # never pip-install a missing requirement at run time
os.environ.setdefault("YOLO_VERBOSE", "false")  # yoloaccum prints its own progress

import ultralytics  # noqa: E402
from ultralytics.cfg import get_cfg  # noqa: E402
from ultralytics.utils import checks, plotting  # noqa: E402

from yoloaccum.config import Config, ultralytics_defaults  # noqa: E402

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
