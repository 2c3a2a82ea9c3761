"""Shared test helpers: `run_cli` runs the real `yoloaccum` command line in a subprocess from the repository root,
with the network beyond this machine blocked (tests/offline/sitecustomize.py), and `shapes_yaml` makes small sets."""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
OFFLINE = Path(__file__).resolve().parent / "offline"  # its sitecustomize blocks non-loopback connections
# Inherited settings that would change what the CLI prints: a debug traceback, or torchrun's world size.
_UNSET = ("YOLOACCUM_DEBUG", "WORLD_SIZE")


def offline_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The current environment without debug or torchrun settings, with the network guard on PYTHONPATH."""
    base = {k: v for k, v in os.environ.items() if k not in _UNSET}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(OFFLINE), base.get("PYTHONPATH")]))
    return {**base, **(env or {})}


def _run_cli(
    *args: object, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`python -m yoloaccum *args` with output captured; `env` adds to the current environment."""
    return subprocess.run(
        [sys.executable, "-m", "yoloaccum", *map(str, args)],
        cwd=cwd or REPO,
        env=offline_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess]:
    return _run_cli


def shapes_yaml(folder: Path, num_train: int, num_val: int, imgsz: int = 64, seed: int = 3) -> Path:
    """A small shapes set (generated on first use by yoloaccum), with an absolute root so Ultralytics finds it too."""
    spec = {
        "path": str(folder / "shapes"),
        "train": "images/train",
        "val": "images/val",
        "names": {0: "circle", 1: "square", 2: "triangle", 3: "cross"},
        "yoloaccum_generate": {"num_train": num_train, "num_val": num_val, "imgsz": imgsz, "seed": seed},
    }
    path = folder / "shapes.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
