"""Accuracy over seeds: one recipe trained several ways, each with the same seeds, against a real batch of 64.

    python benchmarks/fidelity.py             # all configurations x 5 seeds: writes benchmarks/fidelity.{md,json,png}
    python benchmarks/fidelity.py --configs b64 b8 --seeds 0 1 2
    python benchmarks/fidelity.py --configs b64 b8 --epochs 60   # longer runs: benchmarks/fidelity-60/
    python benchmarks/fidelity.py --smoke     # 2 configurations x 2 seeds x 1 epoch on a tiny set, into a temp folder
    python benchmarks/fidelity.py --report    # rewrite the report from the runs kept in fidelity.json, training none
    python benchmarks/fidelity.py --report --revalidate /tmp/fidelity-*   # kept runs' weights validated again

Every run trains in a fresh process, then its final EMA weights (last.pt) are validated twice: with the BatchNorm
statistics training left, and with precise statistics recomputed over all training images (yoloaccum's
precise_bn). The runs train with precise_bn=0: the EMA is never read by training, so the trajectory is the same
either way and one run gives both figures. Finished runs are kept in the JSON, keyed by their settings, so an
interrupted benchmark continues where it stopped and new seeds add to the old ones.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import fresh  # noqa: E402
from common import TINY_MODEL  # noqa: E402

# name: (trainer, settings beyond the recipe). bn=sync needs several CUDA devices, so batch 2 runs batch and frozen.
# b2 and b4 name bn=batch (the default before bn=auto, which takes bn=window below 8): their records were made so.
CONFIGS = {
    "b64": ("yoloaccum", {"batch": 64}),
    "b8": ("yoloaccum", {"batch": 8}),
    "b8-micro": ("yoloaccum", {"batch": 8, "norm": "micro"}),
    "b2": ("yoloaccum", {"batch": 2, "bn": "batch"}),
    "b2-frozen": ("yoloaccum", {"batch": 2, "bn": "frozen"}),
    "b2-window": ("yoloaccum", {"batch": 2, "bn": "window"}),
    # mosaic's partners drawn from the last 8 micro-batches' images, as Ultralytics sizes the buffer (the default
    # before mosaic_buffer=window; the records of b2, b4 and b8 made before it are filed under these names)
    "b2-batchbuffer": ("yoloaccum", {"batch": 2, "bn": "batch", "mosaic_buffer": "batch"}),
    "b4-batchbuffer": ("yoloaccum", {"batch": 4, "bn": "batch", "mosaic_buffer": "batch"}),
    "b8-batchbuffer": ("yoloaccum", {"batch": 8, "mosaic_buffer": "batch"}),
    "b4": ("yoloaccum", {"batch": 4, "bn": "batch"}),
    "b4-window": ("yoloaccum", {"batch": 4, "bn": "window"}),
    "b8-window": ("yoloaccum", {"batch": 8, "bn": "window"}),
    # lr_scale at an effective batch of 128 (nbs 64, accumulate 1), AdamW as optimizer=auto picks it (b64's)
    "b128": ("yoloaccum", {"batch": 128}),
    "b128-sqrt": ("yoloaccum", {"batch": 128, "lr_scale": "sqrt"}),
    "b128-linear": ("yoloaccum", {"batch": 128, "lr_scale": "linear"}),
    # and SGD (lr0 0.01), whose update already grows linearly with the batch: its own real batch of 64 to pair with
    "b64-sgd": ("yoloaccum", {"batch": 64, "optimizer": "SGD", "lr0": 0.01}),
    "b128-sgd": ("yoloaccum", {"batch": 128, "optimizer": "SGD", "lr0": 0.01}),
    "b128-sgd-sqrt": ("yoloaccum", {"batch": 128, "optimizer": "SGD", "lr0": 0.01, "lr_scale": "sqrt"}),
    "b128-sgd-none": ("yoloaccum", {"batch": 128, "optimizer": "SGD", "lr0": 0.01, "lr_scale": "none"}),
    # an effective batch of 256 (4x nbs, accumulate 1, one optimizer step an epoch), each optimizer family
    "b256": ("yoloaccum", {"batch": 256}),
    "b256-sqrt": ("yoloaccum", {"batch": 256, "lr_scale": "sqrt"}),
    "b256-linear": ("yoloaccum", {"batch": 256, "lr_scale": "linear"}),
    "b256-sgd": ("yoloaccum", {"batch": 256, "optimizer": "SGD", "lr0": 0.01}),
    "b256-sgd-sqrt": ("yoloaccum", {"batch": 256, "optimizer": "SGD", "lr0": 0.01, "lr_scale": "sqrt"}),
    "b256-sgd-none": ("yoloaccum", {"batch": 256, "optimizer": "SGD", "lr0": 0.01, "lr_scale": "none"}),
    "ultralytics-b8": ("ultralytics", {"batch": 8}),
    "ultralytics-b64": ("ultralytics", {"batch": 64}),
}
REFERENCE = "b64"
FULL = {"images": 256, "val_images": 64, "imgsz": 160, "epochs": 30}
# BCCD: 292 training and 72 validation photographs (640x480 JPEGs, decoded by the loader), at a size 2 cores afford
BCCD = {"dataset": "bccd", "imgsz": 256, "epochs": 60}
BCCD_YAML = HERE.parents[1] / "shared/datasets/bccd.yaml"
SHARED_SETS = {name: HERE.parents[1] / f"shared/datasets/{name}.yaml" for name in ("bccd", "aquarium", "hardhat")}
PRECISE_IMAGES = 256  # at most this many images: the default before precise_bn=auto, kept so the records compare
# The smoke checks that the benchmark runs, not what a model learns: the tests' tiny model instead of yolo26n.
SMOKE = {"images": 16, "val_images": 8, "imgsz": 64, "epochs": 1, "model": TINY_MODEL}
RECIPE = {"model": "yolo26n.yaml", "nbs": 64, "warmup_epochs": 1, "close_mosaic": 5, "workers": 0}
METRICS = ("metrics/mAP50(B)", "metrics/mAP50-95(B)")
# Two-sided 95% quantiles of Student's t for 1 to 30 degrees of freedom (a paired interval over 2 to 31 seeds);
# more seeds than that use the last, a slightly wider interval than theirs.
T95 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def train_and_evaluate(trainer: str, settings: dict, size: dict, seed: int, folder: str) -> dict:
    """In a fresh process: one training run, then its last.pt validated with and without precise BatchNorm."""
    data = dataset(size, folder)
    args = {
        **RECIPE,
        **settings,
        "model": model_of(size),
        "data": str(data),
        "imgsz": size["imgsz"],
        "epochs": size["epochs"],
        "seed": seed,
        "plots": False,
    }
    start = time.perf_counter()
    if trainer == "yoloaccum":
        from yoloaccum import train

        run_dir = Path(folder) / f"run{seed}"
        train(**args, project=folder, name=run_dir.name, exist_ok=True, precise_bn=0, verbose=False)
    else:
        from ultralytics import YOLO

        model = args.pop("model")  # a .pt fine-tunes from its weights, as `yolo train model=w.pt` does
        YOLO(model).train(
            **args,
            project=folder,
            name=f"run{seed}",
            exist_ok=True,
            pretrained=model.endswith(".pt"),
            deterministic=True,
            device="cpu",
            verbose=False,
        )
        run_dir = Path(folder) / f"run{seed}"
    seconds = time.perf_counter() - start
    precise = size.get("precise_images") or min(size.get("images", PRECISE_IMAGES), PRECISE_IMAGES)
    metrics = final_metrics(run_dir / "weights/last.pt", data, size["imgsz"], precise, settings.get("freeze"))
    return {"seconds": seconds, "curve": _curve(run_dir / "results.csv"), **metrics}


def model_of(size: dict) -> str:
    """The model a size trains: the recipe's, unless the size names its own (the smoke)."""
    return size.get("model", RECIPE["model"])


