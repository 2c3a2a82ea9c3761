"""Which BatchNorm statistics validation reads, compared on the same final weights: the fidelity runs' checkpoints.

    python benchmarks/bn_validation.py /tmp/fidelity-*/b8/run*/weights/last.pt ...
    python benchmarks/bn_validation.py runs/train/shapes/weights/last.pt --data datasets/shapes.yaml

Each checkpoint (a fidelity run's <config>/run<seed>/weights/last.pt, or any run at 160 px with --data) is validated
five ways; precision and recall are kept beside the mAPs, to tell a run that finds nothing from one buried in false
positives:
- trained: the EMA's running statistics as training left them;
- precise-16, precise-64, precise-all: yoloaccum's precise_bn over the 256 training images, letterboxed only
  (precise_bn_aug=False), in micro-batches of 16 (what it first did), 64 (precise_bn.BATCH) or all 256 at once,
  which is exactly the statistics inference sees (each layer upstream normalised with the statistics of all the
  images);
- val-batch: every layer normalising with each validation batch's own statistics (16 images), as in training:
  what the weights can do when no running statistic is read at all;
- aug-64, mosaic-64: precise statistics in micro-batches of 64 over the same 256 training images as training's
  augmentation draws them, without mosaic (as the last close_mosaic epochs) or with it (what precise_bn does by
  default): detectron2's PreciseBN recomputes over the training loader.
Rows go to benchmarks/bn_validation.json (kept, so runs add up), the table to stdout; --variants measures only some,
adding them to the rows kept.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fidelity import FULL  # noqa: E402

VARIANTS = ("trained", "precise-16", "precise-64", "precise-all", "val-batch", "aug-64", "mosaic-64")
KEYS = {
    "P": "metrics/precision(B)",
    "R": "metrics/recall(B)",
    "mAP50": "metrics/mAP50(B)",
    "mAP50-95": "metrics/mAP50-95(B)",
}


def batch_statistics(model):
    """Every BatchNorm layer normalising with its input batch's statistics even in eval mode, its running statistics
    untouched (momentum 0). Returns a function that undoes it."""
    from yoloaccum.batchnorm import precise as precise_bn

    def train_mode(layer, inputs):
        layer.training = True

    layers = precise_bn.bn_layers(model)
    momenta = [layer.momentum for layer in layers]
    hooks = [layer.register_forward_pre_hook(train_mode) for layer in layers]
    for layer in layers:
        layer.momentum = 0.0

    def undo():
        for layer, momentum, hook in zip(layers, momenta, hooks):
            hook.remove()
            layer.momentum = momentum

    return undo


def validate_variants(weights: Path, data: Path, variants=VARIANTS) -> dict:
    import torch

    from yoloaccum.batchnorm import precise as precise_bn
    from yoloaccum.config import settings as config
    from yoloaccum.data import datasets as data_
    from yoloaccum.distributed import ddp as distributed
    from yoloaccum.evaluation.validate import Evaluator
    from yoloaccum.model import checkpoint

    imgsz = FULL["imgsz"]
    cfg = config.resolve(overrides={"data": str(data), "imgsz": imgsz, "workers": 0})
    spec, cpu = data_.load_spec(cfg.data), torch.device("cpu")
    ctx = distributed.Context(0, 0, 1, cpu)
    evaluator = Evaluator(cfg, spec, weights.parent, 16, cpu)
    images = data_.precise_bn_images(cfg.replace(precise_bn_aug=False), spec, FULL["images"], 0, 1)
    augmented = {"aug-64": cfg.replace(mosaic=0.0), "mosaic-64": cfg}  # mosaic=0: as close_mosaic leaves training
    out = {}
    for variant in variants:
        model = checkpoint.model_of(checkpoint.load(weights, trust=True))
        if variant in augmented:
            precise_bn.recompute_images(
                model, data_.precise_bn_images(augmented[variant], spec, FULL["images"], 0, 1), ctx, 64
            )
        elif variant.startswith("precise"):
            batch = len(images) if variant == "precise-all" else int(variant.removeprefix("precise-"))
            precise_bn.recompute_images(model, images, ctx, batch)
        undo = batch_statistics(model) if variant == "val-batch" else None
        metrics = evaluator.evaluate(model)
        if undo:
            undo()
        out[variant] = {k: round(metrics[v], 4) for k, v in KEYS.items()}
    return out


def table(rows: dict) -> str:
    header = " | ".join(f"{v} mAP50-95 (P / R)" for v in VARIANTS)
    lines = [f"| run | {header} |", "| --- |" + " --- |" * len(VARIANTS)]
    for key, r in sorted(rows.items()):
        cells = [f"{r[v]['mAP50-95']:.3f} ({r[v]['P']:.2f} / {r[v]['R']:.2f})" if v in r else "–" for v in VARIANTS]
        lines.append(f"| {key} | {' | '.join(cells)} |")
    lines.append("")
    for variant in VARIANTS[1:]:
        diffs = [r[variant]["mAP50-95"] - r["trained"]["mAP50-95"] for r in rows.values() if variant in r]
        if len(diffs) > 1:
            mean, sd, higher = statistics.fmean(diffs), statistics.stdev(diffs), sum(d > 0 for d in diffs)
            lines.append(
                f"{variant} - trained, mAP50-95: mean {mean:+.4f}, sd {sd:.4f}, higher in {higher} of {len(diffs)}"
            )
    return "\n".join(lines)


def main() -> None:
    import argparse

    from common import shapes_data  # imports yoloaccum.config.ultra first: ultralytics offline before it is imported

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("weights", nargs="+", type=Path, help="checkpoints: <folder>/<run>/weights/last.pt")
    parser.add_argument("--data", type=Path, help="their dataset YAML (default: the fidelity set, generated)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    a = parser.parse_args()
    data = a.data or shapes_data(
        tempfile.mkdtemp(),
        smoke=False,
        counts={"num_train": FULL["images"], "num_val": FULL["val_images"], "imgsz": FULL["imgsz"], "seed": 0},
    )
    store = HERE / "bn_validation.json"
    rows = json.loads(store.read_text()) if store.exists() else {}
    for weights in a.weights:
        run = weights.parent.parent
        epochs = (run / "results.csv").read_text().count("\n") - 1
        key = f"{run.parent.name}/{run.name}" + ("" if epochs == FULL["epochs"] else f" ({epochs} epochs)")
        rows[key] = {**rows.get(key, {}), **validate_variants(weights, data, a.variants)}
        print(key, rows[key], flush=True)
        store.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
