"""Checkpoints in Ultralytics' layout, so best.pt opens in ultralytics.YOLO; written atomically, loaded safely.

A checkpoint (last.pt) is Ultralytics' dict (a half-precision `ema` model, `train_args`, `epoch`, ...) plus a
`yoloaccum` entry holding what an exact resume needs in plain tensors and numbers: each part's state_dict() (the fp32
model, the EMA, the engine's optimizer and scaler, the training state, every rank's random states). best.pt is
`stripped` of all that.

That entry is the training state, which state.py writes and reads; this module holds files, and reads of the entry
only the weights (model_of) and what best.pt keeps of it (stripped).
"""

from __future__ import annotations

import errno
import io
import os
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from copy import copy, deepcopy
from pathlib import Path
from typing import Any, TextIO

import torch

from yoloaccum.errors import UserError

_UMASK = os.umask(0o022)  # reading the umask means setting it: once, at import, before any thread could write a file
os.umask(_UMASK)
# The disk, not the program: full, over quota, read-only or failing. The user can fix these and resume.
DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS}


def save_atomic(obj: dict[str, Any], *paths: Path) -> None:
    """Serialise once, then write each path atomically: a temporary file in the same folder, fsync, rename. A kill
    leaves the old file or the new one, never a truncated one."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    for path in paths:
        with disk_errors(path):
            write_bytes_atomic(buffer.getvalue(), path)


@contextmanager
def disk_errors(path: Path, trained: bool = False) -> Iterator[None]:
    """A full or failing disk while writing `path`, a file of a run folder (its weights/, logs or pictures), as one
    line: what is kept, and how to go on. `trained`: written after training finished (the final pictures), when
    the weights are complete and there is nothing to resume. Other errors are bugs, and raise as they are."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_ERRORS:
            raise
        weights = path.parent if path.parent.name == "weights" else path.parent / "weights"
        last = weights / "last.pt"
        if trained:
            raise UserError(
                f"writing {path} failed: {e.strerror}; training had finished, and its weights in "
                f"{weights} are complete; free space on that disk"
            ) from e
        if path.suffix == ".pt":
            kept = f"the previous {path.name} is intact" if path.exists() else f"no {path.name} was written"
        else:
            kept = f"{last} holds the last saved epoch" if last.exists() else "no last.pt was written yet"
        hint = f"; resume with: yoloaccum train resume={last}" if last.exists() else ""
        raise UserError(f"writing {path} failed: {e.strerror}; {kept}; free space on that disk{hint}") from e


@contextmanager
def open_in_run(path: Path, mode: str) -> Iterator[TextIO]:
    """A text file of the run folder opened for writing (results.csv, schedule.csv, args.yaml), its disk errors as
    disk_errors says them."""
    with disk_errors(path), _open(path, mode, newline="") as f:
        yield f


def write_bytes_atomic(data: bytes, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; written files follow the umask, as open() would
        with os.fdopen(fd, "wb") as f:
            _write(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX within one filesystem
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write(f: io.BufferedWriter, data: bytes) -> None:
    f.write(data)  # faults.fail_writes replaces this and _open, to fail halfway as a full disk does


_open = open


def ultralytics_model(model: torch.nn.Module) -> torch.nn.Module:
    """A half-precision, criterion-free copy of a model, as Ultralytics stores `ema` for predict and export."""
    copy = deepcopy(model).half().to(memory_format=torch.contiguous_format)
    copy.criterion = None  # training-only state, and it holds our assigner wrappers
    for p in copy.parameters():
        p.requires_grad_(False)
    return copy


def stripped(ckpt: dict[str, Any]) -> dict[str, Any]:
    """A full checkpoint cut down to Ultralytics' stripped layout, as its strip_optimizer leaves best.pt for shipping:
    the half-precision EMA as `model`, its args a plain dict, no optimizer, EMA copy or resume state.

    What is left of ours says where the weights came from; resuming needs last.pt, which keeps everything.
    """
    model = copy(ckpt["ema"])  # a shallow copy: the args change below stays out of the full checkpoint
    model.args = dict(vars(model.args)) if not isinstance(model.args, dict) else model.args
    ours = ckpt["yoloaccum"]
    return {
        **{k: ckpt[k] for k in ("date", "version", "license", "train_args", "train_metrics")},
        "epoch": -1,
        "best_fitness": None,
        "model": model,
        "ema": None,
        "updates": None,
        "optimizer": None,
        "yoloaccum": {
            "config": ours["config"],
            "stripped": True,
            "epochs_done": ours["training"]["position"]["epoch"],
            "fitness": ckpt["best_fitness"],
        },
    }


def load(path: str | Path, trust: bool = False) -> dict[str, Any]:
    """Load a checkpoint with torch.load(weights_only=True) and Ultralytics' allow-list of model classes.

    A file that needs anything else (arbitrary pickled objects can run code when loaded) is refused, unless the user
    vouches for it with trust_weights=True.
    """
    from ultralytics.nn.tasks import torch_safe_load

    path = Path(path)
    if path.is_dir():
        found = [p for p in ("weights/last.pt", "weights/best.pt", "last.pt", "best.pt") if (path / p).is_file()]
        example = f", e.g. {path / found[0]}" if found else ""
        raise UserError(f"{path} is a folder, not a weights file; give the path to a .pt file{example}")
    if not path.is_file():  # checked here: Ultralytics would try to download a missing file by its name
        raise UserError(f"weights file {path} does not exist; give the path to a local .pt file")
    if path.suffix != ".pt":
        raise UserError(f"{path} is not a .pt checkpoint")
    corrupt = f"{path} is not a readable PyTorch checkpoint (truncated or corrupt?); copy it again, or give another .pt"
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut-off copy has no central directory
        raise UserError(corrupt)
    no_model = f"{path} holds no Ultralytics model (no 'ema' or 'model' entry); give a .pt that Ultralytics saved"
    try:
        ckpt, _ = torch_safe_load(str(path), safe_only=not trust)
    except AttributeError as e:  # not a dict: Ultralytics takes it for a saved YOLO object and reads its .model
        if "has no attribute 'model'" not in str(e):
            raise
        raise UserError(no_model) from e
    except TypeError as e:
        if "not a loadable checkpoint" in str(e):
            raise UserError(corrupt) from e
        if trust:
            raise UserError(f"{path} is not a loadable checkpoint: {str(e).splitlines()[0]}") from e
        raise UserError(
            f"{path} needs unsafe unpickling (it references types outside Ultralytics' checkpoint format, which could "
            "run code); if you trust this file, add trust_weights=True"
        ) from e
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("ema") or ckpt.get("model"), torch.nn.Module):
        raise UserError(no_model)
    return ckpt


def model_of(ckpt: dict[str, Any]) -> torch.nn.Module:
    """The fp32 model stored in a checkpoint: our exact weights when present, else Ultralytics' (half) EMA."""
    model = (ckpt.get("ema") or ckpt["model"]).float()
    ours = ckpt.get("yoloaccum", {})
    if state := ours.get("ema"):  # last.pt; format 5 keeps the EMA's state_dict() beside its count of updates
        model.load_state_dict(state["weights"] if ours.get("format", 1) >= 5 else state)
    return model
