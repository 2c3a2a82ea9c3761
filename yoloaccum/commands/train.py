"""`yoloaccum train` (api.train): resolve the run (a resume, torchrun's restart, several devices), train it, and
say where its weights are."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from yoloaccum.commands.launch import launches_ranks, relaunch_on_several_devices
from yoloaccum.commands.result import TrainResult, result_of_folder
from yoloaccum.config.settings import Config, dropped_note, resolve
from yoloaccum.core import schedule as schedule_
from yoloaccum.distributed import ddp as distributed
from yoloaccum.distributed import elastic
from yoloaccum.errors import UserError
from yoloaccum.model import compiler
from yoloaccum.process.memory import frozen_heap
from yoloaccum.training import callbacks as callbacks_
from yoloaccum.training import resume
from yoloaccum.training.trainer import Trainer


def run(cfg: Config, given: dict[str, Any], callbacks: Any = None) -> TrainResult:
    """api.train's work: train `cfg`, resolved from the keys `given` (or the run they resume), and say where the
    weights are. With several devices outside torchrun, torchrun runs the ranks and this process waits.
    `callbacks`: train(callbacks=...)'s, a dict of Ultralytics' events or a Python file (training/callbacks.py)."""
    source = callbacks if isinstance(callbacks, str | Path) else None
    callbacks = callbacks_.from_file(source) if source else callbacks_.checked(callbacks)
    ckpt, path = None, None
    if not cfg.resume and (folder := elastic.restarted_run(cfg.project)) is not None:
        given = elastic_continuation(folder, given)
        cfg = resolve(overrides=given)
    if cfg.resume:
        cfg, ckpt, path = resume.load(cfg, given)
    if cfg.data is None:
        raise UserError("train needs a dataset: give data=path/to/dataset.yaml (e.g. data=datasets/shapes.yaml)")
    if cfg.rect:
        raise UserError(
            "rect=True trains on batches of similar aspect ratio in a fixed order, which yoloaccum does not do: its "
            "training batches are shuffled by seed and mosaicked, and its validation batches are rectangular "
            "already; remove rect"
        )
    cfg = cfg.replace(device=distributed.resolve_device(cfg.device))  # empty: the first GPU where there is one
    compiler.check(cfg)
    schedule_.check_precise_bn(cfg)  # before any folder, model or rank: the schedule checks it again, for plan
    schedule_.check_bn_adapt(cfg)
    if callbacks and not source and launches_ranks(cfg):
        raise UserError(
            f"callbacks= as functions cannot reach the ranks that device={cfg.device} starts, each a new process; "
            "give them as a file (callbacks=my_callbacks.py), or run your script under torchrun"
        )
    if source:
        given = {**given, "callbacks": str(source)}  # the ranks torchrun starts load the same file
    if (folder := relaunch_on_several_devices(cfg, given)) is not None:  # device=0,1,... outside torchrun
        return result_of_folder(folder)
    if int(os.environ.get("RANK", "0")) == 0:
        if ckpt is not None and (note := resume.extension_note(ckpt["yoloaccum"], cfg)):
            print(note, flush=True)
        if note := dropped_note(cfg):
            print(note, flush=True)
    # From here to the end, the objects alive (the modules, then the model, data and EMA) are hidden from the garbage
    # collector: a full collection would walk them all, about 0.1 s each time (process/memory.py)
    with frozen_heap():
        trainer = Trainer.from_config(cfg, ckpt, path, callbacks)
        try:
            metrics = trainer.train()
            run = trainer.parts.run
            report = None
            if run is not None:
                trainer.plot_schedule()

                def time_lines() -> list[str]:
                    nonlocal report
                    trainer.parts.engine.timer.lap("plots")  # results.png, schedule.png, the final table
                    report = trainer.time_report()
                    return report.lines()

                run.finish(trainer.parts.evaluator, cfg, time_lines)
                trainer.events.at_the_end()  # after results.png, which the trackers upload
            return TrainResult(
                metrics, run.path if run else None, report.split if report else {}, report.verdict if report else ""
            )
        except BaseException:
            if trainer.parts.run is not None:
                trainer.parts.run.discard_if_empty()
            raise
        finally:
            try:
                teardown(trainer)
            finally:
                distributed.cleanup()


def teardown(trainer: Trainer) -> None:
    """The teardown event, however the run ended (a tracker closes its run there). A teardown that fails while the run
    is failing already says so in a line, and the run's own error goes on."""
    failing = sys.exc_info()[1] is not None
    try:
        trainer.events.run("teardown")
    except Exception as e:
        if not failing:
            raise
        print(f"warning: a teardown callback failed too: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def elastic_continuation(folder: Path, given: dict[str, Any]) -> dict[str, Any]:
    """The settings of a job torchrun restarted: resume from its run's last.pt, or, where the first attempt wrote
    none, train again from the start in the same folder."""
    last = folder / "weights/last.pt"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if int(os.environ.get("RANK", "0")) == 0:
        went_on = f"resuming from {last}" if last.exists() else f"starting again in {folder} (no last.pt yet)"
        print(f"torchrun restarted this job (restart {restart}): {went_on}", flush=True)
    if last.exists():
        return {**given, "resume": str(last)}
    return {**given, "project": str(folder.parent), "name": folder.name, "exist_ok": True}