def dataset(size: dict, folder: str) -> Path:
    """The runs' data: BCCD from ../shared, or the shapes set generated with the size's counts."""
    from common import shapes_data  # imports yoloaccum.config.ultra first: ultralytics offline before it is imported

    if size.get("dataset") in SHARED_SETS:  # absolute: Ultralytics' trainer resolves a relative path elsewhere
        from common import absolute_yaml

        Path(folder).mkdir(parents=True, exist_ok=True)  # the yaml goes with the run's folder, not a stray temporary
        return absolute_yaml(SHARED_SETS[size["dataset"]], Path(folder))
    return shapes_data(
        folder,
        smoke=False,
        counts={"num_train": size["images"], "num_val": size["val_images"], "imgsz": size["imgsz"], "seed": 0},
    )


def final_metrics(weights: Path, data: Path, imgsz: int, precise_images: int, freeze=None) -> dict:
    """Validation metrics of a checkpoint's EMA as trained, then with its BatchNorm statistics recomputed (but those
    of the layers `freeze` froze, as training's precise_bn keeps them)."""
    import torch

    from yoloaccum.batchnorm import precise as precise_bn
    from yoloaccum.config import settings as config
    from yoloaccum.data import datasets as data_
    from yoloaccum.distributed import ddp as distributed
    from yoloaccum.evaluation.validate import Evaluator
    from yoloaccum.model import checkpoint
    from yoloaccum.model import freeze as freeze_

    cfg = config.resolve(overrides={"data": str(data), "imgsz": imgsz, "workers": 0})
    spec = data_.load_spec(cfg.data)
    cpu = torch.device("cpu")
    model = checkpoint.model_of(checkpoint.load(weights, trust=True))
    evaluator = Evaluator(cfg, spec, weights.parent, 16, cpu)
    out = {"raw": _pick(evaluator.evaluate(model))}
    images = data_.precise_bn_images(cfg, spec, precise_images, 0, 1)
    frozen = freeze_.prefixes(freeze)
    precise_bn.recompute_images(model, images, distributed.Context(0, 0, 1, cpu), frozen=frozen)  # as the trainer
    out["precise"] = _pick(evaluator.evaluate(model))
    return out


