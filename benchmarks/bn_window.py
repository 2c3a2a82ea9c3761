"""What bn=window costs: the engine's images/s against bn=batch, side by side in one process.

    python benchmarks/bn_window.py            # yolo26n at 160 px, micro-batches of 2 and 8, nbs 64
    python benchmarks/bn_window.py --smoke    # a window at 64 px on the tests' tiny model, for the test suite
    python benchmarks/bn_window.py --imgsz 640 --micro 2 8 --windows 1 --repeats 3   # other sizes: printed only
    python benchmarks/bn_window.py --compile  # every model compiled as compile=True compiles it: printed only
    python benchmarks/bn_window.py --study --imgsz 320 --micro 2 4 --repeats 3   # and the fine-tuning study's other
                                              # modes, bn=frozen and freeze=11 (docs/finetuning.md): printed only

On a CUDA machine it runs on cuda:0 with AMP, as the trainer would (docs/batchnorm.md has an H200's rows).

Each engine trains the same in-memory batches through Engine.train_epoch, whole windows and their steps, bn=window's
statistics pass included: bn=batch, bn=window (the pass over all the window's images) and bn=window with
bn_window=16 (the pass over its first 16); with --study also bn=frozen and bn=window with freeze=11 (layers 0-10
without gradients), the fine-tuning study's other configurations. Their repetitions alternate, so a slow spell of
the machine falls on all, and the median of the repetitions is reported. Each bn=window cost beyond 1 is split in
two, as parts of bn=batch's time per image: the statistics pass, timed on its own, and the rest, by subtraction (the
micro-steps' renormalisation and whatever else differs, noise included). Writes benchmarks/bn_window.{md,json} (not
with --smoke).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# name: the settings each engine trains with (bn_window: the images bn=window's pass takes, 0 all of them)
MODES = {
    "batch": {"bn": "batch"},
    "window": {"bn": "window", "bn_window": 0},
    "window, bn_window=16": {"bn": "window", "bn_window": 16},
}


def study_modes(backbone: int) -> dict[str, dict]:
    """--study: the fine-tuning study's other configurations below 8 (fidelity_finetune.CONFIGS): bn=frozen, and the
    backbone frozen at the defaults, which take bn=window there."""
    return {
        "frozen": {"bn": "frozen"},
        f"window, freeze={backbone}": {**MODES["window"], "freeze": backbone},
    }


def measure(
    micro: int,
    imgsz: int,
    windows: int,
    repeats: int,
    model: str = "yolo26n.yaml",
    compiled: bool = False,
    study: bool = False,
    backbone: int | None = None,
) -> dict:
    """Images/s of each mode over the same windows; compiled: each model compiled as compile=True compiles it;
    study: study_modes(backbone) too (by default yolo26's, common.BACKBONE)."""
    from common import BACKBONE, DEVICE, engine_for, make_batches, on_device, synchronize

    from yoloaccum.batchnorm import window as norm
    from yoloaccum.model import compiler, freeze
    from yoloaccum.model.build import set_bn_mode

    nbs = 64
    per_window = max(1, nbs // micro)
    engines, passes, bn_modes = {}, {}, {}
    for mode, s in {**MODES, **(study_modes(backbone or BACKBONE) if study else {})}.items():
        e = engine_for(model, imgsz, batch=micro, nbs=nbs, num_batches=per_window * windows, freeze=s.get("freeze"))
        frozen = freeze.prefixes(s.get("freeze"))
        bn_modes[mode] = s["bn"], frozen  # set after each model.train(), as the trainer does
        set_bn_mode(e.raw_model, *bn_modes[mode])  # before compiling: the mode is part of the graph
        if s["bn"] == "window":
            norm.convert(e.raw_model, frozen)
            e.window_statistics = passes[mode] = Timed(norm.WindowStatistics(e.raw_model, s["bn_window"], amp=e.amp))
        graphs = [micro]
        if (
            compiled
            and compiler.compile_model(e.raw_model, "default", graphs, imgsz, DEVICE, e.autocast_dtype, print) is None
        ):
            raise SystemExit("bn_window --compile: the model did not compile (the warning above says why)")
        engines[mode] = e
    batches = on_device(make_batches(per_window * windows, micro, imgsz, seed=0))
    num_images = len(batches) * micro
    rates = {mode: [] for mode in engines}
    pass_seconds = {mode: [] for mode in passes}  # per image, each repetition
    for r in range(repeats + 1):  # the first repetition warms up and is not counted
        for mode, e in engines.items():
            e.raw_model.train()
            set_bn_mode(e.raw_model, *bn_modes[mode])
            if mode in passes:
                passes[mode].seconds = 0.0
            synchronize()
            start = time.perf_counter()
            e.train_epoch(0, [dict(b) for b in batches])
            synchronize()
            if r:
                rates[mode].append(num_images / (time.perf_counter() - start))
                if mode in passes:
                    pass_seconds[mode].append(passes[mode].seconds / num_images)
    medians = {mode: statistics.median(v) for mode, v in rates.items()}
    cost = {mode: medians["batch"] / medians[mode] for mode in engines if mode != "batch"}
    # the pass's part of each cost, in bn=batch's time per image; what is left of the cost is the rest's
    pass_part = {mode: statistics.median(v) * medians["batch"] for mode, v in pass_seconds.items()}
    return {
        "micro_batch": micro,
        "imgsz": imgsz,
        "compiled": compiled,
        "images_per_second": medians,
        "cost": cost,
        "pass_part": pass_part,
        "repeats": rates,
    }


class Timed:
    """A statistics pass that adds up the time it takes. The device is synchronised around it, so on a GPU the pass no
    longer overlaps the micro-steps' queued work: two synchronisations a window, which bn=batch does not pay."""

    def __init__(self, run):
        self.run, self.seconds = run, 0.0

    def __call__(self, batches: list[dict]) -> None:
        from common import synchronize

        synchronize()
        start = time.perf_counter()
        self.run(batches)
        synchronize()
        self.seconds += time.perf_counter() - start


def split(row: dict, mode: str) -> str:
    """A bn=window mode's cost beyond bn=batch's time per image, in two parts: its statistics pass, and the rest."""
    part = row["pass_part"].get(mode)
    if part is None:  # no statistics pass: nothing to split
        return "no pass"
    return f"pass +{part:.2f}, rest {row['cost'][mode] - 1 - part:+.2f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--imgsz", type=int, default=160)
    p.add_argument("--micro", type=int, nargs="+", default=[2, 8], help="micro-batches to measure")
    p.add_argument("--windows", type=int, default=1, help="windows of nbs 64 images per repetition")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="compile each model as compile=True does (printed only)")
    p.add_argument("--study", action="store_true", help="bn=frozen and freeze=11 too (printed only)")
    args = p.parse_args()
    measured = ("imgsz", "micro", "windows", "repeats", "compile", "study")
    default = all(getattr(args, k) == p.get_default(k) for k in measured)
    if args.smoke:
        from common import TINY_MODEL

        # a window of each mode, that it runs; the tiny model has 5 layers, so --study's freeze= takes 2
        rows = [measure(8, 64, windows=1, repeats=1, model=TINY_MODEL, study=True, backbone=2)]
    else:
        rows = [
            measure(micro, args.imgsz, args.windows, args.repeats, compiled=args.compile, study=args.study)
            for micro in args.micro
        ]
    for r in rows:
        ips = r["images_per_second"]
        costs = ", ".join(f"bn={m} {ips[m]:.1f} img/s ({c:.3f}x: {split(r, m)})" for m, c in r["cost"].items())
        print(f"micro-batch {r['micro_batch']}: bn=batch {ips['batch']:.1f} img/s, {costs}", flush=True)
    if args.smoke or not default:  # the report is of the default measurement only
        return
    (HERE / "bn_window.json").write_text(json.dumps(rows, indent=1))
    others = [m for m in MODES if m != "batch"]
    lines = [
        "# The cost of bn=window (`python benchmarks/bn_window.py`)",
        "",
        "yolo26n at 160 px, nbs 64, synthetic batches in memory, Engine.train_epoch over whole windows "
        "(bn=window's statistics pass included); the modes alternate, 5 repetitions each after a warm-up, "
        "median. The 2-core CPU machine, nothing else running. Cost: time per image against bn=batch; beyond 1, "
        "the statistics pass's part (timed) and the rest (by subtraction: the micro-steps' renormalisation, noise "
        "included), in bn=batch's time.",
        "",
        "| micro-batch | bn=batch img/s | " + " | ".join(f"bn={m} img/s | cost" for m in others) + " |",
        "| --- | --- | " + " | ".join("--- | ---" for _ in others) + " |",
    ]
    for r in rows:
        ips, c = r["images_per_second"], r["cost"]
        cells = " | ".join(f"{ips[m]:.1f} | {c[m]:.3f}x ({split(r, m)})" for m in others)
        lines.append(f"| {r['micro_batch']} | {ips['batch']:.1f} | {cells} |")
    (HERE / "bn_window.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(HERE))
    main()
