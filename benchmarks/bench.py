"""The benchmark suite: yoloaccum against Ultralytics' own trainer and against the bare model, memory, accumulation
overhead and the data pipeline.

    python benchmarks/bench.py            # full: writes benchmarks/results.md and .json (about 30 minutes)
    python benchmarks/bench.py --smoke    # a few iterations of everything, to keep the scripts working (CI)
    python benchmarks/bench.py --compile-only   # section (h) alone: compile=True (about 17 minutes)

These machines are noisy, so nothing is compared across time: each repeat runs both trainers back to back, each in a
fresh process, so neither inherits the other's threads, caches or memory; the bare limit is measured inside
yoloaccum's process, on its own model, just before and just after the measured epoch. Each ratio is taken within a
repeat, and the report gives the median over the repeats. On CUDA everything runs with AMP.
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
from common import (  # noqa: E402
    AMP,
    CUDA,
    DEVICE,
    SHAPES_YAML,
    TINY_MODEL,
    TRAIN_ARGS,
    engine_for,
    make_batches,
    on_device,
    shapes_data,
    synchronize,
)

median = statistics.median


def command(function: str, *args, module: str = "common") -> list[str]:
    """A fresh Python process that prints module.function(*args) as JSON on its last line."""
    code = f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import {module}; "
    return [sys.executable, "-c", code + f"print(json.dumps({module}.{function}(*{args!r})))"]


def fresh(function: str, *args, module: str = "common", env: dict[str, str] | None = None):
    env = {**os.environ, **env} if env else None
    r = subprocess.run(command(function, *args, module=module), capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"{function}{args} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def throughput(
    models, data: str, imgsz: int, repeats: int, epochs: int, fraction: float, iterations: int
) -> list[dict]:
    """(a) and (b): each repeat runs yoloaccum's trainer, with the bare limit measured in its process around its last
    epoch, then Ultralytics' trainer, back to back. Both ratios are taken within a repeat."""
    rows = []
    for model in models:
        runs = {"yoloaccum": [], "ultralytics": []}
        trained = (model, data, imgsz, epochs, fraction)
        for _ in range(repeats):
            runs["yoloaccum"].append(fresh("yoloaccum_and_bare_limit", *trained, iterations))
            runs["ultralytics"].append(fresh("ultralytics_images_per_second", *trained))
        ours, theirs = [r["img_s"] for r in runs["yoloaccum"]], [r["img_s"] for r in runs["ultralytics"]]
        bare = [r["bare_limit_img_s"] for r in runs["yoloaccum"]]
        ran_with = {
            name: {k: runs[name][0][k] for k in ("threads", "workers")} for name in ("yoloaccum", "ultralytics")
        }
        rows.append(
            {
                "model": model,
                "yoloaccum_img_s": median(ours),
                "ultralytics_img_s": median(theirs),
                "bare_limit_img_s": median(bare),
                "ratio": median(o / t for o, t in zip(ours, theirs)),
                "fraction_of_bare_limit": median(o / b for o, b in zip(ours, bare)),
                "ran_with": ran_with,
                "runs": runs,
            }
        )
    return rows


def accumulation_overhead(model: str, imgsz: int, micro: int, pairs: int) -> dict:
    """(d) Time per image at accumulate 8 against accumulate 1, on the same 8 micro-batches held in memory.

    Two engines, one per accumulate, take turns: one window of 8 micro-batches against 8 windows of 1. The overhead
    is the median over the pairs of their time ratio; the first pair warms up and is not counted, and the order
    within a pair alternates.
    """
    batches = on_device(make_batches(8, micro, imgsz))
    engines = {acc: engine_for(model, imgsz, micro, micro * acc, num_batches=8, epochs=pairs + 1) for acc in (1, 8)}
    times = {1: [], 8: []}
    for epoch in range(pairs + 1):
        for acc in (1, 8) if epoch % 2 else (8, 1):
            synchronize()
            start = time.perf_counter()
            engines[acc].train_epoch(epoch, [dict(b) for b in batches])
            synchronize()
            if epoch:
                times[acc].append(time.perf_counter() - start)
    images = 8 * micro
    return {
        "seconds_per_image_acc1": median(times[1]) / images,
        "seconds_per_image_acc8": median(times[8]) / images,
        "overhead": median(t8 / t1 for t1, t8 in zip(times[1], times[8])) - 1,
        "pairs": pairs,
    }


