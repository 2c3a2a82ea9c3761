"""Fine-tuning at small micro-batches: from the pretrained checkpoint (make pretrain), on real photographs, each way
of training against a real batch of 64 and against Ultralytics' trainer at the same micro-batch, over paired seeds.

    python benchmarks/fidelity_finetune.py                   # each set's PLANNED configurations: BCCD seeds 0-4,
                                                             # aquarium 0-2 at 20 and 40 epochs (hours)
    python benchmarks/fidelity_finetune.py --data bccd --seeds 0 1 --configs b64 b2 b2-batch
    python benchmarks/fidelity_finetune.py --report          # rewrite the reports from the kept runs
    python benchmarks/fidelity_finetune.py --smoke           # a tiny checkpoint and set, into a temporary folder

Each run trains in a fresh process (fidelity.py's train_and_evaluate), then its final EMA is validated with the
BatchNorm statistics it trained with and with precise ones (precise_bn's, frozen layers kept). Finished runs are kept in
benchmarks/records/finetune/<data>.json, keyed by the checkpoint's SHA-256 and the settings, so the study goes on where
it stopped, seed by seed (a stopped study still has complete pairs), and never mixes runs of another checkpoint; the
report of each checkpoint's runs is <data>-<its SHA-256's first 12>.md beside it. Cost per image is each run's training
and validation seconds over the images it trained, one run at a time on the same machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import fresh  # noqa: E402
from common import BACKBONE, TINY_MODEL  # noqa: E402
from fidelity import METRICS, SHARED_SETS, paired  # noqa: E402

from yoloaccum.core.schedule import BN_AUTO_BELOW, PRECISE_BN_FROM_WEIGHTS, bn_mode, precise_bn_count  # noqa: E402

# As many images as precise BatchNorm recomputes over from scratch: most of BCCD's 292, more than half aquarium's 448
ADAPT_IMAGES = 256
# name: (trainer, settings beyond the recipe); the order is the order a seed's runs are made in, most telling first
CONFIGS = {
    "b64": ("yoloaccum", {"batch": 64}),
    "b2": ("yoloaccum", {"batch": 2}),
    "b2-batch": ("yoloaccum", {"batch": 2, "bn": "batch"}),
    "ultralytics-b2": ("ultralytics", {"batch": 2}),
    "b4": ("yoloaccum", {"batch": 4}),
    "b8": ("yoloaccum", {"batch": 8}),
    "b2-frozen": ("yoloaccum", {"batch": 2, "bn": "frozen"}),
    # frozen statistics adapted to the new data once, before the first step, over ADAPT_IMAGES images (issue 61)
    "b2-adapt": ("yoloaccum", {"batch": 2, "bn": "frozen", "bn_adapt": ADAPT_IMAGES}),
    "b2-freeze": ("yoloaccum", {"batch": 2, "freeze": BACKBONE}),
    "b2-window": ("yoloaccum", {"batch": 2, "bn": "window"}),
    # bn=window's pass capped at the window's first 16 images: cheaper (benchmarks/bn_window.py), no longer exact
    "b2-window16": ("yoloaccum", {"batch": 2, "bn": "window", "bn_window": 16}),
    "b4-batch": ("yoloaccum", {"batch": 4, "bn": "batch"}),
    "b4-window": ("yoloaccum", {"batch": 4, "bn": "window"}),
    "b4-frozen": ("yoloaccum", {"batch": 4, "bn": "frozen"}),
    "b4-adapt": ("yoloaccum", {"batch": 4, "bn": "frozen", "bn_adapt": ADAPT_IMAGES}),
    "b4-freeze": ("yoloaccum", {"batch": 4, "freeze": BACKBONE}),
    "ultralytics-b4": ("ultralytics", {"batch": 4}),
    "ultralytics-b8": ("ultralytics", {"batch": 8}),
}
REFERENCE = "b64"
# What `make fidelity-finetune` makes on each set (the rest of CONFIGS on --configs): issue 61's comparison at 2 and 4
# images per device (adapted and plain bn=frozen against the default, bn=batch, the real batch of 64 and `yolo train`)
# and the README's row at 8; on aquarium-40 the modes at 2 and the real batch, what it decides for aquarium.
# b2-window and b4-window are the default's runs (twins) while bn=auto takes bn=window there.
STUDY = [
    *("b64", "b2", "b2-frozen", "b2-adapt", "b4", "b4-frozen", "b4-adapt", "b2-batch", "b4-batch"),
    *("ultralytics-b2", "ultralytics-b4", "b8", "ultralytics-b8"),
]
PLANNED = {"bccd": STUDY, "aquarium": STUDY, "aquarium-40": ["b2", "b2-adapt", "b2-frozen", "b64"]}
# Fine-tuning is shorter than training from scratch; the sizes keep a run to minutes on 2 CPU cores.
SIZES = {
    "bccd": {"dataset": "bccd", "imgsz": 256, "epochs": 20, "images": 292, "seeds": [0, 1, 2, 3, 4]},
    "aquarium": {"dataset": "aquarium", "imgsz": 320, "epochs": 20, "images": 448, "seeds": [0, 1, 2]},
    # 20 epochs (140 optimizer steps at nbs 64) leave aquarium near mAP50-95 0.05, where a ratio is a small absolute
    # gap: the same set at twice the schedule, its runs and report apart (aquarium-40.json)
    "aquarium-40": {"dataset": "aquarium", "imgsz": 320, "epochs": 40, "images": 448, "seeds": [0, 1, 2]},
}
# A set whose longer schedule decides the rule for it, mode by mode, once the longer one has runs of the mode: at 20
# epochs aquarium's ratios rest on gaps of a few thousandths (SIZES)
DECIDES_FOR = {"aquarium-40": "aquarium"}
SMOKE = {"images": 16, "val_images": 8, "imgsz": 64, "epochs": 1}
RECORDS = HERE / "records/finetune"


def checkpoint_for(smoke: bool, work: Path, given: Path | None = None) -> tuple[Path, str]:
    """The checkpoint runs start from and its SHA-256: make pretrain's (or one given, for a pilot), or for the smoke
    a tiny model's weights."""
    import pretrain

    if given is not None:
        return given, pretrain.sha256(given)
    if not smoke:
        path = pretrain.ensure()
        return path, pretrain.sha256(path)
    import torch
    from ultralytics import YOLO  # offline: common imported yoloaccum.config.ultra first

    torch.manual_seed(0)
    path = work / "tiny.pt"
    YOLO(TINY_MODEL).save(path)
    return path, pretrain.sha256(path)


