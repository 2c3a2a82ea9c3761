"""As it ships: `yoloaccum train` against Ultralytics' trainer, both at their defaults, whole process and per epoch.

    python benchmarks/defaults.py                 # part of make bench: benchmarks/defaults.{md,json}
    python benchmarks/defaults.py --sets short    # the 3-epoch run alone
    python benchmarks/defaults.py --smoke         # one tiny run of each, into a temp folder (make test runs it)

Both trainers are given the same set and the same settings (model, imgsz, batch, nbs, epochs and, for `make train`'s
recipe, what the Makefile gives), everything else at its default: validation every epoch, plots on, and yoloaccum's
precise_bn as shipped. Each repeat runs yoloaccum (its command line, `yoloaccum train ...`) and then Ultralytics
(`YOLO(model).train(...)`, what `yolo train` runs, with its downloads turned off as yoloaccum turns them off), each
in a fresh process, back to back; ratios are taken within a repeat, and the report gives their median. Whole
process: the wall clock from starting the process to its exit, imports, plots and the final validation included.
Per epoch: the median difference of consecutive `time` entries of each run's results.csv (training and validation),
the first epoch left out.

Sets:
- short: a held-out shapes set (256 training and 64 validation images at 160 px, generator seed 1), 3 epochs;
- make-train: `make train`'s recipe (datasets/shapes.yaml, 512 images, 35 epochs, workers 2, warmup_epochs 1,
  close_mosaic 5); about 12 minutes a repeat, so 1 repeat unless --long-repeats;
- bccd: ../shared/datasets/bccd.yaml (292 photographs, JPEGs decoded by the loader) at 256 px, the accuracy
  benchmark's size, 3 epochs; skipped when absent.
- finetune-b2, finetune-b4 (only when asked for: `--sets finetune-b2 finetune-b4`): the fine-tuning study's cost of
  `yolo train` against yoloaccum's defaults, side by side. BCCD at 256 px from make pretrain's checkpoint at
  micro-batch 2 and 4, 3 epochs with the study's warmup (1 epoch, so the timed epochs accumulate to 64) and mosaic on
  throughout (as in 15 of the study's 20 epochs); skipped when BCCD or the checkpoint is absent (`make pretrain`).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import pretrain  # noqa: E402
from common import REPO, TINY_MODEL, absolute_yaml, shapes_data  # noqa: E402
from fidelity import BCCD, BCCD_YAML  # noqa: E402

BASE = {"model": "yolo26n.yaml", "imgsz": 160, "batch": 8, "nbs": 64}
MAKE_TRAIN = {"epochs": 35, "workers": 2, "warmup_epochs": 1, "close_mosaic": 5}  # as the Makefile's train target
FINETUNE = {"imgsz": BCCD["imgsz"], "nbs": 64, "epochs": 3, "warmup_epochs": 1, "close_mosaic": 0}
SETS = ["short", "make-train", "bccd"]  # make bench's; the fine-tuning sets are asked for by name
FINETUNE_SETS = {"finetune-b2": 2, "finetune-b4": 4}
SMOKE = {"model": TINY_MODEL, "imgsz": 64, "batch": 4, "nbs": 8, "epochs": 1}


def sets(names: list[str], smoke: bool) -> dict[str, tuple[Path, dict, int]]:
    """name: (data YAML, settings, repeats multiplier) for each set asked for that is here."""
    out = {}
    if smoke:
        return {"smoke": (shapes_data(tempfile.mkdtemp(), smoke=True), SMOKE, 1)}
    if "short" in names:
        held_out = {"num_train": 256, "num_val": 64, "imgsz": 160, "seed": 1}
        out["short"] = (shapes_data(tempfile.mkdtemp(), smoke=False, counts=held_out), {**BASE, "epochs": 3}, 1)
    if "make-train" in names:
        out["make-train"] = (shapes_data(None, smoke=False), {**BASE, **MAKE_TRAIN}, 0)
    if "bccd" in names:
        if BCCD_YAML.exists():
            out["bccd"] = (absolute_yaml(BCCD_YAML), {**BASE, "imgsz": BCCD["imgsz"], "epochs": 3}, 1)
        else:
            print(f"{BCCD_YAML} is absent: the BCCD row is skipped")
    asked = [name for name in FINETUNE_SETS if name in names]
    if asked:
        if not BCCD_YAML.exists() or pretrain.record() is None:
            print(f"{BCCD_YAML} or make pretrain's checkpoint is absent: the fine-tuning rows are skipped")
            return out
        model = str(pretrain.home() / f"{pretrain.NAME}.pt")
        for name in asked:
            out[name] = (absolute_yaml(BCCD_YAML), {**FINETUNE, "model": model, "batch": FINETUNE_SETS[name]}, 1)
    return out


def ultralytics_child(data: str, project: str, settings: str) -> None:
    """In a fresh process: Ultralytics' own trainer at its defaults, with the downloads off."""
    import yoloaccum.config.ultra  # noqa: F401, I001  (first: offline, fonts patched, nothing reaches the network)
    from ultralytics import YOLO

    kwargs = json.loads(settings)
    YOLO(kwargs.pop("model")).train(data=data, project=project, name="run", **kwargs)


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{command[:3]} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds


