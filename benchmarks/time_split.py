"""Where the time goes: yoloaccum against `yolo train` on equal threads, each run's time split; and the split's cost.

    python benchmarks/time_split.py              # part of make bench: benchmarks/time_split.{md,json}
    python benchmarks/time_split.py --repeats 7
    python benchmarks/time_split.py --smoke      # one tiny run of each part, into a temp folder (make test runs it)

Equal threads: both trainers on one torch thread (OMP_NUM_THREADS=1; Ultralytics' trainer holds itself to one thread on
a 2-core CPU anyway), on a held-out shapes set (256 training images at 160 px, generator seed 1), batch 8, nbs 64, 3
epochs, validation, plots and precise_bn off: the engines alone. Each repeat runs both, each in a fresh process, the
order alternating; the ratio is taken within a repeat and the report gives the median. Whole process: `yoloaccum train`
against `yolo train`, each run by its console entry point (cli.run, ultralytics.cfg.entrypoint) in a process of its own,
from its start to its exit, as a shell runs them. The split: yoloaccum's own (TrainResult.time_split, core/timing.py);
Ultralytics' from its callbacks and its trainer's methods timed from outside (on_train_batch_start ends the wait for
data, preprocess_batch moves the batch, optimizer_step is the step, validate and save_model their phases), so both name
the same phases; "startup" is the rest of the whole process (imports, building the model and data, exiting).

The split's cost: one process trains 9 epochs of the same set with the split on and off in alternate epochs (a step
added to the trainer swaps the engine's timer) and compares each off epoch's training seconds with the mean of the on
epochs either side of it; and, below the machine's noise, a lap's own time in a loop of 100,000, times the laps of an
epoch, over the epoch's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import REPO, TINY_MODEL, shapes_data  # noqa: E402

SETTINGS = {"model": "yolo26n.yaml", "imgsz": 160, "batch": 8, "nbs": 64, "epochs": 3, "val": False, "plots": False}
HELD_OUT = {"num_train": 256, "num_val": 64, "imgsz": 160, "seed": 1}
SMOKE = {"model": TINY_MODEL, "imgsz": 64, "batch": 4, "nbs": 8, "epochs": 1, "val": False, "plots": False}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PHASES = ("startup", "data", "to_device", "forward_backward", "bn_window", "step", "validation", "save", "other")


def yoloaccum_child(data: str, project: str, settings: str, out: str) -> None:
    """In a fresh process: `yoloaccum train`, as the shell runs it (its console entry point, exit included); the
    TrainResult its command returns gives the split, written to `out`."""
    from yoloaccum.commands import train as command

    run = command.run

    def kept(*args, **kwargs):
        result = run(*args, **kwargs)
        Path(out).write_text(json.dumps(result.time_split))
        return result

    command.run = kept
    keys = {"data": data, "project": project, "name": "run", "precise_bn": 0, **json.loads(settings)}
    sys.argv = ["yoloaccum", "train", *(f"{k}={v}" for k, v in keys.items())]
    from yoloaccum.cli import run as yoloaccum

    yoloaccum()


def ultralytics_child(data: str, project: str, settings: str, out: str) -> None:
    """In a fresh process: `yolo train`, as the shell runs it (its console entry point), timed by its callbacks and
    its trainer's own methods into the same phases. The callbacks go into Ultralytics' defaults, which every model the
    command makes copies."""
    keys = {"data": data, "project": project, "name": "run", **json.loads(settings)}
    sys.argv[:] = ["yolo", "train", *(f"{k}={v}" for k, v in keys.items())]  # in place: Ultralytics' ARGV is this list
    import yoloaccum.config.ultra  # noqa: F401, I001  (first: offline, nothing reaches the network)
    from ultralytics.cfg import entrypoint
    from ultralytics.utils.callbacks.base import default_callbacks

    split: dict[str, float] = defaultdict(float)
    last = [0.0]

    def lap(phase: str) -> None:
        now = time.perf_counter()
        if last[0]:
            split[phase] += now - last[0]
        last[0] = now

    def timed(trainer, name: str, before: str, phase: str) -> None:
        method = getattr(trainer, name)

        def run(*args, **kwargs):
            lap(before)
            try:
                return method(*args, **kwargs)
            finally:
                lap(phase)

        setattr(trainer, name, run)

    def instrument(trainer) -> None:  # on_pretrain_routine_end: the trainer's methods are bound by then
        timed(trainer, "preprocess_batch", "data", "to_device")
        timed(trainer, "optimizer_step", "forward_backward", "step")
        timed(trainer, "validate", "other", "validation")
        timed(trainer, "save_model", "other", "save")

    def written(trainer) -> None:  # on_train_end: the final validation of best.pt
        lap("validation")
        split.pop("startup", None)  # before training: counted as the process's rest, as for yoloaccum
        Path(out).write_text(json.dumps(split))

    default_callbacks["on_pretrain_routine_end"].append(instrument)
    default_callbacks["on_train_start"].append(lambda trainer: lap("startup"))
    default_callbacks["on_train_batch_start"].append(lambda trainer: lap("data"))
    default_callbacks["on_train_batch_end"].append(lambda trainer: lap("forward_backward"))
    default_callbacks["on_train_end"].append(written)
    entrypoint()


def one_run(trainer: str, data: Path, settings: dict, folder: Path) -> dict:
    out = folder / f"{trainer}.json"
    command = [
        sys.executable,
        "-c",
        f"import sys; sys.path.insert(0, sys.argv[1]); import time_split; time_split.{trainer}_child(*sys.argv[2:])",
        str(HERE),
        str(data),
        str(folder / trainer),
        json.dumps(settings),
        str(out),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **ONE_THREAD})
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{trainer} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    split = json.loads(out.read_text())
    phases = {"to_device": 0.0, **{p: s for p, s in split.items() if p in PHASES}}
    phases["other"] = sum(s for p, s in split.items() if p not in PHASES or p == "other")
    phases["startup"] = seconds - sum(split.values())
    return {"seconds": seconds, "split": phases}


def equal_threads(repeats: int, smoke: bool, work: Path) -> list[dict]:
    data = shapes_data(str(work), smoke=smoke, counts=None if smoke else HELD_OUT)
    settings = SMOKE if smoke else SETTINGS
    out = []
    for i in range(repeats):
        folder = work / f"repeat{i}"
        order = ("yoloaccum", "ultralytics") if i % 2 == 0 else ("ultralytics", "yoloaccum")
        runs = {trainer: one_run(trainer, data, settings, folder) for trainer in order}
        runs["ratio"] = runs["ultralytics"]["seconds"] / runs["yoloaccum"]["seconds"]
        print(f"repeat {i}: {json.dumps(runs)}", flush=True)
        out.append(runs)
    return out


def split_cost(smoke: bool, work: Path) -> dict:
    """The split's own cost: epochs with the engine's timer on and off alternately, in one process, one thread."""
    import torch

    from yoloaccum.config.settings import resolve
    from yoloaccum.core.timing import PhaseTimer
    from yoloaccum.training.trainer import Trainer

    torch.set_num_threads(1)
    data = shapes_data(str(work), smoke=smoke, counts=None if smoke else HELD_OUT)
    settings = {**(SMOKE if smoke else SETTINGS), "epochs": 5 if smoke else 9, "warmup_epochs": 0, "save": False}
    cfg = resolve(overrides={**settings, "data": str(data), "precise_bn": 0, "project": str(work / "cost")})
    trainer = Trainer.from_config(cfg)
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    on, off = trainer.parts.engine.timer, PhaseTimer.off()

    def swap(end, decided):  # epoch 1 ran with the split on: the second off, the third on, ...
        seconds["on" if trainer.parts.engine.timer is on else "off"].append(end.train_seconds)
        trainer.parts.engine.timer = off if end.epoch % 2 == 0 else on
        return decided

    trainer.add_step(swap)
    trainer.train()
    # each off epoch against the mean of the on epochs either side of it (a drift of the machine's speed cancels); the
    # first epoch, which warms up, is left out
    on_, off_ = seconds["on"], seconds["off"]
    pairs = [(on_[k] + on_[k + 1]) / 2 / off_[k] - 1 for k in range(1, len(off_)) if k + 1 < len(on_)]
    probe, n = PhaseTimer(torch.device("cpu")), 100_000  # a lap's own time, in a loop of nothing else
    start = time.perf_counter()
    for _ in range(n):
        probe.lap("data")
    lap_seconds = (time.perf_counter() - start) / n
    timed_epochs = len(seconds["on"])
    bound = on.laps / timed_epochs * lap_seconds / statistics.median(seconds["on"])
    return {
        "seconds": seconds,
        "overhead": statistics.median(pairs) if pairs else float("nan"),
        "laps": on.laps,
        "lap_seconds": lap_seconds,
        "laps_share": bound,
    }


def table(runs: list[dict]) -> list[str]:
    lines = [
        "| trainer | whole process | " + " | ".join(PHASES) + " |",
        "| --- " * (len(PHASES) + 2) + "|",
    ]
    for trainer in ("yoloaccum", "ultralytics"):
        whole = statistics.median(r[trainer]["seconds"] for r in runs)
        phases = [statistics.median(r[trainer]["split"].get(p, 0.0) for r in runs) for p in PHASES]
        lines.append(f"| {trainer} | {whole:.1f} s | " + " | ".join(f"{s:.2f}" for s in phases) + " |")
    ratios = sorted(r["ratio"] for r in runs)
    lines.append("")
    lines.append(
        f"Speed ratio, whole process, median of {len(runs)} repeats: **{statistics.median(ratios):.2f}x** "
        f"(each: {', '.join(f'{r:.2f}x' for r in ratios)}). Phases in seconds, medians."
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)  # 3 spread over 0.1 to 0.3 on a noisy machine
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--skip-cost", action="store_true", help="the equal-threads comparison alone")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:  # the runs' folders, 60 MB a repeat
        runs = equal_threads(1 if a.smoke else a.repeats, a.smoke, Path(work))
        cost = None if a.skip_cost else split_cost(a.smoke, Path(work))
    lines = table(runs)
    if cost is not None:
        on, off = cost["seconds"]["on"], cost["seconds"]["off"]
        lines += [
            "",
            f"The split's own cost: epochs with it on against off in one process, each off epoch against its "
            f"neighbours: "
            f"{cost['overhead']:+.2%} (median; on {', '.join(f'{s:.2f}' for s in on)} s, off "
            f"{', '.join(f'{s:.2f}' for s in off)} s; {cost['laps']} laps in the epochs it timed). The laps' own "
            f"time: {cost['lap_seconds'] * 1e6:.2f} µs each, {cost['laps_share']:.4%} of an epoch.",
        ]
    print("\n".join(lines))
    if not a.smoke:
        (HERE / "time_split.json").write_text(json.dumps({"equal_threads": runs, "cost": cost}, indent=1))
        (HERE / "time_split.md").write_text(
            "Measured by `python benchmarks/time_split.py` (in `make bench`) on the 2-core CPU machine; settings and "
            "method in its docstring.\n\n" + "\n".join(lines) + "\n"
        )


if __name__ == "__main__":
    main()