def data_pipeline(data: str, imgsz: int, micro: int, batches: int) -> float:
    """(e) Images/s of the training loader alone: augmentation on, workers and cache as in training, nothing
    consuming."""
    from yoloaccum.config import settings as config
    from yoloaccum.data import datasets as data_
    from yoloaccum.data.batches import build_loader

    cfg = config.resolve(
        overrides=dict(
            data=data,
            imgsz=imgsz,
            batch=micro,
            workers=TRAIN_ARGS["workers"],
            cache=TRAIN_ARGS["cache"],
            close_mosaic=0,
        )
    )
    dataset = data_.build_dataset(cfg, data_.load_spec(cfg.data), "train")
    it = iter(build_loader(dataset, cfg, micro, 0, 1, DEVICE))
    next(it)  # workers start
    start, seen = time.perf_counter(), 0
    for _, b in zip(range(batches), it):
        seen += b["img"].shape[0]
    return seen / (time.perf_counter() - start)


def peak_memory(
    model: str,
    imgsz: int,
    batch: int,
    nbs: int,
    steps: int,
    function: str = "train_from_memory",
    on: bool | None = None,
):
    """(c) Peak memory (MB) of a fresh process that trains `steps` micro-batches from memory at batch/nbs: CUDA's
    peak allocation on CUDA, the process's max RSS on the CPU. With function="checkpointing_probe" (g), also what
    that returned, as (MB, result)."""
    args = (model, imgsz, batch, nbs, steps) if on is None else (model, imgsz, batch, steps, on)
    proc = subprocess.Popen(command(function, *args), stdout=subprocess.PIPE)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # wait4 rather than wait: it also returns the child's max RSS
    assert status == 0, f"memory probe failed ({status})"
    result = json.loads(out.decode().strip().splitlines()[-1])
    cuda_bytes = result if on is None else result["cuda_bytes"]
    mb = cuda_bytes / 2**20 if cuda_bytes is not None else usage.ru_maxrss / 1024  # ru_maxrss: KiB on Linux
    return mb if on is None else (mb, result)


def grad_checkpointing(model: str, imgsz: int, batch: int, steps: int) -> dict:
    """(g) Peak memory at micro-batch 1 and `batch`, and images/s at `batch`, with and without grad_checkpointing,
    each in a fresh process. What training adds above the model's baseline is the peak at `batch` less that at 1."""
    out = {}
    for on in (False, True):
        peaks = {b: peak_memory(model, imgsz, b, b, steps, function="checkpointing_probe", on=on) for b in (1, batch)}
        out[f"grad_checkpointing={on}"] = {
            "peak_mb_batch_1": peaks[1][0],
            f"peak_mb_batch_{batch}": peaks[batch][0],
            "added_mb": peaks[batch][0] - peaks[1][0],
            "img_s": peaks[batch][1]["img_s"],
        }
    off, on = out["grad_checkpointing=False"], out["grad_checkpointing=True"]
    out.update(batch=batch, added_ratio=on["added_mb"] / off["added_mb"], speed_ratio=on["img_s"] / off["img_s"])
    return out


COMPILE_CONTENDERS = {  # (h): name -> the function run in a fresh process, and its arguments after the work
    "eager": ("yoloaccum_compiled", False),
    "static": ("yoloaccum_compiled", True, False),  # one graph per micro-batch size: what compile=True does
    "dynamic": ("yoloaccum_compiled", True, True),  # one graph with a dynamic batch dimension
    "ultralytics_eager": ("ultralytics_images_per_second", False),
    "ultralytics_compiled": ("ultralytics_images_per_second", True),
}