def revalidate(runs: dict, folders: list[Path], size: dict, work: Path) -> None:
    """The precise figures of every kept run found in `folders`, measured again with this code. A folder is taken
    for a kept run only if its weights validate as trained exactly as that run did (the folders hold other runs of
    the same names: smoke runs, stopped runs)."""
    data = dataset(size, str(work))
    for folder in folders:
        for weights in sorted(folder.glob("*/run*/weights/last.pt")):
            name, seed = weights.parents[2].name, weights.parents[1].name.removeprefix("run")
            kept = runs.get(name, {}).get(seed)
            if kept is None or (weights.parents[1] / "results.csv").read_text().count("\n") != size["epochs"] + 1:
                continue
            again = final_metrics(weights, data, size["imgsz"], min(size.get("images", PRECISE_IMAGES), PRECISE_IMAGES))
            if again["raw"] == kept["raw"]:
                kept["precise"] = again["precise"]
                print(f"{name} seed {seed} validated again: {again['precise']}", flush=True)


def _pick(metrics: dict) -> dict:
    return {k: round(metrics[k], 5) for k in METRICS}


def _curve(results_csv: Path) -> list[float]:
    """Validation mAP50-95 per epoch, from a results.csv of either trainer."""
    import csv

    with results_csv.open() as f:
        return [float(row[METRICS[1]]) for row in csv.DictReader(f, skipinitialspace=True)]


def paired(values: list[float], reference: list[float]) -> dict:
    """Mean paired difference with a 95% t interval (seeds that both have)."""
    diffs = [a - b for a, b in zip(values, reference)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"mean": mean, "low": None, "high": None, "n": len(diffs)}
    half = T95[min(len(diffs) - 2, len(T95) - 1)] * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(diffs)}