def per_epoch(results_csv: Path) -> float:
    """Median seconds per epoch from results.csv's cumulative `time`, the first epoch left out."""
    with results_csv.open() as f:
        times = [float(r["time"]) for r in csv.DictReader(f, skipinitialspace=True)]
    steps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(steps) if steps else times[0]


def one_repeat(data: Path, settings: dict) -> dict:
    folder = Path(tempfile.mkdtemp())
    ours = [
        str(Path(sys.executable).parent / "yoloaccum"),
        "train",
        f"data={data}",
        *(f"{k}={v}" for k, v in settings.items()),
        f"project={folder / 'yoloaccum'}",
        "name=run",
    ]
    theirs = [
        sys.executable,
        "-c",
        "import sys; sys.path.insert(0, sys.argv[1]); import defaults; defaults.ultralytics_child(*sys.argv[2:])",
        str(HERE),
        str(data),
        str(folder / "ultralytics"),
        json.dumps(settings),
    ]
    out = {"yoloaccum_s": timed(ours), "ultralytics_s": timed(theirs)}
    out["yoloaccum_epoch_s"] = per_epoch(folder / "yoloaccum/run/results.csv")
    out["ultralytics_epoch_s"] = per_epoch(folder / "ultralytics/run/results.csv")
    return out


def rows(results: dict) -> list[str]:
    lines = [
        "| set | repeats | yoloaccum, whole process | Ultralytics, whole process | speed ratio | yoloaccum, per "
        "epoch | Ultralytics, per epoch | speed ratio |",
        "| --- " * 8 + "|",
    ]
    for name, reps in results.items():
        med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        whole = statistics.median(r["ultralytics_s"] / r["yoloaccum_s"] for r in reps)
        epoch = statistics.median(r["ultralytics_epoch_s"] / r["yoloaccum_epoch_s"] for r in reps)
        lines.append(
            f"| {name} | {len(reps)} | {med['yoloaccum_s']:.1f} s | {med['ultralytics_s']:.1f} s | "
            f"{whole:.2f}x | {med['yoloaccum_epoch_s']:.2f} s | {med['ultralytics_epoch_s']:.2f} s | "
            f"{epoch:.2f}x |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", nargs="+", choices=[*SETS, *FINETUNE_SETS], default=SETS)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the short sets (default 3)")
    parser.add_argument("--long-repeats", type=int, default=1, help="repeats of make train's recipe (default 1)")
    parser.add_argument("--smoke", action="store_true")
    a = parser.parse_args()
    results = {}
    for name, (data, settings, short) in sets(a.sets, a.smoke).items():
        repeats = 1 if a.smoke else a.repeats if short else a.long_repeats
        results[name] = []
        for i in range(repeats):
            results[name].append(one_repeat(data, settings))
            print(name, i, results[name][-1], flush=True)
    store = HERE / "defaults.json"
    if not a.smoke and store.exists():  # the sets not run this time keep their last figures
        results = {**json.loads(store.read_text()), **results}
    table = rows(results)
    print("\n".join(table))
    if not a.smoke:
        store.write_text(json.dumps(results, indent=1))
        (HERE / "defaults.md").write_text(
            "Measured by `python benchmarks/defaults.py` (in `make bench`; the finetune "
            "rows by name, `--sets finetune-b2 finetune-b4`) on the 2-core "
            "CPU machine; settings and method in its docstring.\n\n" + "\n".join(table) + "\n"
        )


if __name__ == "__main__":
    main()