def compiled_against_eager(
    model: str,
    data: str,
    imgsz: int,
    epochs: int,
    fraction: float,
    repeats: int,
    contenders=tuple(COMPILE_CONTENDERS),
    cold: bool = True,
) -> dict:
    """(h) compile=True: yoloaccum eager, compiled with one graph per batch size (static) and with a dynamic batch
    size, and Ultralytics eager and compiled, on the same work, back to back in each repeat, each in a fresh process
    and, when cold, with an empty inductor cache (a first compile, as on a new machine). Images/s of the last epoch;
    the compile time (Ultralytics compiles inside its first epoch: its first epoch's time less its last's); and after
    how many epochs compiling pays off. `fraction` leaves a short last micro-batch, which yoloaccum trains and
    Ultralytics, compiled, drops. A contender that fails (a tracing strategy inductor cannot compile) is reported
    with its reason."""
    runs, failed = {name: [] for name in contenders}, {}
    trained = (model, data, imgsz, epochs, fraction)
    for _ in range(repeats):
        for name in contenders:
            function, *how = COMPILE_CONTENDERS[name]
            env = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()} if cold else None
            if name in failed:
                continue
            try:
                runs[name].append(fresh(function, *trained, *how, env=env))
            except RuntimeError as e:
                lines = str(e).splitlines()
                failed[name] = next((x for x in lines if x.startswith("warning: compile=")), lines[-1])[:400]
            print(f"(h) {name}: {runs[name][-1] if runs[name] else failed[name]}", file=sys.stderr, flush=True)
    if not runs["eager"]:
        raise RuntimeError(f"(h) eager training failed: {failed['eager']}")
    images = runs["eager"][0]["images"]
    for r in runs.get("ultralytics_compiled", []):  # its compile time: its first epoch's time beyond a steady one's
        first, last = r["epochs_img_s"][0], r["epochs_img_s"][-1]
        r["compile_s"] = max(r["images"] / first - r["images"] / last, 0.0)
    out = {
        name: {"img_s": median(r["img_s"] for r in rs), "compile_s": median(r.get("compile_s", 0.0) for r in rs)}
        if rs
        else {"failed": failed[name]}
        for name, rs in runs.items()
    }
    eager = [r["img_s"] for r in runs["eager"]]
    for name in ("static", "dynamic"):
        ours = [r["img_s"] for r in runs.get(name, [])]
        if not ours:
            continue
        out[name]["vs_eager"] = median(o / e for o, e in zip(ours, eager))
        if runs.get("ultralytics_compiled"):
            out[name]["vs_ultralytics_compiled"] = median(
                o / u["img_s"] for o, u in zip(ours, runs["ultralytics_compiled"])
            )
        saved = images / out["eager"]["img_s"] - images / out[name]["img_s"]  # seconds an epoch
        out[name]["pays_off_after_epochs"] = out[name]["compile_s"] / saved if saved > 0 else None
    out.update(model=model, imgsz=imgsz, images_per_epoch=images, epochs=epochs, repeats=repeats, cold=cold, runs=runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a few iterations of each, to check the scripts run")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each comparison (default 5)")
    parser.add_argument("--compile-only", action="store_true", help="section (h) alone, printed, not written")
    args = parser.parse_args()
    smoke = args.smoke
    if args.compile_only:
        h = compiled_against_eager("yolo26n.yaml", str(shapes_data(None, False)), 160, 2, 0.99, 1)
        print(json.dumps(h, indent=1), "\n".join(compile_markdown(h)), sep="\n")
        return
    imgsz, micro = 64 if smoke else 160, TRAIN_ARGS["batch"]
    models = (TINY_MODEL,) if smoke else ("yolo26n.yaml", "yolo11n.yaml")
    data = str(shapes_data(tempfile.mkdtemp() if smoke else None, smoke))
    repeats = 1 if smoke else args.repeats
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if CUDA else None,
        },
        "settings": {
            **TRAIN_ARGS,
            "imgsz": imgsz,
            "batch": micro,
            "amp": AMP,
            "data": SHAPES_YAML,
            "repeats": repeats,
            "smoke": smoke,
        },
    }
    report["vs_ultralytics"] = throughput(
        models, data, imgsz, repeats, epochs=2, fraction=0.25 if smoke else 1.0, iterations=4 if smoke else 40
    )
    steps = 4 if smoke else 16
    configs = ((micro, 64), (micro, micro), (64, 64))
    report["memory_mb"] = {f"batch={b} nbs={n}": peak_memory(models[0], imgsz, b, n, steps) for b, n in configs}
    # yolo26n also in the smoke: what micro-batch 8 adds to the peak must stand clear of RSS noise (tiny26: 7 MB)
    report["grad_checkpointing"] = grad_checkpointing("yolo26n.yaml", imgsz, 8 if smoke else 32, 2 if smoke else 8)
    report["accumulation"] = accumulation_overhead(models[0], imgsz, micro, pairs=2 if smoke else 12)
    report["data_pipeline_img_s"] = data_pipeline(data, imgsz, micro, 4 if smoke else 64)
    if smoke:  # on tests/test_compile.py's shapes (8 and 4), whose compiled graphs it shares
        report["compile"] = compiled_against_eager(models[0], data, imgsz, 2, 0.92, 1, ("eager", "static"), cold=False)
    else:  # a cold compile of yolo26n takes minutes on two cores: one repeat
        report["compile"] = compiled_against_eager(models[0], data, imgsz, 2, 0.99, 1)
    print(json.dumps(report, indent=1))
    if not smoke:
        (HERE / "results.json").write_text(json.dumps(report, indent=1))
        (HERE / "results.md").write_text(markdown(report))
    print(markdown(report))