def resolved(name: str) -> dict:
    """A configuration's settings with bn=auto resolved as a run from weights resolves it today: two names that
    resolve alike (b2, the shipped default, and whichever mode bn=auto takes) are one run, made once a seed, and a
    kept run made under another default moves to the name of what it trained (move_stale)."""
    trainer, settings = CONFIGS[name]
    if trainer != "yoloaccum":
        return {"trainer": trainer, **settings}
    return {"trainer": trainer, **settings, "bn": bn_mode(settings.get("bn", "auto"), settings["batch"])}


def settings_of(name: str, run: dict) -> dict:
    """What a kept run trained: its resolved settings, or for a run kept before they were (the pilot's), what bn=auto
    took then: bn=window below 8 images per device, by micro-batch alone."""
    if "resolved" in run:
        return run["resolved"]
    trainer, settings = CONFIGS[name]
    if trainer != "yoloaccum" or settings.get("bn", "auto") != "auto":
        return {"trainer": trainer, **settings}
    return {"trainer": trainer, **settings, "bn": "window" if settings["batch"] < 8 else "batch"}


def move_stale(record: dict, seed: int) -> None:
    """Runs of this seed made under another default (b2's bn=batch runs, once bn=auto takes bn=window) leave the
    configuration they were made for, for the one that names what they trained (b2-batch), where it holds no run of
    its own; the copies that pointed at them follow. A run no configuration names is kept aside as superseded.
    Nothing is dropped, and nothing is trained again."""
    runs, key = record["runs"], str(seed)
    for name in list(runs):
        stale = runs[name].get(key)
        if name not in CONFIGS or stale is None or settings_of(name, stale) == resolved(name):
            continue
        del runs[name][key]
        if "same_run_as" in stale:  # a copy of another's run: made again from it, if still its twin
            continue
        trained = settings_of(name, stale)
        stale = {**stale, "resolved": trained}
        # a configuration naming what it trained, holding no run of its own for the seed (none, or a copy)
        home = next((o for o in CONFIGS if resolved(o) == trained and not own(runs, o, key)), None)
        if home:
            runs.setdefault(home, {})[key] = stale
        else:
            record.setdefault("superseded", {}).setdefault(name, {}).setdefault(key, []).append(stale)
        for other in runs:  # copies of it now copy it from its new home, or go
            if runs[other].get(key, {}).get("same_run_as") == name:
                del runs[other][key]
                if home:
                    runs[other][key] = {**stale, "same_run_as": home}


def own(runs: dict, name: str, key: str) -> bool:
    """Whether configuration `name` holds a run of its own for seed `key` (not a copy of another's)."""
    run = runs.get(name, {}).get(key)
    return run is not None and "same_run_as" not in run


