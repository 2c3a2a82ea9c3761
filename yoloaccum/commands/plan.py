"""`yoloaccum plan`: what a recipe will do, from the schedule alone, as a rich summary, JSON or a plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from yoloaccum.config import devices
from yoloaccum.config import settings as config
from yoloaccum.config.settings import Config
from yoloaccum.core import schedule
from yoloaccum.core.schedule import (
    ADAPTIVE,
    BN_AUTO_BELOW,
    FROZEN_KEEPS,
    Schedule,
    bn_auto_reason,
    bn_mode,
    precise_bn_count,
)
from yoloaccum.errors import UserError

if TYPE_CHECKING:
    from yoloaccum.model import autobatch

JSON_VERSION = 1  # bump when a field of `plan --json` changes meaning or disappears


def run(cfg: Config, images: int | None = None, as_json: bool = False, plot_path: Path | None = None) -> Schedule:
    """api.plan's work (`yoloaccum plan ...`): the schedule of a recipe, printed as a table or JSON, optionally drawn
    into a PNG. `images` stands in for counting the dataset's training images.
    """
    # torch, Ultralytics and the dataset code are imported only where they are needed (data=, batch=-1), so that
    # `plan images=N` answers at once
    if plot_path and not plot_path.parent.is_dir():
        raise UserError(
            f"--plot {plot_path}: the folder {plot_path.parent} does not exist; make it, or give another path"
        )
    if note := config.dropped_note(cfg):
        print(note, file=sys.stderr, flush=True)
    if images is not None:
        if isinstance(images, bool) or not isinstance(images, int) or images < 1:
            raise UserError(f"images={images} must be a positive whole number")
        num_images, nc = images, 80 if cfg.data is None else _data().load_spec(cfg.data).nc
    elif cfg.data is None:
        raise UserError("plan needs the number of training images: give data=dataset.yaml or images=N")
    else:
        data = _data()
        spec = data.load_spec(cfg.data)
        num_images, nc = data.num_training_images(cfg, spec), spec.nc
    choice = None
    if config.is_auto_batch(cfg.batch):  # measured as a run would; the config keeps what was asked
        from yoloaccum.model import autobatch

        data = _data()
        spec = (
            data.load_spec(cfg.data)
            if cfg.data
            else data.DatasetSpec(Path(), Path(), (), (), dict.fromkeys(range(nc), ""))
        )
        choice = autobatch.for_plan(cfg, num_images, spec)
    sched = schedule.build(
        cfg.replace(batch=choice.batch) if choice else cfg, num_images, world_size=devices.world_size(cfg.device), nc=nc
    )
    if as_json:
        print(json.dumps(to_json(cfg, sched, choice)), flush=True)
    else:
        render(cfg, sched, Console(), choice)
    if plot_path:
        plot(sched, plot_path)
    return sched


def _data():
    from yoloaccum.data import datasets as data

    return data


def warnings(cfg: Config, schedule: Schedule) -> list[str]:
    """Recipe choices that work but deserve a second look."""
    out = []
    micro, bn = schedule.micro_batch, bn_mode(cfg.bn, schedule.micro_batch)
    # only where bn=auto would have chosen otherwise: where the evidence has bn=window ahead
    if bn == "batch" and bn_mode("auto", micro) == "window":
        out.append(
            f"micro-batch {micro} per device with bn=batch: BatchNorm trains on the statistics of {micro} images, "
            f"which costs accuracy below {BN_AUTO_BELOW} (docs/accuracy.md); bn=window (what bn=auto, the default, "
            "takes here) normalises every micro-batch with its window's statistics"
        )
    if bn == "window" and micro < BN_AUTO_BELOW:
        window = schedule.effective_batch // schedule.world_size
        chosen = "bn=auto takes bn=window" if cfg.bn == "auto" else "bn=window"
        out.append(
            f"micro-batch {micro} per device: {chosen}, so BatchNorm normalises every micro-batch with the statistics "
            f"of its window's {window} images, as one batch of them would be, not with {micro} images' own; a forward "
            "pass over the window before its micro-steps gives them, one more forward per image: expect 1.3x to 1.5x "
            "bn=batch's time at micro-batch 2 on a CPU, the run's time report's 'bn=window's pass' (docs/batchnorm.md)"
        )
    if schedule.accumulate < round(cfg.nbs / schedule.batch):
        out.append(
            f"the run has only {schedule.total_iterations} iterations, so accumulate is capped at "
            f"{schedule.accumulate} (round(nbs/batch) = {round(cfg.nbs / schedule.batch)}): {schedule.effective_batch} "
            "images per optimizer "
            "step, and weight decay is scaled by that accumulate"
        )
    ratio = schedule.effective_batch / schedule.nbs
    if schedule.lr_scale == "ultralytics" and schedule.optimizer in ADAPTIVE and not 0.5 <= ratio <= 2:
        out.append(
            f"effective batch {schedule.effective_batch} is {ratio:.3g}x nbs={schedule.nbs} with {schedule.optimizer}, "
            "whose update ignores the gradient's scale: with lr_scale=ultralytics the lr does not follow the batch; "
            + (
                "lr_scale=linear kept accuracy closest to a real batch of nbs at 2x and 4x (docs/lr-scaling.md)"
                if ratio > 2
                else "lr_scale=sqrt or linear scales it (docs/lr-scaling.md; not measured below nbs)"
            )
        )
    if cfg.nbs < schedule.batch:
        out.append(
            f"nbs={cfg.nbs} < batch={schedule.batch}: accumulate is 1 and weight decay is scaled up by "
            f"{schedule.batch / cfg.nbs:.3g}x"
        )
    return out


def lr_scaling_line(s: dict[str, Any]) -> str:
    lrs = ", ".join(f"{k} {v:.4g}" for k, v in s["lr_after_warmup"].items())
    return (
        f"lr_scale={s['lr_scale']}: effective batch / nbs = {s['effective_batch_ratio']:.3g} ({s['optimizer']}, "
        f"{s['optimizer_family']}): lr × {s['lr_multiplier']:.4g}; after warmup {lrs}"
    )


def ramp_ranges(schedule: Schedule) -> list[tuple[int, int, int]]:
    """The accumulate ramp as (first ni, last ni, accumulate) runs, through the end of warmup."""
    runs: list[tuple[int, int, int]] = []
    for ni in range(min(schedule.warmup_iterations, schedule.total_iterations - 1) + 1):
        acc = schedule.accumulate_at(ni)
        if runs and runs[-1][2] == acc:
            runs[-1] = (runs[-1][0], ni, acc)
        else:
            runs.append((ni, ni, acc))
    return runs


def summary(cfg: Config, schedule: Schedule, choice: autobatch.Choice | None = None) -> dict[str, Any]:
    """The plan's headline figures; also the `summary` object of `plan --json`."""
    return {
        "batch_from_memory": choice.reason if choice else None,  # batch=-1 or a fraction: what was chosen, and why
        "images": schedule.num_images,
        "epochs": schedule.epochs,
        "world_size": schedule.world_size,
        "batch": schedule.batch,
        "micro_batch_per_device": schedule.micro_batch,
        "nbs": schedule.nbs,
        "accumulate": schedule.accumulate,
        "effective_batch": schedule.effective_batch,
        "weight_decay": cfg.weight_decay,
        "weight_decay_scaled": schedule.weight_decay,
        "warmup_iterations": schedule.warmup_iterations,
        "accumulate_ramp": [{"first_ni": a, "last_ni": b, "accumulate": c} for a, b, c in ramp_ranges(schedule)],
        "optimizer": schedule.optimizer,
        "optimizer_args": schedule.optimizer_args,  # as constructed: lr, momentum and nesterov, or betas
        "param_groups": {  # by the label that `iterations` keys lr with
            k: {"param_group": g, "initial_lr": lr, "weight_decay": wd}
            for k, (g, lr, wd) in schedule.param_groups.items()
        },
        "lr0": schedule.lr0,
        "lr_scale": schedule.lr_scale,  # the rule; the fields below are what it gives
        "optimizer_family": "adaptive" if schedule.optimizer in ADAPTIVE else "sgd",
        "effective_batch_ratio": schedule.effective_batch / schedule.nbs,
        "lr_multiplier": schedule.lr_multiplier,
        "lr_after_warmup": {k: lr * schedule.lr_multiplier for k, (_, lr, _) in schedule.param_groups.items()},
        "batches_per_epoch": schedule.batches_per_epoch,
        "steps_per_epoch": [schedule.steps_per_epoch(e) for e in range(schedule.epochs)],
        "total_steps": schedule.total_steps,
        "norm": cfg.norm,
        "bn": bn_mode(cfg.bn, schedule.micro_batch),  # the mode in force: auto resolved
        "bn_reason": bn_auto_reason(schedule.micro_batch, cfg.from_weights) if cfg.bn == "auto" else "as given",
        # images whose BatchNorm statistics are recomputed before each validation: precise_bn, with auto resolved
        "precise_bn_images": precise_bn_count(
            cfg.precise_bn, schedule.num_images, from_weights=cfg.from_weights, bn=cfg.bn
        ),
        "remainder": cfg.remainder,
        "warnings": warnings(cfg, schedule),
    }


