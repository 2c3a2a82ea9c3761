"""The training state in last.pt: what each part of a run gives by its state_dict(), by name (`of`), read back in
the current format (`read`) and put back into the parts (`restore`).

A checkpoint (last.pt) is Ultralytics' dict (a half-precision `ema` model, `train_args`, `epoch`, ...), so that it
opens in ultralytics.YOLO, derived from ours in one place (`ultralytics_entries`), plus a `yoloaccum` entry holding
what an exact resume needs in plain tensors and numbers: `{part: part.state_dict()}` for the training state
(position, early stopping, the best fitness, the last metrics), the model, the EMA, the engine (optimizer, loss
scale, skipped windows and their streak) and each rank's own state (random states, mosaic buffer, its part of an open
window, its out-of-memory back-offs), beside the run's config, schedule and BatchNorm mode.

The entry is versioned by its `format` (FORMAT):
- format 1: last.pt files written before the entry carried a version; the layout of format 2, converted on reading;
- format 2: adds `format` itself;
- format 3: no rank holds bn=window's queues (bn=window now takes each window's statistics from its own images);
  a format-2 file of a bn=window run is refused, as it trained with the queues; any other converts unchanged;
- format 4: adds `bn`, the BatchNorm mode in force (bn=auto resolved), which a resumed run keeps whatever its devices
  and whatever bn=auto takes today (for a while bn=auto of a run from trained weights took bn=batch at any
  micro-batch); an earlier file's is the mode its bn=auto chose then, by micro-batch alone;
- format 5: each part's state_dict() under its name, where formats 1 to 4 kept the parts' fields side by side (and the
  best fitness, metrics and EMA updates only in Ultralytics' entries); adds the engine's streak of skipped windows,
  which an earlier file's resume starts at 0, as it did;
- before format 1, one set of random states for all ranks (no `ranks`): refused, as nothing can rebuild the others.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yoloaccum.core.schedule import bn_mode
from yoloaccum.errors import UserError
from yoloaccum.model import checkpoint
from yoloaccum.process.rng import restore_rng, rng_state

if TYPE_CHECKING:
    from yoloaccum.training.parts import Parts
    from yoloaccum.training.training_state import TrainingState

FORMAT = 5  # the training state's layout, written into every last.pt (the module docstring lists the formats)


def of(
    parts: Parts,
    training: TrainingState,
    ranks: list[dict[str, Any]],
    finished: bool = False,
    interrupted: bool = False,
) -> dict[str, Any]:
    """The checkpoint of a run's parts at the training state's position: each part's state_dict() by name, and
    Ultralytics' entries for predict and export. `ranks` holds every rank's rank_state(), gathered to rank 0."""
    parts.ema.update_attr(parts.raw_model, include=["yaml", "nc", "args", "names", "stride"])
    ours = {
        "format": FORMAT,
        "config": dict(parts.cfg),
        "schedule": dataclasses.asdict(parts.schedule),  # as resolved (auto's choice): an extension keeps it
        "bn": parts.bn,
        "finished": finished,
        "interrupted": interrupted,
        "training": training.state_dict(),
        "model": parts.raw_model.state_dict(),
        "ema": parts.ema.state_dict(),
        "engine": parts.engine.state_dict(),
        "ranks": ranks,
    }
    return {**ultralytics_entries(ours, parts), "yoloaccum": ours}


def ultralytics_entries(ours: dict[str, Any], parts: Parts) -> dict[str, Any]:
    """Ultralytics' top-level keys of a checkpoint, from our entry: what ultralytics.YOLO reads to predict, export or
    report on the weights. The weights are the EMA's in half precision; the optimizer is ours, in full precision."""
    from yoloaccum.config.ultra import VERSION, ultralytics_args

    training = ours["training"]
    return {
        "epoch": training["position"]["epoch"] - 1,  # Ultralytics: the last completed epoch
        "best_fitness": training["best_fitness"],
        "model": None,
        "ema": checkpoint.ultralytics_model(parts.ema.ema),
        "updates": ours["ema"]["updates"],
        "optimizer": None,  # kept in full precision under "yoloaccum" for an exact resume
        "train_args": vars(ultralytics_args(parts.cfg)),
        "train_metrics": training["metrics"],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "version": VERSION,
        "license": "AGPL-3.0",
    }


