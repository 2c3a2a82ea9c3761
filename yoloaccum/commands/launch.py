"""`device=0,1,...` outside torchrun: torchrun started with the same settings, one rank per device, and waited for
(train and val)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from yoloaccum.config.devices import cuda_ids
from yoloaccum.distributed.ddp import select_device, visible_devices
from yoloaccum.errors import RanksFailed, UserError
from yoloaccum.training.runs import next_free


def launches_ranks(cfg) -> bool:
    """Whether train() starts torchrun's ranks as other processes: several devices, and not under torchrun already."""
    return len(cuda_ids(cfg.device)) > 1 and "WORLD_SIZE" not in os.environ


def relaunch_on_several_devices(cfg, given: dict[str, Any]) -> Path | None:
    """`train(device="0,1")` outside torchrun: start torchrun with the same settings, one rank per device, in a run
    folder chosen here; returns it once the ranks have finished. Inside torchrun, or on one device, returns None."""
    from yoloaccum.config.settings import is_auto_batch

    if not launches_ranks(cfg):
        return None
    devices = len(cuda_ids(cfg.device))
    if not is_auto_batch(cfg.batch) and cfg.batch % devices:  # checked once here, not in every rank torchrun starts
        raise UserError(f"batch={cfg.batch} does not divide over {devices} devices; use a multiple of {devices}")
    folder = None
    if not cfg.resume:  # the ranks train into the folder named here (rank 0 makes it)
        folder = next_free(Path(cfg.project or "runs/train") / (cfg.name or "exp"), cfg.exist_ok)
        given = {**given, "project": str(folder.parent), "name": folder.name, "exist_ok": True}
    code = launch(given, cfg.device)
    if code:
        raise RanksFailed(code)
    return folder if folder is not None else Path(str(cfg.resume)).parent.parent


def launch(given: dict[str, Any], device: str | None, command: str = "train", env: dict | None = None) -> int:
    """Start torchrun with the settings `given`, one rank per device of `device`, and wait for it; its exit code.

    torchrun runs `python -m yoloaccum COMMAND ...` in each rank; its rendezvous and failure handling are PyTorch's.
    """
    import subprocess
    import sys

    ids = cuda_ids(device)
    select_device(device)  # fail here, once, if the devices are not there
    visible = visible_devices(ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
    env = {**os.environ, **(env or {}), "CUDA_VISIBLE_DEVICES": visible}
    settings = {**given, "device": ",".join(map(str, range(len(ids))))}
    rest = [f"{k}={as_text(v)}" for k, v in settings.items()]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={len(ids)}"]
    cmd = [*torchrun, "-m", "yoloaccum", command, *rest]
    print(f"starting torchrun: {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd, env=env).returncode


def as_text(value: Any) -> str:
    """A setting as key=value text that config.parse_args reads back as the same value."""
    if value is None:
        return ""
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)
