"""precise_bn: what it costs in an epoch, and how many images give the statistics that all of them give.

    python benchmarks/precise_bn.py cost                  # make bench-precise-bn: its share of an epoch, two sets
    python benchmarks/precise_bn.py where                 # where a recompute's time goes
    python benchmarks/precise_bn.py size RUN [RUN ...]    # the same weights validated after recomputes over N images
    python benchmarks/precise_bn.py report                # benchmarks/precise_bn.md from the kept figures

cost: yoloaccum's trainer in this process, as `yoloaccum train` runs it at its defaults (validation every epoch,
precise_bn as shipped, plots off: they are make bench's), on `make train`'s recipe (datasets/shapes.yaml, 512 images
at 160 px, batch 8, nbs 64, workers 2) and on BCCD (../shared/datasets/bccd.yaml, 292 photographs at 256 px, the
accuracy benchmark's size; skipped when absent), EPOCHS epochs each with mosaic on. Per epoch it times training,
the recompute and validation; the share is the recompute's time over the three's. Drawing the kept images happens
once, at the first recompute, and is reported apart.

size: for each run folder (trained with save_period, so weights/epoch*.pt exist), every saved epoch's EMA weights
validated after a recompute over N images, N in SIZES, drawn as the trainer draws them (the first N of the seed's
permutation, with the recipe's augmentation). The paired difference to the largest N says what fewer images lose.
Figures are kept in benchmarks/precise_bn.json, so runs add up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import shapes_data  # noqa: E402  (imports yoloaccum.config.ultra: ultralytics offline)
from fidelity import BCCD, BCCD_YAML, T95  # noqa: E402

STORE = HERE / "precise_bn.json"
EPOCHS = 3
SIZES = (32, 64, 128, 256)
MAKE_TRAIN = {
    "model": "yolo26n.yaml",
    "imgsz": 160,
    "batch": 8,
    "nbs": 64,
    "workers": 2,
    "warmup_epochs": 1,
    "close_mosaic": 0,
}


def cost(data: Path, settings: dict, epochs: int) -> dict:
    """Seconds per epoch of training, recompute and validation, in a trainer run as `yoloaccum train` runs it."""
    from yoloaccum.config import settings as config
    from yoloaccum.training import epoch_end, trainer

    args = {**settings, "data": str(data), "epochs": epochs, "plots": False, "verbose": False}
    cfg = config.resolve([f"{k}={v}" for k, v in args.items()] + [f"project={tempfile.mkdtemp()}", "name=cost"])
    times: dict[str, list[float]] = {"train": [], "precise_bn": [], "validation": [], "draw": []}

    run = trainer.Trainer.from_config(cfg)
    start = time.perf_counter()
    run.precise_bn.draw()  # the draw, once, timed apart from the recomputes
    times["draw"].append(time.perf_counter() - start)
    names = {epoch_end.PreciseBN: "precise_bn", epoch_end.Validate: "validation"}
    run.epoch_end = [
        epoch_end.timed(step, times[names[type(step)]]) if type(step) in names else step for step in run.epoch_end
    ]
    run.add_step(lambda end, decided: times["train"].append(end.train_seconds) or decided)
    run.train()
    images = int(len(run.precise_bn.images)) if cfg.precise_bn else 0
    return {"images": images, "train_images": len(run.parts.train_set), **times}


def where(imgsz: int = 160, n: int = 256, repeats: int = 5) -> dict:
    """Where a recompute's time goes, on yolo26n and n random images, each variant timed `repeats` times in turn:
    the forward passes alone (BatchNorm in training mode, as the recompute runs them), the recompute as shipped
    (BatchNorm's own statistics read after each layer), and the first version's hooks (each layer's input reduced
    again to its mean and variance). Medians in seconds."""
    import torch
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum.batchnorm import precise as precise_bn
    from yoloaccum.core.micro_batch import model_input
    from yoloaccum.distributed.ddp import Context

    model = DetectionModel("yolo26n.yaml", nc=3, verbose=False).to(memory_format=torch.channels_last)
    ctx, images = Context(0, 0, 1, torch.device("cpu")), torch.randint(0, 255, (n, 3, imgsz, imgsz), dtype=torch.uint8)
    layers = precise_bn.bn_layers(model)

    def input_moments(layer, inputs):  # the first version's hook
        x = inputs[0].detach()
        torch.var_mean(x.float(), dim=[d for d in range(x.ndim) if d != 1], unbiased=False)

    def passes(hook=None):
        hooks = [layer.register_forward_pre_hook(hook) for layer in layers] if hook else []
        model.eval()
        for layer in layers:
            layer.train()
        with torch.no_grad():
            for x in images.split(precise_bn.BATCH):
                model(model_input(x, ctx.device))
        for h in hooks:
            h.remove()

    variants = {
        "forward passes alone": passes,
        "recompute as shipped": lambda: precise_bn.recompute_images(model, images, ctx),
        "forward + the first version's input hooks": lambda: passes(input_moments),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {
        "images": n,
        "imgsz": imgsz,
        "threads": torch.get_num_threads(),
        **{k: statistics.median(v) for k, v in times.items()},
    }


def cost_rows(rows: dict) -> list[str]:
    lines = [
        "| set | precise_bn images | train s/epoch | precise_bn s/epoch | validation s/epoch | precise_bn share "
        "| drawing the images (once) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        # the first epoch's figures are left out: it also starts the loader's workers and warms the allocator
        t, p, v = (statistics.median(r[k][1:] or r[k]) for k in ("train", "precise_bn", "validation"))
        lines.append(
            f"| {name} ({r['train_images']} training images) | {r['images']} | {t:.2f} | {p:.2f} | {v:.2f} "
            f"| {p / (t + p + v):.1%} | {r['draw'][0]:.2f} s |"
        )
    return lines


def size(run: Path, sizes=SIZES) -> dict:
    """{epoch: {N: mAP50-95}} for every weights/epoch*.pt of a run, recomputed over N images each."""
    import torch

    from yoloaccum.batchnorm import precise as precise_bn
    from yoloaccum.config import settings as config
    from yoloaccum.data import datasets as data_
    from yoloaccum.distributed import ddp as distributed
    from yoloaccum.evaluation.validate import Evaluator
    from yoloaccum.model import checkpoint

    saved = yaml_args(run)
    cfg = config.resolve(
        overrides={"data": saved["data"], "imgsz": saved["imgsz"], "seed": saved["seed"], "workers": 0}
    )
    spec, cpu = data_.load_spec(cfg.data), torch.device("cpu")
    evaluator = Evaluator(cfg, spec, Path(tempfile.mkdtemp()), 16, cpu)
    drawn = data_.precise_bn_images(cfg, spec, max(sizes), 0, 1)  # the first N of these are the trainer's draw for N
    out = {}
    for weights in sorted(run.glob("weights/epoch*.pt"), key=lambda p: int(p.stem.removeprefix("epoch"))):
        out[weights.stem] = {}
        for n in sizes:
            model = checkpoint.model_of(checkpoint.load(weights, trust=True))
            precise_bn.recompute_images(model, drawn[:n], distributed.Context(0, 0, 1, cpu))
            out[weights.stem][str(n)] = round(evaluator.evaluate(model)["metrics/mAP50-95(B)"], 4)
        print(run.name, weights.stem, out[weights.stem], flush=True)
    return out


def yaml_args(run: Path) -> dict:
    import yaml

    return yaml.safe_load((run / "args.yaml").read_text())


def size_rows(runs: dict) -> list[str]:
    """Per N: the mean mAP50-95, and the paired difference to the largest N. The unit is the run: its checkpoints
    share one draw of images, so their differences are not independent; the interval is over the runs' means."""
    sizes = sorted(next(iter(next(iter(runs.values())).values())), key=int)
    reference = sizes[-1]
    points = sum(map(len, runs.values()))
    lines = [
        f"| N | mAP50-95, mean over {points} checkpoints of {len(runs)} runs | paired difference to "
        f"N={reference}: per run | mean, 95% interval over runs | checkpoints lower |",
        "| --- | --- | --- | --- | --- |",
    ]
    for n in sizes:
        per_run = [statistics.fmean(p[n] - p[reference] for p in r.values()) for r in runs.values()]
        mean = statistics.fmean(per_run)
        half = T95[len(per_run) - 2] * statistics.stdev(per_run) / len(per_run) ** 0.5 if len(per_run) > 1 else 0.0
        lower = sum(p[n] < p[reference] for r in runs.values() for p in r.values())
        mean_map = statistics.fmean(p[n] for r in runs.values() for p in r.values())
        lines.append(
            f"| {n} | {mean_map:.4f} | {' '.join(f'{d:+.4f}' for d in per_run)} | {mean:+.4f} "
            f"[{mean - half:+.4f}, {mean + half:+.4f}] | {lower} of {points} |"
        )
    return lines


def report(store: dict) -> str:
    out = [
        "# precise_bn: cost and sample size",
        "",
        "Written by `python benchmarks/precise_bn.py` (its docstring says "
        "how it measures) on the 2-core CPU machine, one job at a time.",
        "",
    ]
    if store.get("cost"):
        out += [
            "## Cost, as `yoloaccum train` runs it (`python benchmarks/precise_bn.py cost`)",
            "",
            *cost_rows(store["cost"]),
            "",
        ]
    if store.get("where"):
        w = store["where"]
        base = w["forward passes alone"]
        out += [
            f"## Where the time goes (`python benchmarks/precise_bn.py where`): {w['images']} images at "
            f"{w['imgsz']} px, yolo26n, {w['threads']} threads, median of 5",
            "",
            "| variant | s | vs the passes |",
            "| --- | --- | --- |",
        ]
        out += [f"| {k} | {w[k]:.2f} | {w[k] / base:.2f}x |" for k in w if k not in ("images", "imgsz", "threads")]
        out.append("")
    for label, runs in store.get("size", {}).items():
        each = "; ".join(
            f"{run} {e}: " + " ".join(f"{v:.3f}" for v in p.values()) for run, r in runs.items() for e, p in r.items()
        )
        sizes = ", ".join(next(iter(next(iter(runs.values())).values())))
        out += [
            f"## Sample size on {label} (`python benchmarks/precise_bn.py size RUN ... --label ...`)",
            "",
            f"mAP50-95 per checkpoint, N = {sizes}: {each}.",
            "",
            *size_rows(runs),
            "",
        ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["cost", "where", "size", "report"])
    parser.add_argument("runs", nargs="*", type=Path, help="size: run folders with weights/epoch*.pt")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="size: the Ns (default: SIZES)")
    parser.add_argument("--label", default="make train's set", help="size: the set the runs trained on")
    a = parser.parse_args()
    store = json.loads(STORE.read_text()) if STORE.exists() else {}
    if a.what == "cost":
        sets = {"make train's recipe": (shapes_data(None, smoke=False), MAKE_TRAIN)}
        if BCCD_YAML.exists():
            sets["BCCD"] = (BCCD_YAML, {**MAKE_TRAIN, "imgsz": BCCD["imgsz"]})
        else:
            print(f"{BCCD_YAML} is absent: BCCD skipped")
        store["cost"] = {name: cost(data, settings, a.epochs) for name, (data, settings) in sets.items()}
    elif a.what == "where":
        store["where"] = where()
    elif a.what == "size":
        store.setdefault("size", {}).setdefault(a.label, {}).update(
            {str(run): size(run.resolve(), sorted(a.sizes)) for run in a.runs}
        )
    STORE.write_text(json.dumps(store, indent=1))
    text = report(store)
    (HERE / "precise_bn.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
