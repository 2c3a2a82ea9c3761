"""The training state in last.pt: its one writer (`of`) and its one reader (`read`, then `restore`).

A checkpoint (last.pt) is Ultralytics' dict (a half-precision `ema` model, `train_args`, `epoch`, ...), so that it
opens in ultralytics.YOLO, plus a `yoloaccum` entry holding what an exact resume needs in plain tensors and numbers:
the fp32 model and EMA weights, the optimizer, scaler, schedule, position, early-stopping state, and each rank's own
state (random states, mosaic buffer, its part of an open window, its out-of-memory back-offs).

The entry is versioned by its `format` (FORMAT):
- format 1: last.pt files written before the entry carried a version; the layout of format 2, converted on reading;
- format 2: adds `format` itself;
- format 3: no rank holds bn=window's queues (bn=window now takes each window's statistics from its own images);
  a format-2 file of a bn=window run is refused, as it trained with the queues; any other converts unchanged;
- format 4: adds `bn`, the BatchNorm mode in force (bn=auto resolved), which a resumed run keeps whatever its devices
  and whatever bn=auto takes today (for a while bn=auto of a run from trained weights took bn=batch at any
  micro-batch); an earlier file's is the mode its bn=auto chose then, by micro-batch alone;
- before format 1, one set of random states for all ranks (no `ranks`): refused, as nothing can rebuild the others.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from yoloaccum.core.schedule import bn_mode
from yoloaccum.errors import UserError
from yoloaccum.model import checkpoint
from yoloaccum.process.rng import restore_rng, rng_state

if TYPE_CHECKING:
    from yoloaccum.training.epoch_end import Run

FORMAT = 4  # the training state's layout, written into every last.pt (the module docstring lists the formats)


def of(t: Run, position: tuple[int, int], finished: bool = False, interrupted: bool = False) -> dict[str, Any]:
    """The checkpoint of trainer `t` at `position` (epoch, micro-batches of it done): Ultralytics' entries for predict
    and export, and ours for an exact resume. `t.rank_states` holds every rank's own state, gathered to rank 0."""
    from yoloaccum.config.ultra import VERSION, ultralytics_args

    t.ema.update_attr(t.raw_model, include=["yaml", "nc", "args", "names", "stride"])
    training = {**t.state.state_dict(), "position": {"epoch": position[0], "batch": position[1]}}
    return {
        "epoch": position[0] - 1,  # Ultralytics: the last completed epoch
        "best_fitness": training["best_fitness"],
        "model": None,
        "ema": checkpoint.ultralytics_model(t.ema.ema),
        "updates": t.ema.updates,
        "optimizer": None,  # kept in full precision under "yoloaccum" for an exact resume
        "train_args": vars(ultralytics_args(t.cfg)),
        "train_metrics": training["metrics"],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "version": VERSION,
        "license": "AGPL-3.0",
        "yoloaccum": {
            "format": FORMAT,
            "config": dict(t.cfg),
            "schedule": dataclasses.asdict(t.schedule),  # as resolved (auto's choice): an extension keeps it
            "position": training["position"],
            "bn": t.bn,
            "finished": finished,
            "interrupted": interrupted,
            "model": t.raw_model.state_dict(),
            "ema": t.ema.ema.state_dict(),
            "optimizer": t.engine.optimizer.state_dict(),
            "scaler": t.engine.scaler.state_dict(),
            "stopper": training["stopper"],
            "skipped_windows": list(t.engine.skipped),
            "ranks": [rank_state(t), *t.rank_states[1:]],  # rank 0's as of now, after validation
        },
    }


def rank_state(t: Run) -> dict[str, Any]:
    """What each rank holds apart from the others: random states, mosaic buffer, the engine's own (its part of an
    open window, and the iterations where it ran out of memory)."""
    return {
        "rng": rng_state(t.loader.generator),
        **t.engine.state_dict(),
        "mosaic_buffer": list(getattr(t.train_set, "buffer", [])),
    }


def read(ckpt: dict[str, Any], path: Path) -> dict[str, Any]:
    """The training state of a loaded last.pt (its `yoloaccum` entry) in the current FORMAT; a file that holds none,
    or one this version cannot read, is refused with one line that says what to do instead."""
    state = ckpt.get("yoloaccum")
    if state and state.get("stripped"):
        raise UserError(
            f"{path} holds only the weights (best.pt is stripped for shipping); resume from "
            f"{path.parent / 'last.pt'}, or start a new run with pretrained={path}"
        )
    version = state.get("format", 1) if isinstance(state, dict) else None
    if version is not None and (not isinstance(version, int) or version > FORMAT):  # before the layout: it may differ
        raise UserError(
            f"{path} holds a training state of format {version}, newer than this yoloaccum reads "
            f"(up to {FORMAT}); resume with the yoloaccum that wrote it, or start a new run with "
            f"pretrained={path}"
        )
    if not state or "position" not in state:
        raise UserError(f"{path} was not written by yoloaccum train; start a new run with pretrained={path}")
    if "ranks" not in state:
        raise UserError(
            f"{path} was written by an earlier yoloaccum, which kept one set of random states for all ranks; finish "
            f"it with that version, or start a new run with pretrained={path}"
        )
    if version < 3 and state.get("config", {}).get("bn") == "window":
        raise UserError(
            f"{path} trained with bn=window's earlier queue of past micro-batches' statistics, which this "
            "yoloaccum replaced by each window's own statistics; finish it with the yoloaccum that wrote "
            f"it, or start a new run with pretrained={path}"
        )
    if version < 4:
        state = {**state, "bn": _bn_before_format_4(state)}
    return {**state, "format": FORMAT}  # formats 1 to 3 have format 4's layout, less `bn`