def kept(record: dict, name: str, seed: int) -> bool:
    """Whether a run of configuration `name` is kept for this seed: its own, or (taken as a copy) the run of another
    configuration that resolves alike. Call move_stale first, so that every run kept is current for its name."""
    runs, key, want = record["runs"], str(seed), resolved(name)
    for other in [name, *runs]:
        run = runs.get(other, {}).get(key)
        if other in CONFIGS and run is not None and settings_of(other, run) == want:
            if other != name:
                runs.setdefault(name, {})[key] = {**run, "same_run_as": run.get("same_run_as", other)}
            return True
    return False


def to_make(record: dict, configs: list[str], seeds: list[int]) -> list[tuple[int, str]]:
    """The runs the store does not hold, (seed, configuration) in the order the study makes them; two configurations
    that resolve alike (b2 and its twin) are one run."""
    todo = []
    for seed in seeds:
        for name in configs:
            if not kept(record, name, seed) and all((s, resolved(c)) != (seed, resolved(name)) for s, c in todo):
                todo.append((seed, name))
    return todo


def cost_per_image(run: dict, size: dict) -> float:
    return run["seconds"] / (size["images"] * size["epochs"])


def time_left(saved: dict, todo: list[tuple[int, str]], size: dict) -> tuple[float, int]:
    """Seconds the runs `todo` (seed, configuration) should take on this set, each at its configuration's pace on the
    latest day it ran (of any checkpoint's runs in `saved`, which paces() fills: the cost is the settings', and the
    machine's speed varies by day), and how many have no kept run to go by."""
    paces = {}
    for name in {config for _, config in todo}:
        mine = [r for rec in saved.values() for r in rec["runs"].get(name, {}).values() if "same_run_as" not in r]
        latest = max((r.get("day") or "" for r in mine), default=None)
        if latest is not None:
            paces[name] = statistics.median(cost_per_image(r, size) for r in mine if (r.get("day") or "") == latest)
    seconds = sum(paces[c] * size["images"] * size["epochs"] for _, c in todo if c in paces)
    return seconds, sum(c not in paces for _, c in todo)


def paces(out: Path, name: str, size: dict, saved: dict) -> dict:
    """The runs that pace set `name`'s estimate (time_left): its own (`saved`), and for each configuration it has no
    run of, those of the other sets of its photographs at its image size (aquarium's for aquarium-40), under keys of
    their own, each run's seconds scaled to `name`'s images and epochs (`size`). A run's cost per image and epoch is
    about the same at another schedule: aquarium-40's first run took 1.13x aquarium's runs of that day, scaled."""
    own = {config for record in saved.values() for config, held in record["runs"].items() if held}
    borrowed = {}
    for other, theirs in SIZES.items():
        store = out / f"{other}.json"
        if other == name or (theirs["dataset"], theirs["imgsz"]) != (size.get("dataset"), size["imgsz"]):
            continue
        scale = size["images"] * size["epochs"] / (theirs["images"] * theirs["epochs"])
        for key, record in json.loads(store.read_text()).items() if store.exists() else []:
            runs = {
                c: {s: {**r, "seconds": r["seconds"] * scale} for s, r in held.items()}
                for c, held in record["runs"].items()
                if c not in own
            }
            borrowed[f"{other} {key}"] = {**record, "runs": runs}
    return {**borrowed, **saved}


def cost_cell(runs: dict, name: str, other: str, have: list[int], size: dict, seeds: list[int]) -> str:
    """A configuration's ms per image (the median over its seeds `have`) and its ratio to `other`'s (cost_ratio). No
    ratio to itself or its twin."""
    ms = statistics.median(cost_per_image(runs[name][str(s)], size) for s in have) * 1000
    ratio, same_day = cost_ratio(runs, name, other, have, size, seeds)
    if ratio is None:
        return f"{ms:.0f}"
    return f"{ms:.0f} ({ratio:.2f}x{', same day' if same_day else ''})"


def cost_ratio(
    runs: dict, name: str, other: str, have: list[int], size: dict, seeds: list[int]
) -> tuple[float | None, bool]:
    """`name`'s cost per image over `other`'s, and whether it compares runs of one day. The machine's speed varies
    from day to day, so where both have runs of one day the ratio is the median over those days of each day's ratio
    of medians (it may rest on fewer runs than `have`), else that of the seeds both have (runs kept before the record
    stored their day have none). None for itself, its twin, or no runs to compare."""
    mine = [runs[name][str(s)] for s in have]
    held = runs.get(other, {})
    if other == name or all(str(s) in held and same_run(runs, name, other, s) for s in have):
        return None, False
    theirs = [r for s, r in held.items() if int(s) in seeds]

    def median_cost(of: list[dict]) -> float:
        return statistics.median(cost_per_image(r, size) for r in of)

    days = ({r.get("day") for r in mine} & {r.get("day") for r in theirs}) - {None}
    if days:
        ratio = statistics.median(
            median_cost([r for r in mine if r.get("day") == day])
            / median_cost([r for r in theirs if r.get("day") == day])
            for day in days
        )
        return ratio, True
    both = [s for s in have if str(s) in held]
    if not both:
        return None, False
    return median_cost([runs[name][str(s)] for s in both]) / median_cost([runs[other][str(s)] for s in both]), False