def precise_line(cfg: Config, num_images: int) -> str:
    """The plan's row for precise_bn: how many images the recompute passes before each validation, if any."""
    if num_images:
        return f"recomputed over {num_images} training images before each validation (precise_bn={cfg.precise_bn})"
    if cfg.precise_bn == "auto" and cfg.bn == "frozen":
        return f"none recomputed: {FROZEN_KEEPS}"
    if cfg.precise_bn == "auto" and cfg.from_weights:
        return "none recomputed: validation reads the running statistics (precise_bn=auto from trained weights)"
    return "none recomputed: validation reads the running statistics (precise_bn=0)"


def iterations(schedule: Schedule) -> list[dict[str, Any]]:
    """One record per iteration ni: epoch, accumulate, whether a step follows, lr per parameter group, momentum."""
    groups = schedule.param_groups
    out = []
    for ni in range(schedule.total_iterations):
        out.append(
            {
                "ni": ni,
                "epoch": ni // schedule.batches_per_epoch,
                "accumulate": schedule.accumulate_at(ni),
                "step": schedule.steps_after(ni),
                "lr": {k: schedule.lr_at(ni, lr, bias=g == "bias") for k, (g, lr, _) in groups.items()},
                "momentum": schedule.momentum_at(ni),
            }
        )
    return out