def _bn_before_format_4(state: dict[str, Any]) -> str:
    """The BatchNorm mode a run saved before format 4 trained with: bn=auto chose by micro-batch per device alone."""
    bn = state.get("config", {}).get("bn", "auto")
    if bn != "auto":
        return bn
    if saved := state.get("schedule"):
        micro = saved["batch"] // saved["world_size"]
    else:  # before schedules were saved: the batch given, over the ranks saved
        micro = state["config"]["batch"] // max(len(state["ranks"]), 1)
    return bn_mode(bn, micro)


def restore(t: Run, ckpt: dict[str, Any]) -> None:
    """Continue trainer `t` from a checkpoint written by of() and read by read(): weights, optimizer, EMA, scaler,
    early stopping, position, the logs cut back to it, and this rank's own state."""
    state = ckpt["yoloaccum"]
    t.raw_model.load_state_dict(state["model"])
    t.ema.ema.load_state_dict(state["ema"])
    t.ema.updates = ckpt["updates"]
    t.engine.optimizer.load_state_dict(state["optimizer"])
    if (note := load_scaler_state(t.engine.scaler, state["scaler"])) and t.run is not None:
        t.run.console.print(note)
    t.state.load_state_dict({**state, "best_fitness": ckpt["best_fitness"], "metrics": ckpt.get("train_metrics")})
    t.engine.skipped = list(state["skipped_windows"])
    epoch, batch = t.state.position
    for _ in range(epoch):  # E2ELoss decays its one-to-many gain once per finished epoch
        t.loss.end_epoch()
    if t.run is not None:
        t.run.results.truncate(epoch)
        t.steps.truncate(epoch * t.schedule.batches_per_epoch + batch)
        t.run.console.print(f"resuming {t.run.path} at epoch {epoch + 1}, micro-batch {batch}")
    _restore_rank(t, state["ranks"])


def _restore_rank(t: Run, ranks: list[dict[str, Any]]) -> None:
    """This rank's own state. On another number of ranks the weights, optimizer, image order and any open window
    continue exactly; the augmentation draws cannot, since each rank now sees other images."""
    rank, same = t.ctx.rank, len(ranks) == t.ctx.world_size
    if not same and t.run is not None:
        t.run.console.print(
            f"resuming {len(ranks)} rank(s) on {t.ctx.world_size}: the weights, optimizer, image "
            "order and schedule continue exactly; augmentation draws differ from the uninterrupted "
            "run"
        )
    mine = ranks[rank] if rank < len(ranks) else None
    window = mine["open_window"] if same else None
    if not same and rank == 0:  # the saved ranks' window, summed, goes to rank 0: the all-reduce sums it with the rest
        window = merge_windows([r["open_window"] for r in ranks])
    t.engine.load_state_dict({"open_window": window, "back_offs": mine["back_offs"] if mine else []})
    if mine is not None:
        restore_mosaic_buffer(t.train_set, mine["mosaic_buffer"])
        restore_rng(mine["rng"], t.loader.generator)  # last: building the run consumed random numbers


def load_scaler_state(scaler: torch.amp.GradScaler, state: dict[str, Any]) -> str | None:
    """Load last.pt's GradScaler state into `scaler`, across AMP settings; returns a line saying what changed, if
    anything. A run saved without AMP (every CPU run) holds an empty state, which GradScaler.load_state_dict refuses:
    resumed with AMP, its scale starts where GradScaler starts. A run saved with AMP and resumed without drops it."""
    if not scaler.is_enabled():
        return "resuming without AMP: the saved loss scale is not used" if state else None
    if not state:
        return f"resuming with AMP a run that trained without it: the loss scale starts at {scaler.get_scale():g}"
    scaler.load_state_dict(state)
    return None


def merge_windows(windows: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The open window of several ranks as one rank's (resuming on another number of ranks): gradients and counts
    summed, which the window's all-reduce would have done; BatchNorm buffers of the first."""
    windows = [w for w in windows if w is not None]
    if not windows:
        return None
    grads = [None if gs[0] is None else sum(gs) for gs in zip(*(w["grads"] for w in windows))]
    counts = sum(w["counts"] for w in windows)
    return {**windows[0], "grads": grads, "counts": counts}


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