def rank_state(parts: Parts) -> dict[str, Any]:
    """What each rank holds apart from the others: random states (its loader's included), mosaic buffer, and the
    engine's own (its part of an open window, and the iterations where it ran out of memory)."""
    return {
        "rng": rng_state(parts.loader.generator),
        "mosaic_buffer": list(getattr(parts.train_set, "buffer", [])),
        "engine": parts.engine.rank_state_dict(),
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
    if not state or ("position" not in state and "training" not in state):
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
    if version < 5:
        state = _by_part(ckpt, state)
    return {**state, "format": FORMAT}


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


def _by_part(ckpt: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """A format 1-4 entry (the parts' fields side by side, with `bn`) in format 5's layout: each part's state by name.
    The best fitness, metrics and EMA updates were kept only in Ultralytics' entries; the streak of skipped windows
    was not kept, and its resume started it at 0."""
    kept = ("config", "schedule", "bn", "finished", "interrupted")
    return {
        **{k: state[k] for k in kept if k in state},
        "training": {
            "position": state["position"],
            "stopper": state["stopper"],
            "best_fitness": ckpt["best_fitness"],
            "metrics": ckpt.get("train_metrics") or {},
        },
        "model": state["model"],
        "ema": {"weights": state["ema"], "updates": ckpt["updates"]},
        "engine": {
            "optimizer": state["optimizer"],
            "scaler": state["scaler"],
            "skipped_windows": state["skipped_windows"],
            "skipped_in_a_row": 0,
        },
        "ranks": [
            {
                "rng": r["rng"],
                "mosaic_buffer": r["mosaic_buffer"],
                "engine": {"open_window": r.get("open_window"), "back_offs": r.get("back_offs", [])},
            }
            for r in state["ranks"]
        ],
    }


def restore(parts: Parts, training: TrainingState, ckpt: dict[str, Any]) -> None:
    """Put a checkpoint written by of() and read by read() back into a run's parts and its training state: weights,
    EMA, engine (optimizer, scaler, skipped windows), position and early stopping, and this rank's own state."""
    state = ckpt["yoloaccum"]
    parts.raw_model.load_state_dict(state["model"])
    parts.ema.load_state_dict(state["ema"])
    parts.engine.load_state_dict(state["engine"])
    training.load_state_dict(state["training"])
    for _ in range(training.position[0]):  # E2ELoss decays its one-to-many gain once per finished epoch
        parts.loss.end_epoch()
    _restore_rank(parts, state["ranks"])


def _restore_rank(parts: Parts, ranks: list[dict[str, Any]]) -> None:
    """This rank's own state. On another number of ranks the weights, optimizer, image order and any open window
    continue exactly; the augmentation draws cannot, since each rank now sees other images."""
    rank, same = parts.ctx.rank, len(ranks) == parts.ctx.world_size
    if not same and parts.run is not None:
        parts.run.console.print(
            f"resuming {len(ranks)} rank(s) on {parts.ctx.world_size}: the weights, optimizer, image "
            "order and schedule continue exactly; augmentation draws differ from the uninterrupted "
            "run"
        )
    mine = ranks[rank] if rank < len(ranks) else None
    window = mine["engine"]["open_window"] if same else None
    if not same and rank == 0:  # the saved ranks' window, summed, goes to rank 0: the all-reduce sums it with the rest
        window = merge_windows([r["engine"]["open_window"] for r in ranks])
    parts.engine.load_rank_state_dict({"open_window": window, "back_offs": mine["engine"]["back_offs"] if mine else []})
    if mine is not None:
        restore_mosaic_buffer(parts.train_set, mine["mosaic_buffer"])
        restore_rng(mine["rng"], parts.loader.generator)  # last: building the run consumed random numbers


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