def shipped(name: str) -> str:
    """Which of a run's figures its trainer gives a user at its defaults: the final EMA as trained, or with precise
    statistics where precise_bn=auto recomputes them for a run from weights (schedule.PRECISE_BN_FROM_WEIGHTS; it does
    not today). The runs train with precise_bn=0 and are measured both ways, so either default reads the same runs;
    Ultralytics has no recompute."""
    return "precise" if CONFIGS[name][0] == "yoloaccum" and PRECISE_BN_FROM_WEIGHTS else "raw"


def versus(runs: dict, name: str, other: str, seeds: list) -> dict | None:
    """`name`'s final mAP50-95 as shipped against `other`'s over the `seeds` both have: paired()'s difference and
    interval, and the ratio of their means (None where `other`'s is 0); None where they share no seed."""
    both = [str(s) for s in seeds if str(s) in runs.get(name, {}) and str(s) in runs.get(other, {})]
    if not both or other not in CONFIGS:
        return None
    ours, theirs = ([runs[c][s][shipped(c)][METRICS[1]] for s in both] for c in (name, other))
    ratio = statistics.fmean(ours) / statistics.fmean(theirs) if statistics.fmean(theirs) else None
    return {**paired(ours, theirs), "ratio": ratio}


def spread(d: dict) -> str:
    """paired()'s difference with its 95% interval where there is one (2 pairs or more)."""
    return f"{d['mean']:+.3f}" + ("" if d["low"] is None else f" [{d['low']:+.3f}, {d['high']:+.3f}]")