def markdown(r: dict) -> str:
    s, m, rows = r["settings"], r["machine"], r["vs_ultralytics"]
    where = f"{m['cuda']}, AMP" if m["cuda"] else f"{m['cores']} CPU cores ({m['cpu']}), fp32"
    lines = [
        f"Measured by `make bench` on {where}; torch {m['torch']}, Python {m['python']}. Both trainers: imgsz "
        f"{s['imgsz']}, batch {s['batch']}, nbs {s['nbs']}, workers {s['workers']}, cache {s['cache']}, no "
        f"warmup, images/s of the second epoch. Median of {s['repeats']} repeats, each running every contender "
        "back to back, each in a fresh process; ratios are taken within a repeat. The bare limit is measured in "
        "yoloaccum's process, on its model and the loader's batches held in memory, just before and just after "
        "the measured epoch (the mean of the two).",
        "",
        "| model | yoloaccum img/s | Ultralytics img/s | ratio | bare limit img/s | share of the bare limit |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['yoloaccum_img_s']:.1f} | {row['ultralytics_img_s']:.1f} | "
            f"{row['ratio']:.2f}x | {row['bare_limit_img_s']:.1f} | "
            f"{row['fraction_of_bare_limit']:.0%} |"
        )
    ran = rows[0]["ran_with"]
    lines += [
        "",
        f"They ran with: yoloaccum {ran['yoloaccum']['threads']} torch threads and "
        f"{ran['yoloaccum']['workers']} workers; Ultralytics {ran['ultralytics']['threads']} torch thread(s) "
        f"and {ran['ultralytics']['workers']} workers (its trainer picks these itself on the CPU).",
    ]
    mem, acc = r["memory_mb"], r["accumulation"]
    keys = list(mem)
    lines += ["", "| peak memory (max RSS on the CPU, peak allocated on CUDA) | MB |", "| --- | --- |"]
    lines += [f"| {k} | {v:.0f} |" for k, v in mem.items()]
    lines += [
        "",
        f"batch {s['batch']} nbs 64 against nbs {s['batch']}: {mem[keys[0]] / mem[keys[1]]:.2f}x; "
        f"against batch 64: {mem[keys[0]] / mem[keys[2]]:.2f}x.",
        f"Accumulation overhead (time per image at accumulate 8 against 1, median of {acc['pairs']} pairs): "
        f"{acc['overhead']:+.1%}.",
        f"Data pipeline alone: {r['data_pipeline_img_s']:.0f} img/s with augmentation, "
        f"{r['data_pipeline_img_s'] / rows[0]['yoloaccum_img_s']:.0f}x what training at "
        f"{rows[0]['yoloaccum_img_s']:.0f} img/s consumes.",
    ]
    g = r["grad_checkpointing"]
    off, on = g["grad_checkpointing=False"], g["grad_checkpointing=True"]
    lines += [
        "",
        f"| micro-batch {g['batch']} (peak: max RSS on the CPU, peak allocated on CUDA) | peak at 1, MB | "
        f"peak at {g['batch']}, MB | added, MB | img/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    big = f"peak_mb_batch_{g['batch']}"
    for name, row in (("without grad_checkpointing", off), ("grad_checkpointing=True", on)):
        lines.append(
            f"| {name} | {row['peak_mb_batch_1']:.0f} | {row[big]:.0f} | {row['added_mb']:.0f} | {row['img_s']:.1f} |"
        )
    lines += [
        "",
        f"grad_checkpointing: {g['added_ratio']:.2f}x the memory training adds at micro-batch {g['batch']}, "
        f"at {g['speed_ratio']:.2f}x the images/s.",
    ]
    return "\n".join(lines + compile_markdown(r["compile"])) + "\n"


def compile_markdown(h: dict) -> list[str]:
    """(h) as a table: images/s of the last epoch, compile time, ratios and the epochs after which it pays."""
    short = ", the last micro-batch short" if h["images_per_epoch"] % TRAIN_ARGS["batch"] else ""
    lines = [
        "",
        f"compile=True ({h['model']}, {h['imgsz']} px, {h['images_per_epoch']} images an epoch{short}; "
        f"{h['epochs']} epochs, images/s of the last; {h['repeats']} repeat(s); "
        f"{'a cold inductor cache' if h['cold'] else 'a warm inductor cache'}):",
        "",
        "| run | img/s | compile s | vs eager | vs Ultralytics compiled | pays off after (epochs) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("eager", "static", "dynamic", "ultralytics_eager", "ultralytics_compiled"):
        row = h.get(name)
        if row is None:
            continue
        if "failed" in row:
            lines.append(f"| {name} | failed: {row['failed']} | | | | |")
            continue
        pays = row.get("pays_off_after_epochs", "")
        pays = "never (slower)" if name in ("static", "dynamic") and pays is None else pays
        pays = f"{pays:.1f}" if isinstance(pays, float) else pays
        ratios = [f"{row[k]:.2f}x" if k in row else "" for k in ("vs_eager", "vs_ultralytics_compiled")]
        lines.append(f"| {name} | {row['img_s']:.1f} | {row['compile_s']:.0f} | {ratios[0]} | {ratios[1]} | {pays} |")
    return lines


if __name__ == "__main__":
    main()