def to_json(cfg: Config, schedule: Schedule, choice: autobatch.Choice | None = None) -> dict[str, Any]:
    return {"version": JSON_VERSION, "summary": summary(cfg, schedule, choice), "iterations": iterations(schedule)}


def render(cfg: Config, schedule: Schedule, console: Console, choice: autobatch.Choice | None = None) -> None:
    """Print the summary as a rich table, then the warnings."""
    s = summary(cfg, schedule, choice)
    ramp = ", ".join(f"{a}–{b} → {c}" for a, b, c in ramp_ranges(schedule)) if s["warmup_iterations"] else "none"
    steps = s["steps_per_epoch"]
    per_epoch = str(steps[0]) if len(set(steps)) == 1 else f"{min(steps)}–{max(steps)}"
    table = Table(title="yoloaccum plan", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("images / epochs", f"{s['images']} / {s['epochs']}"),
        ("devices × micro-batch", f"{s['world_size']} × {s['micro_batch_per_device']} (batch={s['batch']})"),
        ("accumulate", f"{s['accumulate']} (nbs={s['nbs']})"),
        ("effective batch", f"{s['effective_batch']} images per optimizer step"),
        (
            "weight decay",
            f"{s['weight_decay']:g} → {s['weight_decay_scaled']:g} "
            f"(× batch·accumulate/nbs = {s['batch']}·{s['accumulate']}/{s['nbs']})",
        ),
        ("warmup", f"{s['warmup_iterations']} iterations"),
        ("accumulate ramp", f"ni {ramp}"),
        ("optimizer", f"{s['optimizer']} lr0={s['lr0']:g}"),
        ("lr scaling", lr_scaling_line(s)),
        ("iterations per epoch", str(s["batches_per_epoch"])),
        ("optimizer steps", f"{per_epoch} per epoch, {s['total_steps']} in total"),
        ("norm / remainder", f"{s['norm']} / {s['remainder']}"),
        ("BatchNorm", f"bn={s['bn']}" + (f": bn=auto's choice {s['bn_reason']}" if cfg.bn == "auto" else "")),
        ("precise BatchNorm", precise_line(cfg, s["precise_bn_images"])),
    ]
    if choice:
        rows.insert(2, ("micro-batch from memory", choice.reason))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for w in s["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")


def plot(schedule: Schedule, path: Path) -> None:
    """Draw accumulate, lr and momentum against the iteration into a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display here, and no font downloads: matplotlib ships its own fonts
    import matplotlib.pyplot as plt

    records = iterations(schedule)
    ni = [r["ni"] for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].step(ni, [r["accumulate"] for r in records], where="post")
    axes[0].set_ylabel("accumulate")
    for group in ("weight", "bias"):
        axes[1].plot(ni, [r["lr"][group] for r in records], label=group)
    axes[1].set_ylabel("lr")
    axes[1].legend()
    axes[2].plot(ni, [r["momentum"] for r in records])
    axes[2].set_ylabel("momentum")
    axes[2].set_xlabel("iteration (ni)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