def report(runs: dict, size: dict, seeds: list[int], record: dict, data: str = "shapes") -> str:
    """A row per configuration with runs: final mAP50-95 per seed as its trainer ships it, ratios and paired
    differences against the real batch of 64, against Ultralytics' trainer at the same micro-batch and against
    yoloaccum's defaults at the same micro-batch (the BatchNorm policy's question), and the cost per image with its
    ratio to the defaults'."""

    def f(x):
        return "–" if x is None else f"{x:+.3f}"

    def values(name: str, variant: str, keep: list[int]) -> list[float]:
        return [runs[name][str(s)][variant][METRICS[1]] for s in keep]

    lines = [
        f"# Fine-tuning from {record['checkpoint']} on {size.get('dataset', 'shapes')} "
        f"(`python benchmarks/fidelity_finetune.py --data {data}`)",
        "",
        f"yolo26n pretrained on hardhat ({record['checkpoint']}, SHA-256 {record['sha256'][:12]}), fine-tuned "
        f"{size['epochs']} epochs at {size['imgsz']} px, nbs 64, warmup 1, close_mosaic 5. mAP50-95 of the final EMA "
        "as each trainer ships it at its defaults ("
        + (
            "yoloaccum's with precise statistics, "
            if PRECISE_BN_FROM_WEIGHTS
            else "as trained: precise_bn=auto recomputes nothing from weights; "
        )
        + "Ultralytics has no recompute) and, "
        f"in brackets, with BatchNorm statistics recomputed over {size['precise_images']} training images (frozen "
        "layers keep theirs). "
        "Paired differences over the seeds both have, 95% t interval. Cost: seconds of training and validation per "
        "training image, one run at a time on the 2-core CPU machine, the median over a configuration's seeds; the "
        "machine's speed varies from day to day, so the ratio compares runs of one day where both have some (\"same "
        'day"), and is rough where it does not.',
        "",
        "| run | seeds | mAP50-95 per seed | mean (recomputed) | vs b64: ratio, paired diff [95%] "
        "| vs Ultralytics same batch: ratio, paired diff [95%] | vs defaults same batch: ratio, paired diff [95%] "
        "| ms per image (vs defaults) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in CONFIGS:
        have = [s for s in seeds if str(s) in runs.get(name, {})]
        if not have:
            continue
        mine, recomputed = values(name, shipped(name), have), values(name, "precise", have)
        cells = []
        batch = CONFIGS[name][1]["batch"]
        for other in (REFERENCE, f"ultralytics-b{batch}", f"b{batch}"):
            both = [s for s in have if str(s) in runs.get(other, {})]
            if name == other or not both or other not in CONFIGS:
                cells.append("–")
                continue
            if all(same_run(runs, name, other, s) for s in both):
                cells.append("the same runs")
                continue
            d = versus(runs, name, other, both)
            ratio = float("nan") if d["ratio"] is None else d["ratio"]
            cells.append(f"{ratio:.2f}, {f(d['mean'])} [{f(d['low'])}, {f(d['high'])}] ({len(both)})")
        ms_cell = cost_cell(runs, name, f"b{batch}", have, size, seeds)
        twins = {runs[name][str(s)].get("same_run_as") for s in have} - {None}
        label = f"{name} (the runs of {', '.join(sorted(twins))})" if twins else name
        lines.append(
            f"| {label} | {','.join(map(str, have))} | {' '.join(f'{v:.3f}' for v in mine)} "
            f"| {statistics.fmean(mine):.3f} ({statistics.fmean(recomputed):.3f}) "
            f"| {cells[0]} | {cells[1]} | {cells[2]} | {ms_cell} |"
        )
    return "\n".join(lines + modes_pooled(runs, seeds) + precise_bn_effect(runs, seeds)) + "\n"


# the BatchNorm policy's questions: each mode against bn=batch, bn=frozen, the cheap one, against bn=window, and
# bn=frozen adapted (bn_adapt) against frozen as it is and the modes whose statistics train
POOLED = (
    ("window", "batch"),
    ("frozen", "batch"),
    ("frozen", "window"),
    ("adapt", "frozen"),
    ("adapt", "window"),
    ("adapt", "batch"),
)


def modes_pooled(runs: dict, seeds: list[int]) -> list[str]:
    """Each pair of BatchNorm modes in POOLED, paired by seed and micro-batch, pooled over the micro-batches below
    BN_AUTO_BELOW that both have: the BatchNorm policy's question, on more pairs than one micro-batch gives."""
    out = [
        "",
        "## BatchNorm modes against each other, pooled over micro-batches",
        "",
        "Paired by seed and micro-batch, as each trainer ships it; 95% t interval.",
        "",
        "| modes | micro-batches | pairs | difference [95%] |",
        "| --- | --- | --- | --- |",
    ]
    for mode, other in POOLED:
        ours, theirs, batches = [], [], []
        for micro in range(1, BN_AUTO_BELOW):
            name, against = f"b{micro}-{mode}", f"b{micro}-{other}"
            both = [str(s) for s in seeds if str(s) in runs.get(name, {}) and str(s) in runs.get(against, {})]
            if name in CONFIGS and against in CONFIGS and both:
                batches.append(str(micro))
                ours += [runs[name][s][shipped(name)][METRICS[1]] for s in both]
                theirs += [runs[against][s][shipped(against)][METRICS[1]] for s in both]
        if ours:
            modes = f"{mode_name(mode)} − {mode_name(other)}"
            out.append(f"| {modes} | {', '.join(batches)} | {len(ours)} | {spread(paired(ours, theirs))} |")
    return out


def mode_name(mode: str) -> str:
    """A configuration name's BatchNorm part as the keys that give it."""
    return f"bn=frozen bn_adapt={ADAPT_IMAGES}" if mode == "adapt" else f"bn={mode}"


def same_run(runs: dict, name: str, other: str, seed: int) -> bool:
    """Whether two configurations' runs of a seed are one run, kept under both names."""
    a, b = runs[name][str(seed)], runs[other][str(seed)]
    return a.get("same_run_as") == other or b.get("same_run_as") == name


def precise_bn_effect(runs: dict, seeds: list[int]) -> list[str]:
    """What precise_bn's recompute does to yoloaccum's fine-tuned runs: each run's final EMA with precise statistics
    against the same weights as trained (what precise_bn=0 gives), per configuration and pooled over the distinct
    runs below BN_AUTO_BELOW images per micro-batch and at or above it; paired by construction. The pools leave out
    bn=frozen and freeze= runs, which keep some or all of the checkpoint's statistics: a recompute is another thing
    for them (it breaks bn=frozen), and they would swamp what it does to the runs whose every BatchNorm trains."""
    rows, groups, counted = [], {}, set()
    for name in CONFIGS:
        have = {s: runs[name][str(s)] for s in seeds if str(s) in runs.get(name, {})}
        if CONFIGS[name][0] != "yoloaccum" or not have:
            continue
        pairs = [(r["precise"][METRICS[1]], r["raw"][METRICS[1]]) for r in have.values()]
        twins = {r.get("same_run_as") for r in have.values()} - {None}
        rows.append((f"{name} (the runs of {', '.join(sorted(twins))})" if twins else name, pairs))
        overrides = CONFIGS[name][1]
        if overrides.get("bn") == "frozen" or "freeze" in overrides:
            continue
        small = overrides["batch"] < BN_AUTO_BELOW
        label = f"{'below' if small else 'at or above'} {BN_AUTO_BELOW}, pooled (every BatchNorm trained)"
        group = groups.setdefault(label, [])
        for seed, r in have.items():  # a run that two configurations share counts once
            if (run := (r.get("same_run_as") or name, seed)) not in counted:
                counted.add(run)
                group.append((r["precise"][METRICS[1]], r["raw"][METRICS[1]]))
    out = [
        "",
        "## precise_bn's recompute on these runs",
        "",
        "The final EMA with precise statistics minus the same weights as trained (precise_bn=0's figure), 95% t "
        "interval; pooled rows count each run once.",
        "",
        "| run | runs | precise − as trained [95%] |",
        "| --- | --- | --- |",
    ]
    for name, pairs in [*rows, *((n, p) for n, p in groups.items() if p)]:
        out.append(f"| {name} | {len(pairs)} | {spread(paired([a for a, _ in pairs], [b for _, b in pairs]))} |")
    return out


# Issue 61's targets for the default from weights, beside the rule (as good as today's default and cheaper wins):
# at least this share of the real batch of 64's mAP50-95, level with or above Ultralytics' trainer at the same
# micro-batch (a paired interval that reaches 0), and at most this multiple of bn=batch's cost
OF_B64 = 0.98
OF_BATCH_COST = 1.1
MODES = ("window", "batch", "frozen", "adapt")


def targets(sets: dict[str, tuple[dict, dict, list[int]]]) -> str:
    """Each BatchNorm mode at each micro-batch below BN_AUTO_BELOW, on each set (name: runs, size, seeds), against
    the targets and against today's default at that micro-batch; then, per micro-batch and mode, the sets on which it
    meets every target, misses one or cannot be judged, and the rule's verdict. A set with no runs of a mode does not
    judge it; a configuration with no runs of its own is read from one that resolves alike (b2-window's from b2's)."""

    def diff(d: dict | None) -> str:
        return "–" if d is None else f"{spread(d)} ({d['n']})"

    def reach(d: dict) -> float:  # as good where >= 0: the interval's top (one seed: its difference)
        return d["mean"] if d["high"] is None else d["high"]

    def times(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}x"

    lines = [
        "# The default from weights against issue 61's targets and rule",
        "",
        f"Each BatchNorm mode below {BN_AUTO_BELOW} images per device, from the fine-tuning study's kept runs of this "
        "checkpoint, as each trainer ships it (`python benchmarks/fidelity_finetune.py --report`). Targets: "
        f"at least {OF_B64}x the real batch of 64's mAP50-95, level with or above `yolo train` at the same "
        f"micro-batch (the top of the paired 95% interval at or above 0; with one seed, its difference), at most "
        f"{OF_BATCH_COST}x bn=batch's cost. The rule: a mode as good as today's default in the same sense (over "
        "every seed the study plans for the set), and cheaper, on every set, wins; "
        + "".join(f"{long} decides for {short} where it has runs of the mode, " for long, short in DECIDES_FOR.items())
        + "its ratios resting on larger gaps. Seeds in brackets; cost per image, compared on one day's runs where "
        "both have some.",
        "",
        "| set | micro-batch | mode | mAP50-95 | vs b64 | vs `yolo train` | cost vs bn=batch "
        "| vs today's default: paired diff, cost | targets missed | unmeasured |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    sets = {data: (with_twins(runs, seeds), size, seeds) for data, (runs, size, seeds) in sets.items()}
    verdicts: dict[tuple[int, str], dict[str, tuple[list[str], list[str], bool | None]]] = {}
    for micro in range(1, BN_AUTO_BELOW):
        default = f"b{micro}-{bn_mode('auto', micro)}"
        for mode in MODES:
            name = f"b{micro}-{mode}"
            for data, (runs, size, seeds) in sets.items():
                have = [s for s in seeds if str(s) in runs.get(name, {})]
                if name not in CONFIGS or not have:
                    continue
                mean = statistics.fmean(runs[name][str(s)][shipped(name)][METRICS[1]] for s in have)
                b64, ours = versus(runs, name, REFERENCE, seeds), versus(runs, name, f"ultralytics-b{micro}", seeds)
                ratio = None if b64 is None else b64["ratio"]
                cost = 1.0 if mode == "batch" else cost_ratio(runs, name, f"b{micro}-batch", have, size, seeds)[0]
                unmeasured = [t for t, v in (("b64", ratio), ("`yolo train`", ours), ("cost", cost)) if v is None]
                missed = []
                if ratio is not None and ratio < OF_B64:
                    missed.append(f"b64 {ratio:.2f}x (≥ {OF_B64}x)")
                if ours is not None and reach(ours) < 0:
                    missed.append(f"`yolo train`: interval top {reach(ours):+.3f}")
                if cost is not None and cost > OF_BATCH_COST:
                    missed.append(f"cost {cost:.2f}x (≤ {OF_BATCH_COST}x)")
                if name == default:
                    rule, today_cell = True, "the default"
                else:
                    today = versus(runs, name, default, seeds)
                    cheaper = cost_ratio(runs, name, default, have, size, seeds)[0]
                    # every seed the study plans for the set: over 2, a t interval is too wide to tell anything apart
                    paired_seeds = today is not None and today["n"] >= len(seeds)
                    rule = None if not paired_seeds or cheaper is None else reach(today) >= 0 and cheaper < 1
                    today_cell = f"{diff(today)}, {times(cheaper)}"
                verdicts.setdefault((micro, mode), {})[data] = (missed, unmeasured, rule)
                lines.append(
                    f"| {data} | {micro} | {mode_name(mode)} | {mean:.3f} ({len(have)}) | {times(ratio)} "
                    f"| {diff(ours)} | {times(cost)} | {today_cell} | {', '.join(missed) or 'none'} "
                    f"| {', '.join(unmeasured) or 'none'} |"
                )
    lines += ["", "## By micro-batch", ""]
    for micro in range(1, BN_AUTO_BELOW):
        judged = {mode: v for (m, mode), v in verdicts.items() if m == micro}
        if judged:
            lines.append(f"- {micro} images per device (today bn=auto takes bn={bn_mode('auto', micro)}):")
        for mode, on in judged.items():
            met = [data for data, (missed, unmeasured, _) in on.items() if not missed and not unmeasured]
            short = [f"{data} ({', '.join(missed)})" for data, (missed, _, _) in on.items() if missed]
            said = f"  - {mode_name(mode)}: " + (
                f"every target met on {', '.join(met)}" if met else "no set meets every target"
            )
            said += f"; missed on {'; '.join(short)}" if short else ""
            if unknown := [data for data, (_, unmeasured, _) in on.items() if unmeasured]:
                said += f"; unmeasured on {', '.join(unknown)}"
            if mode != bn_mode("auto", micro):
                rules = {data: rule for data, (_, _, rule) in on.items()}
                decided = {short: long for long, short in DECIDES_FOR.items() if long in rules}
                rules = {data: rule for data, rule in rules.items() if data not in decided}
                better, worse, unpaired = ([d for d, rule in rules.items() if rule is r] for r in (True, False, None))
                said += f". As good as the default and cheaper on {', '.join(better) or 'no set'}"
                said += f"; not on {', '.join(worse)}" if worse else ""
                said += f"; not paired with the default over all its seeds on {', '.join(unpaired)}" if unpaired else ""
                for short, long in decided.items():  # and what the set's own runs alone would say, beside it
                    if short not in sets:
                        continue
                    alone = {True: "taken", False: "not taken", None: "undecided"}[on[short][2]] if short in on else ""
                    said += f"; {long} decides for {short}" + (f" (its own runs alone: {alone})" if alone else "")
                if absent := [data for data in sets if data not in on and data not in decided]:
                    said += f"; no runs of it on {', '.join(absent)}"
                verdict = "not taken" if worse else "undecided" if unpaired or absent or not better else "taken"
                said += f". The rule: {verdict}"
            lines.append(said + ".")
    return "\n".join(lines) + "\n"


def with_twins(runs: dict, seeds: list[int]) -> dict:
    """A copy of `runs` in which each configuration holds, for the `seeds` it has no run of, the run of another that
    trained its settings, as kept() copies them when the study makes runs (b2-window's from b2's while bn=window is
    b2's default), so that a report of runs made under the other name reads them too."""
    record = {"runs": {name: dict(held) for name, held in runs.items()}}
    for name in CONFIGS:
        for seed in seeds:
            kept(record, name, seed)
    return record["runs"]


def set_report(record: dict, data: str, size: dict, planned: list[int]) -> str:
    """The set's report from every run the store holds for the checkpoint: each configuration, on the seeds the study
    plans and any others held, twins read. Whichever runs a call made (`--configs b2-batch --seeds 0`), it rewrites
    the whole report, never one of that call's runs alone."""
    runs = record["runs"]
    seeds = sorted({int(s) for held in runs.values() for s in held} | set(planned))
    return report(with_twins(runs, seeds), size, seeds, record, data)


def report_key(saved: dict) -> str | None:
    """--report's checkpoint: make pretrain's, where it is here and has runs in the store, else the last one that
    ran. A checkpoint made again (pretrain.py) starts a new key; the runs of the ones before stay in the store, and
    each checkpoint's report is <set>-<its SHA-256's first 12>.md."""
    import pretrain

    current = (pretrain.record() or {}).get("sha256")
    return current if current in saved else next(reversed(saved), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="default: each set's PLANNED ones")
    p.add_argument("--seeds", nargs="+", type=int, help="default: 0-4 on bccd, 0-2 on aquarium and aquarium-40")
    p.add_argument("--report", action="store_true", help="only write the reports from the runs already kept")
    p.add_argument("--smoke", action="store_true", help="a tiny version that only checks the study runs")
    p.add_argument("--out", type=Path, help=f"folder for the records: {RECORDS.relative_to(HERE.parent)}/")
    p.add_argument("--checkpoint", type=Path, help="start from this .pt instead of make pretrain's (a pilot)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="finetune-"))  # the runs' folders: what they keep is in the store
    out = a.out or (work if a.smoke else RECORDS)
    try:
        study(a, work, out)
    finally:
        if out != work:  # hundreds of MB a study; a smoke without --out keeps its report there
            shutil.rmtree(work, ignore_errors=True)


def study(a: argparse.Namespace, work: Path, out: Path) -> None:
    """Make the runs `a` asks for that the store does not hold, seed by seed, keeping each as it ends; then write
    each set's report."""
    out.mkdir(parents=True, exist_ok=True)
    weights, sha = (None, None) if a.report else checkpoint_for(a.smoke, work, a.checkpoint)
    sizes = {"shapes": {**SMOKE, "seeds": [0]}} if a.smoke else {d: SIZES[d] for d in a.data}
    twin = f"b2-{bn_mode('auto', 2)}"  # the configuration that resolves as b2, the default: b2's runs
    keys = set()
    for name, size in sizes.items():
        if not a.smoke and not SHARED_SETS[size["dataset"]].exists():
            print(f"fidelity_finetune: {SHARED_SETS[size['dataset']]} is not here; {name} skipped", flush=True)
            continue
        store = out / f"{name}.json"
        saved = json.loads(store.read_text()) if store.exists() else {}
        key = sha or report_key(saved)
        if key is None:
            continue
        keys.add(key)
        record = saved.setdefault(key, {"sha256": key, "checkpoint": weights.name if weights else "?", "runs": {}})
        before = json.dumps(saved)
        runs = record["runs"]
        seeds = a.seeds or size["seeds"]
        configs = ["b64", "b2", twin, "ultralytics-b2"] if a.smoke else a.configs or PLANNED[name]
        run_size = {k: v for k, v in size.items() if k != "seeds"}
        # the "recomputed" column's count: precise_bn=auto's from scratch (from weights it recomputes none)
        run_size["precise_images"] = precise_bn_count("auto", run_size["images"], from_weights=False, bn="batch")
        if weights is not None:
            run_size["model"] = str(weights)
        for seed in sorted({int(s) for held in runs.values() for s in held} | set(seeds)):
            move_stale(record, seed)
        todo = [] if a.report else to_make(record, configs, seeds)
        if todo:
            seconds, unknown = time_left(paces(out, name, size, saved), todo, size)
            guess = f"about {seconds / 3600:.1f} h at the pace of each configuration's latest day" if seconds else ""
            blind = f"{unknown} with no kept run to go by" if unknown else ""
            print(f"{name}: {len(todo)} runs to make; " + "; ".join(filter(None, [guess, blind])), flush=True)
        for seed in seeds:
            for config in configs:
                if kept(record, config, seed) or a.report:
                    continue
                trainer, settings = CONFIGS[config]
                print(f"{name} {config} seed {seed} ...", flush=True)
                day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()  # cost_cell compares by day
                result = fresh(
                    "train_and_evaluate", trainer, settings, run_size, seed, str(work / config), module="fidelity"
                )
                runs.setdefault(config, {})[str(seed)] = {**result, "resolved": resolved(config), "day": day}
                print(f"  {result['seconds']:.0f} s, raw {result['raw']}, precise {result['precise']}", flush=True)
                store.write_text(json.dumps(saved, indent=1) + "\n")
        if json.dumps(saved) != before:  # kept runs moved or paired under today's defaults
            store.write_text(json.dumps(saved, indent=1) + "\n")
        text = set_report(record, name, run_size, size["seeds"])
        (out / f"{name}-{key[:12]}.md").write_text(text)  # each checkpoint's report apart
        print(text, flush=True)
    for key in keys:  # every set's runs of the checkpoint, the ones this call did not touch too
        held = {}
        for name, size in (sizes if a.smoke else SIZES).items():
            store = out / f"{name}.json"
            if store.exists() and key in (saved := json.loads(store.read_text())):
                held[name] = (saved[key]["runs"], size, size["seeds"])
        (out / f"targets-{key[:12]}.md").write_text(targets(held))


if __name__ == "__main__":
    main()