def summarise(runs: dict, configs: list[str], seeds: list[int]) -> dict:
    """Per configuration and BatchNorm variant: each seed's final metrics, mean, sd, and the paired difference."""
    out = {}
    for name in configs:
        for variant in ("raw", "precise"):
            row = {}
            for metric in METRICS:
                values = [runs[name][str(s)][variant][metric] for s in seeds if str(s) in runs.get(name, {})]
                if not values:
                    continue
                ref = [
                    runs[REFERENCE][str(s)][variant][metric]
                    for s in seeds
                    if str(s) in runs.get(REFERENCE, {}) and str(s) in runs[name]
                ]
                mine = [
                    runs[name][str(s)][variant][metric]
                    for s in seeds
                    if str(s) in runs.get(REFERENCE, {}) and str(s) in runs[name]
                ]
                row[metric] = {
                    "seeds": values,
                    "mean": statistics.fmean(values),
                    "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                    "vs_reference": paired(mine, ref) if ref else None,
                }
            if row:
                ran = [runs[name][str(s)] for s in seeds if str(s) in runs[name]]
                row["seeds"] = [s for s in seeds if str(s) in runs[name]]
                row["minutes"] = statistics.median(r["seconds"] for r in ran) / 60  # a run, train and validation
            out[f"{name} {variant}"] = row
    return out


