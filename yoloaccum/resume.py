"""Resuming a run: find its last.pt, reconcile the arguments, and capture or restore the RNG states.

A resumed run is the run it was: the schedule-changing arguments (batch, nbs, epochs and every other training
setting) are refused when they differ from the saved ones. Only settings that cannot change the result are taken
from the command line.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from yoloaccum import checkpoint
from yoloaccum.config import Config, parse_args
from yoloaccum.errors import UserError

# Settings that may change on resume: where and how fast it runs, and what it prints, never what it computes.
MAY_CHANGE = {
    "resume",
    "workers",
    "ddp_timeout",
    "device",
    "verbose",
    "log_every",
    "plots",
    "trust_weights",
    "cache",
    "save_period",
    "project",
    "name",
    "exist_ok",
}  # fmt: skip  (project/name only find the run for resume=True)


def find_last(project: str | None) -> Path:
    """resume=True: the most recently written weights/last.pt under the project folder."""
    root = Path(project or "runs/train")
    candidates = sorted(root.glob("*/weights/last.pt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise UserError(f"resume=True found no */weights/last.pt under {root}; give resume=path/to/last.pt")
    return candidates[-1]


def load(cfg: Config, args: list[str]) -> tuple[Config, dict[str, Any], Path]:
    """The saved run's config (with the allowed changes), its checkpoint, and the checkpoint's path."""
    path = find_last(cfg.project) if cfg.resume is True else Path(str(cfg.resume))
    ckpt = checkpoint.load(path, cfg.trust_weights)
    state = ckpt.get("yoloaccum")
    if not state or "position" not in state:
        raise UserError(f"{path} was not written by yoloaccum train; start a new run with pretrained={path}")
    if state.get("finished"):
        raise UserError(f"the run in {path.parent.parent} has finished all its epochs; there is nothing to resume")
    saved, given = state["config"], parse_args(args)
    given.pop("cfg", None)
    for key, value in given.items():
        if key not in MAY_CHANGE and key in saved and value != saved[key]:
            raise UserError(
                f"resume continues the run as planned, but {key}={value} differs from its {key}={saved[key]}; "
                f"drop {key}= to resume, or start a new run with pretrained={path}"
            )
    changes = {k: v for k, v in given.items() if k in MAY_CHANGE}
    return Config(saved).replace(**{**changes, "resume": str(path)}), ckpt, path


def rng_state(loader_generator: torch.Generator | None) -> dict[str, Any]:
    """Every random state that training consumes, in types that torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,  # this process's device only
        "loader": loader_generator.get_state() if loader_generator is not None else None,
    }


def restore_rng(state: dict[str, Any], loader_generator: torch.Generator | None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if loader_generator is not None and state["loader"] is not None:
        loader_generator.set_state(state["loader"])


def restore_mosaic_buffer(dataset, indices: list[int]) -> None:
    """Mosaic draws its partner images from the indices of recently loaded images; load them again, in order.

    With workers=0 the buffer lives in this process, so restoring it makes the resumed run's mosaics the ones the
    uninterrupted run would have made. (With workers > 0 each worker keeps its own buffer, which is not saved.)
    """
    if not hasattr(dataset, "buffer"):
        return
    dataset.buffer.clear()
    for i in indices:
        dataset.load_image(i)  # appends i to the buffer, as the first load did
