"""The benchmark suite: yoloaccum against Ultralytics' own trainer and against the bare model, memory, accumulation
overhead and the data pipeline.

    python benchmarks/bench.py            # full: writes benchmarks/results.md and results.json (several minutes)
    python benchmarks/bench.py --smoke    # a few iterations of everything, to keep the scripts working (CI)

Every comparison alternates its contenders within each repeat, so machine noise hits both alike, and reports the
median over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import SHAPES_YAML, engine_for, make_batches, shapes_data  # noqa: E402


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def trainer_throughput(trainer: str, model: str, data: Path, imgsz: int, epochs: int, fraction: float) -> float:
    """Images/s of the last epoch (steady state: the first one warms up), in a fresh process."""
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); from common import {trainer}_images_per_second as f; "
    code += f"print(f({model!r}, {str(data)!r}, {imgsz}, {epochs}, {fraction}))"  # a fresh process: a fair start
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def vs_ultralytics(models, data, imgsz, repeats, epochs, fraction) -> list[dict]:
    rows = []
    for model in models:
        ours, theirs = [], []
        for _ in range(repeats):  # alternate
            ours.append(trainer_throughput("yoloaccum", model, data, imgsz, epochs, fraction))
            theirs.append(trainer_throughput("ultralytics", model, data, imgsz, epochs, fraction))
        row = {"model": model, "yoloaccum_img_s": median(ours), "ultralytics_img_s": median(theirs)}
        rows.append({**row, "ratio": median(ours) / median(theirs), "runs": {"yoloaccum": ours, "ultralytics": theirs}})
    return rows


def bare_limit(model: str, imgsz: int, micro: int, iterations: int) -> float:
    """Forward + loss + backward on batches already in memory: no data loading, no logging, no optimizer."""
    engine = engine_for(model, imgsz, batch=micro, nbs=micro, num_batches=iterations)
    batches = make_batches(iterations + 2, micro, imgsz)
    engine.raw_model.train()
    for b in batches[:2]:  # warm-up
        engine.loss(engine.raw_model(b["img"]), b)[0].backward()
    start = time.perf_counter()
    for b in batches[2:]:
        engine.loss(engine.raw_model(b["img"]), b)[0].backward()
    return iterations * micro / (time.perf_counter() - start)


def accumulation_overhead(model: str, imgsz: int, micro: int, windows: int, repeats: int) -> dict:
    """Seconds per image with accumulate 8 against accumulate 1: the same micro-batches from memory, after a warm-up
    window that is not timed."""
    times = {1: [], 8: []}
    for _ in range(repeats):
        for acc in (1, 8):  # alternate
            n = 8 * windows + acc
            engine = engine_for(model, imgsz, batch=micro, nbs=micro * acc, num_batches=n)
            start = [0.0]

            def after_warm_up(i, *_, acc=acc, start=start):
                if i == acc - 1:
                    start[0] = time.perf_counter()

            engine.train_epoch(0, make_batches(n, micro, imgsz), after_warm_up)
            times[acc].append((time.perf_counter() - start[0]) / (8 * windows * micro))
    one, eight = median(times[1]), median(times[8])
    return {"seconds_per_image_acc1": one, "seconds_per_image_acc8": eight, "overhead": eight / one - 1}


def data_pipeline(data: Path, imgsz: int, micro: int, batches: int) -> float:
    """Images/s of the training loader alone (augmentation on, workers as in training)."""
    from yoloaccum import config
    from yoloaccum import data as data_

    cfg = config.resolve(overrides=dict(data=str(data), imgsz=imgsz, batch=micro, workers=2, close_mosaic=0))
    spec = data_.load_spec(cfg.data)
    dataset = data_.build_dataset(cfg, spec, "train")
    loader = data_.build_loader(dataset, cfg, micro, 0, 1, True)
    it = iter(loader)
    next(it)  # workers start
    start, seen = time.perf_counter(), 0
    for _, b in zip(range(batches), it):
        seen += b["img"].shape[0]
    return seen / (time.perf_counter() - start)


def peak_memory(model: str, imgsz: int, batch: int, nbs: int, steps: int) -> float:
    """Peak RSS (MB) of a fresh process that trains `steps` micro-batches from memory at batch/nbs."""
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); from common import train_from_memory; "
            f"train_from_memory({model!r}, {imgsz}, {batch}, {nbs}, {steps})")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code])
    _, status, usage = os.wait4(proc.pid, 0)
    assert status == 0, f"memory probe failed ({status})"
    return usage.ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a few iterations of each, to check the scripts run")
    args = parser.parse_args()
    smoke = args.smoke
    imgsz, micro = (64, 4) if smoke else (160, 8)
    models = ("yolo26n.yaml",) if smoke else ("yolo26n.yaml", "yolo11n.yaml")
    data = shapes_data(tempfile.mkdtemp() if smoke else None, smoke)
    repeats = 1 if smoke else 2
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },  # fmt: skip
        "settings": {
            "imgsz": imgsz,
            "batch": micro,
            "nbs": 64,
            "workers": 2,
            "amp": False,
            "data": SHAPES_YAML,
            "repeats": repeats,
            "smoke": smoke,
        },  # fmt: skip
    }
    report["vs_ultralytics"] = vs_ultralytics(models, data, imgsz, repeats, epochs=2, fraction=0.25 if smoke else 1.0)
    report["bare_limit"] = [{"model": m, "img_s": bare_limit(m, imgsz, micro, 4 if smoke else 40)} for m in models]
    for row, bare in zip(report["vs_ultralytics"], report["bare_limit"]):
        row["fraction_of_bare_limit"] = row["yoloaccum_img_s"] / bare["img_s"]
    steps = 4 if smoke else 16
    configs = ((micro, 64), (micro, micro), (64, 64))
    report["memory_mb"] = {f"batch={b} nbs={n}": peak_memory(models[0], imgsz, b, n, steps) for b, n in configs}
    report["accumulation"] = accumulation_overhead(models[0], imgsz, micro, 1 if smoke else 4, repeats)
    report["data_pipeline_img_s"] = data_pipeline(data, imgsz, micro, 4 if smoke else 64)
    print(json.dumps(report, indent=1))
    if not smoke:
        (HERE / "results.json").write_text(json.dumps(report, indent=1))
        (HERE / "results.md").write_text(markdown(report))
    print(markdown(report))


def markdown(r: dict) -> str:
    s, m = r["settings"], r["machine"]
    lines = [f"Measured by `make bench` on {m['cores']} cores ({m['cpu']}), torch {m['torch']}, Python {m['python']}; "
             f"imgsz {s['imgsz']}, batch {s['batch']}, nbs {s['nbs']}, workers {s['workers']}, AMP off; median of "
             f"{s['repeats']}.", "",
             "| model | yoloaccum img/s | Ultralytics img/s | ratio | share of the bare limit |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in r["vs_ultralytics"]:
        lines.append(f"| {row['model']} | {row['yoloaccum_img_s']:.1f} | {row['ultralytics_img_s']:.1f} | "
                     f"{row['ratio']:.2f}x | {row['fraction_of_bare_limit']:.0%} |")  # fmt: skip
    mem = r["memory_mb"]
    keys = list(mem)
    lines += ["", "| peak memory (max RSS) | MB |", "| --- | --- |"]
    lines += [f"| {k} | {v:.0f} |" for k, v in mem.items()]
    lines += [
              "", f"batch {s['batch']} nbs 64 against nbs {s['batch']}: {mem[keys[0]] / mem[keys[1]]:.2f}x; "
              f"against batch 64: {mem[keys[0]] / mem[keys[2]]:.2f}x.",  # fmt: skip
              f"Accumulation overhead (accumulate 8 against 1, per image): {r['accumulation']['overhead']:+.1%}.",
              f"Data pipeline alone: {r['data_pipeline_img_s']:.0f} img/s with augmentation."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