def report(summary: dict, size: dict, seeds: list[int], minutes: float, flags: str = "") -> str:
    """The markdown table: a row per configuration and BatchNorm variant, with each seed that has run. `flags`: the
    command's options that chose the runs' settings, for the title."""

    def f(x):
        return "–" if x is None else f"{x:+.3f}"

    if size.get("dataset") == "bccd":
        data = f"BCCD (292 training and 72 validation photographs of blood smears) at {size['imgsz']} px"
    else:
        data = f"Shapes set, {size['images']} training and {size['val_images']} validation images at {size['imgsz']} px"
    lines = [
        f"# Fidelity: final mAP over seeds (`python benchmarks/fidelity.py{flags}`)",
        "",
        f"{data}, {Path(model_of(size)).stem}, {size['epochs']} epochs, nbs 64, warmup 1, "
        f"close_mosaic 5, seeds {', '.join(map(str, seeds))}. "
        f"raw: the EMA's BatchNorm statistics as trained; precise: recomputed over all training images, drawn as "
        f"precise_bn draws them by default (at most {PRECISE_IMAGES}, the recipe's augmentation, mosaic included). "
        f"Paired difference: against {REFERENCE} (a real batch of 64) with the same seed and variant, 95% t interval. "
        f"The runs reported took {minutes:.0f} min of training and validation in all; the last column is a run's "
        f"median, one run at a time on the 2-core CPU machine.",
        "",
        "| run | BN | seeds | mAP50 per seed | mAP50 mean ± sd | mAP50-95 per seed | mAP50-95 mean ± sd | ratio "
        "| paired diff [95%] | min a run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, row in summary.items():
        if not row:
            continue
        name, variant = key.split()
        m50, m = row[METRICS[0]], row[METRICS[1]]
        ref = summary.get(f"{REFERENCE} {variant}", {}).get(METRICS[1])
        ratio = f"{m['mean'] / ref['mean']:.2f}" if ref and ref["mean"] else "–"
        d = m["vs_reference"] or {}
        interval = f"{f(d.get('mean'))} [{f(d.get('low'))}, {f(d.get('high'))}]" if d else "–"
        lines.append(
            f"| {name} | {variant} | {','.join(map(str, row['seeds']))} | {' '.join(f'{v:.3f}' for v in m50['seeds'])} "
            f"| {m50['mean']:.3f} ± {m50['sd']:.3f} | {' '.join(f'{v:.3f}' for v in m['seeds'])} | {m['mean']:.3f} ± "
            f"{m['sd']:.3f} | {ratio} | {interval} | {row['minutes']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: dict, configs: list[str], path: Path) -> None:
    """Validation mAP50-95 by epoch (BatchNorm as trained): the mean over seeds, with a band from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in configs:
        curves = [r["curve"] for r in runs.get(name, {}).values() if r["curve"]]
        if not curves:
            continue
        n = min(map(len, curves))
        a = np.array([c[:n] for c in curves])
        epochs = np.arange(1, n + 1)
        ax.plot(epochs, a.mean(0), label=f"{name} ({len(curves)} seeds)")
        ax.fill_between(epochs, a.min(0), a.max(0), alpha=0.15)
    ax.set_xlabel("epoch")
    ax.set_ylabel("val mAP50-95 (BatchNorm as trained)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version that only checks the benchmark runs")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--epochs",
        type=int,
        help=f"train this many epochs instead of {FULL['epochs']}; the report "
        "goes to benchmarks/fidelity-<epochs>/ unless --out says otherwise",
    )
    parser.add_argument(
        "--data",
        choices=["shapes", "bccd"],
        default="shapes",
        help=f"bccd: {BCCD_YAML} (skipped when absent), {BCCD['epochs']} epochs at {BCCD['imgsz']} px; "
        "reported in benchmarks/fidelity-bccd/, or fidelity-bccd-<epochs>/ with --epochs",
    )
    parser.add_argument("--report", action="store_true", help="only write the report from the runs already kept")
    parser.add_argument("--out", type=Path, help="folder for fidelity.{md,json,png}: benchmarks/, or a temporary one")
    parser.add_argument(
        "--revalidate",
        nargs="+",
        type=Path,
        default=[],
        metavar="DIR",
        help="validate kept runs' last.pt again, both ways, after a change to precise_bn (training "
        "never reads it): runs whose folders DIR/<config>/run<seed> are still there",
    )
    a = parser.parse_args()
    if a.smoke:
        a.configs, a.seeds = ["b64", "ultralytics-b8"], [0, 1]  # both trainers, and the reference to pair with
    bccd = a.data == "bccd"
    if bccd and not BCCD_YAML.exists():
        raise SystemExit(f"fidelity --data bccd: {BCCD_YAML} is not here; nothing to run")
    base = SMOKE if a.smoke else BCCD if bccd else FULL
    size = {**base, **({"epochs": a.epochs} if a.epochs else {})}
    if a.out is None:  # runs of another length, or on BCCD, report apart, beside the main report
        suffix = "-".join(["bccd"] * bccd + [str(a.epochs)] * bool(a.epochs))
        a.out = Path(tempfile.mkdtemp()) if a.smoke else HERE / f"fidelity-{suffix}" if suffix else HERE
    a.out.mkdir(parents=True, exist_ok=True)
    store = a.out / "fidelity.json"
    saved = json.loads(store.read_text()) if store.exists() else {}
    key = json.dumps({**RECIPE, **size}, sort_keys=True)  # runs of other settings are kept apart, never mixed
    runs = saved.setdefault(key, {})
    work = Path(tempfile.mkdtemp(prefix="fidelity-"))
    if a.revalidate:
        revalidate(runs, a.revalidate, size, work)
        store.write_text(json.dumps(saved, indent=1))
    for seed in [] if a.report else a.seeds:  # seed-major: a stopped benchmark still has complete pairs
        for name in a.configs:
            if str(seed) in runs.get(name, {}):
                continue
            trainer, settings = CONFIGS[name]
            folder = work / name
            print(f"{name} seed {seed} ...", flush=True)
            result = fresh("train_and_evaluate", trainer, settings, size, seed, str(folder), module="fidelity")
            runs.setdefault(name, {})[str(seed)] = result
            print(f"  {result['seconds']:.0f} s, raw {result['raw']}, precise {result['precise']}", flush=True)
            store.write_text(json.dumps(saved, indent=1))
    seconds = sum(r["seconds"] for name in a.configs for r in runs.get(name, {}).values())
    seeds = [s for s in a.seeds if any(str(s) in runs.get(name, {}) for name in a.configs)]  # those that ran
    summary = summarise(runs, a.configs, seeds)
    flags = (" --data bccd" if bccd else "") + (f" --epochs {a.epochs}" if a.epochs else "")
    (a.out / "fidelity.md").write_text(report(summary, size, seeds, seconds / 60, flags))
    plot(runs, a.configs, a.out / "fidelity.png")
    print((a.out / "fidelity.md").read_text())
    print(f"written: {a.out / 'fidelity.md'}, fidelity.json, fidelity.png")


if __name__ == "__main__":
    main()
