"""Resuming a run: find its last.pt and reconcile the arguments with the saved ones (state.py restores the rest).

A resumed run is the run it was: the schedule-changing arguments (batch, nbs and every other training setting) are
refused when they differ from the saved ones. Only settings that cannot change the result are taken from the command
line, and epochs, which continues a finished or interrupted run to a new length (the lr decay is rebuilt for it).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from yoloaccum.config.settings import Config, schema
from yoloaccum.core import schedule
from yoloaccum.core.schedule import Schedule
from yoloaccum.errors import UserError
from yoloaccum.model import checkpoint
from yoloaccum.training import state as state_

# Settings that may change on resume: where and how fast it runs, and what it prints, never what it computes.
MAY_CHANGE = {
    "resume",
    "workers",
    "ddp_timeout",
    "device",
    "verbose",
    "log_every",
    "plots",
    "tensorboard",
    "trust_weights",
    "cache",
    "save_period",
    "grad_checkpointing",  # the same gradients, recomputed: a run that ran out of memory may resume with it
    "compile",  # the same model, compiled: equal to float rounding, as after a change of device
    "project",
    "name",
    "exist_ok",
    "time",  # a new budget for the time left: epochs are re-estimated from it, as Ultralytics does
    "save_minutes",
}  # project and name only find the run for resume=True

# Keys added with a default that changes what a run computes: the value that reproduces a run saved before them.
BEFORE_THE_KEY = {"mosaic_buffer": "batch"}


def find_last(project: str | None) -> Path:
    """resume=True: the most recently written weights/last.pt under the project folder."""
    root = Path(project or "runs/train")
    candidates = sorted(root.glob("*/weights/last.pt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise UserError(f"resume=True found no */weights/last.pt under {root}; give resume=path/to/last.pt")
    return candidates[-1]


def load(cfg: Config, given_keys: Iterable[str]) -> tuple[Config, dict[str, Any], Path]:
    """The saved run's config (with the allowed changes), its checkpoint (its training state read by
    state.read, in the current format), and the checkpoint's path. `given_keys`: the keys the user gave (their
    values are cfg's), which are checked against the saved ones."""
    path = find_last(cfg.project) if cfg.resume is True else Path(str(cfg.resume))
    ckpt = checkpoint.load(path, cfg.trust_weights)
    state = ckpt["yoloaccum"] = state_.read(ckpt, path)
    saved, given = state["config"], {k: cfg[k] for k in given_keys if k in cfg}
    run, done = path.parent.parent, state["training"]["position"]["epoch"]
    # time= sets the epochs from the time left, re-estimated after each epoch: the schedule holds the last estimate,
    # the config the epochs= it was given (which Ultralytics' loss reads)
    planned = (state.get("schedule") or saved)["epochs"]
    timed = given["time"] if "time" in given else saved.get("time")
    epochs = given.get("epochs", saved["epochs"])
    if timed and epochs != saved["epochs"]:
        raise UserError(
            f"epochs={epochs} has no effect with time={timed:g}, which sets the epochs from the time left; to train "
            f"the run in {run} to {epochs} epochs, add time=None"
        )
    extend = not timed and "epochs" in given and epochs != planned
    if extend and epochs <= done:
        raise UserError(
            f"epochs={epochs}: the run in {run} has done {done} epochs; to continue it, give epochs greater than {done}"
        )
    if state.get("finished") and not extend:
        held, untimed = (f" in time={saved['time']:g} hours", " time=None") if saved.get("time") else ("", "")
        raise UserError(
            f"the run in {run} has finished ({done} epochs{held}); to train it further, give epochs=N{untimed} with N "
            f"greater than {done}, e.g. resume={path} epochs={done + max(done // 2, 1)}{untimed}"
        )
    # keys newer than the run: the value it trained with in effect (their default, or how yoloaccum worked before)
    added = {k.name: BEFORE_THE_KEY.get(k.name, k.default) for k in schema().values() if k.name not in saved}
    for key, value in given.items():
        was = saved.get(key, added.get(key))
        if key not in MAY_CHANGE and key != "epochs" and key in {**saved, **added} and value != was:
            raise UserError(
                f"resume continues the run as planned, but {key}={value} differs from its {key}={was}: the "
                f"epochs already done were computed with {key}={was}, and only epochs= may change on resume; "
                f"drop {key}= to resume, or start a new run with pretrained={path}"
            )
    changes = {k: v for k, v in given.items() if k in MAY_CHANGE or k == "epochs"}
    resumed = Config({**added, **saved}).replace(**{**changes, "resume": str(path)})
    if schedule.precise_bn_conflicts(resumed):
        # saved before bn=frozen refused a recompute (schedule.check_precise_bn): it goes on without one. The
        # recompute writes only the EMA's statistics, so training is the same; validation reads what training left.
        resumed = resumed.replace(precise_bn=0)
    return resumed, ckpt, path


def resumed_schedule(state: dict[str, Any], built: Schedule, nc: int, follow_epochs: bool = True) -> Schedule:
    """The schedule a resumed run follows: the one it began with (optimizer=auto's choice, lr0, warmup), on this run's
    devices, and with the lr decay rebuilt when epochs changed. `built` is the schedule of the resumed config.
    follow_epochs=False (time=): the epochs the run had, which the trainer re-estimates from the time left."""
    if saved := state.get("schedule"):
        planned = Schedule(**{**saved, "num_images": built.num_images, "world_size": built.world_size})
    else:  # a checkpoint from before schedules were saved: its config gives the schedule it began with
        planned = schedule.build(Config(state["config"]), built.num_images, built.world_size, nc)
    if built.epochs == planned.epochs or not follow_epochs:
        return planned
    return schedule.extend(planned, built.epochs)


def extension_note(state: dict[str, Any], cfg: Config) -> str | None:
    """What continuing to cfg.epochs does, in Ultralytics' terms; None when epochs is as saved, or set by time=."""
    saved = state.get("schedule") or state["config"]
    planned, epochs, done, close = saved["epochs"], cfg.epochs, state["training"]["position"]["epoch"], cfg.close_mosaic
    if epochs == planned or cfg.time:
        return None
    decay = "cosine" if cfg.cos_lr else "linear"
    note = (
        f"continuing the run to {epochs} epochs (planned {planned}, {done} done): the lr schedule is rebuilt for "
        f"{epochs} epochs, so from epoch {done + 1} on the lr follows the {epochs}-epoch {decay} decay to "
        f"lr0 x lrf at epoch {epochs}"
    )
    if close:
        first_closed = max(epochs - close, 0) + 1
        mosaic = f"; mosaic is on for epochs {done + 1}-{first_closed - 1}" if done + 1 < first_closed else ""
        note += f"; close_mosaic={close} now turns mosaic off from epoch {first_closed} of {epochs}{mosaic}"
    warmup = min(saved["warmup_epochs"], max(planned - 1, 0))
    if warmup:
        note += f"; warmup ({warmup:g} epochs) is " + ("already done" if done >= warmup else "kept as planned")
    return note
