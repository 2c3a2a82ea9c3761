"""The run's time split in one line and a verdict: what bound the run, and what to try, only where its own figures
say so (docs/performance.md, "Where a run's time goes").

The split is core/timing.py's, summed over the run: every second from the start of training to the end of the final
validation and plots given to one phase. The verdict reads shares of it:
- data-bound: waiting for the loader (and moving batches to the device) took DATA_BOUND of the training time or more;
- validation-heavy: with val=True, the validations (and precise BatchNorm statistics) before the last epoch took
  VALIDATION_HEAVY of the run or more: what val=False would save (it keeps the last epoch's and the final one);
- the statistics pass: bn=window's pass took BN_PASS of the training time or more.
None of these: compute-bound, which is where a run should be.

Not (yet) launch-bound, the small micro-batch on a big GPU: its sign would be the host launching kernels no faster
than the GPU runs them, but the host's forward-and-backward time also holds its waits where Ultralytics' loss reads
values back (the targets' counts), so on CUDA the two clocks agree whether or not the GPU waited for launches. On CUDA
the report gives both figures (`lines()`), unjudged, until a GPU run calibrates a test (benchmarks/gpu_check.sh
records them at micro-batch 8 and 2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from yoloaccum.core.timing import EPOCH_END, PHASES, TRAINING

if TYPE_CHECKING:
    import torch

    from yoloaccum.config.settings import Config

DATA_BOUND = 0.25
VALIDATION_HEAVY = 0.20
BN_PASS = 0.20

NAMES = {
    "data": "waiting for data",
    "to_device": "to the device",
    "forward_backward": "forward and backward",
    "bn_window": "bn=window's pass",
    "step": "optimizer steps",
    "plots": "plots",
    "other": "other",
    "precise_bn": "precise BatchNorm",
    "validation": "validation",
    "save": "saving",
    "logs": "logs",
}


@dataclass(frozen=True)
class Report:
    """Seconds per phase over the run, and the verdict's lines."""

    split: dict[str, float]
    verdict: str  # one or two sentences: what bound the run, and what to try
    host_forward_backward: float | None = None  # on CUDA: the host's own seconds in forward and backward

    @classmethod
    def of(
        cls,
        split: dict[str, float],
        host: dict[str, float],
        cfg: Config,
        device: torch.device,
        workers: int,
        epochs: int,
    ) -> Report:
        """`host`: the host's own seconds per phase; `epochs`: how many this process trained (a resumed run's, since
        it resumed)."""
        split = {phase: split.get(phase, 0.0) for phase in PHASES}
        host_fb = host.get("forward_backward", 0.0) if device.type == "cuda" else None
        return cls(split, verdict(split, cfg, device.type, workers, epochs), host_fb)

    def lines(self) -> list[str]:
        """`time:` and the split, then the verdict."""
        total = sum(self.split.values())
        shares = sorted(((s / total, p) for p, s in self.split.items() if total and s / total >= 0.005), reverse=True)
        parts = ", ".join(f"{NAMES[p]} {share:.0%}" for share, p in shares)
        lines = [f"time: {total:.1f} s from the first epoch to the final figures: {parts}", self.verdict]
        if self.host_forward_backward is not None:
            lines.append(
                f"on the GPU, forward and backward took {self.split['forward_backward']:.1f} s; the host spent "
                f"{self.host_forward_backward:.1f} s launching them and waiting where the loss reads values back"
            )
        return lines


def verdict(split: dict[str, float], cfg: Config, device: str, workers: int, epochs: int) -> str:
    """What bound the run and what to try: the findings the split supports, the one that cost the most seconds
    first, at most two."""
    training = sum(split.get(p, 0.0) for p in TRAINING) or 1e-9
    total = training + sum(split.get(p, 0.0) for p in EPOCH_END)
    findings: list[tuple[float, str]] = []

    data = (split.get("data", 0.0) + split.get("to_device", 0.0)) / training
    if data >= DATA_BOUND:
        findings.append(
            (
                data * training,
                f"data-bound: {data:.0%} of training waited for the loader; {_data_advice(cfg, device, workers)}",
            )
        )

    # val=True validates after every epoch, and the final figures once more; val=False keeps the last two of these
    checked = split.get("validation", 0.0) + split.get("precise_bn", 0.0)
    avoidable = checked * max(epochs - 1, 0) / (epochs + 1) / total
    if avoidable >= VALIDATION_HEAVY and cfg.val:
        findings.append(
            (
                avoidable * total,
                f"validation-heavy: {checked / total:.0%} of the run validated, {avoidable:.0%} before the last epoch; "
                "validate fewer images (a smaller val split), or val=False, which validates only after the last epoch",
            )
        )

    bn = split.get("bn_window", 0.0) / training
    if bn >= BN_PASS:
        cap = "" if cfg.bn_window else "bn_window=16 caps it at 16 images a window, "
        findings.append(
            (
                bn * training,
                f"bn=window's statistics pass took {bn:.0%} of training; {cap}bn=batch drops it, at some accuracy on "
                "small micro-batches (docs/batchnorm.md)",
            )
        )

    if not findings:
        fb = split.get("forward_backward", 0.0) / training
        return f"compute-bound: forward and backward took {fb:.0%} of training; nothing around them held it up"
    findings.sort(reverse=True)
    return "; ".join(text for _, text in findings[:2])


def _data_advice(cfg: Config, device: str, workers: int) -> str:
    """What may feed the model faster, leaving out what the run already does."""
    tries = []
    if device == "cuda":
        cores = (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if workers < cores:
            tries.append(f"workers={min(cores, max(2 * workers, 2))} (it had {workers})")
    if cfg.cache not in ("ram", True):
        tries.append("cache=ram (each image decoded once)")
    tries.append(f"an imgsz below {cfg.imgsz}")
    where = "; on the CPU the data loads in the training process, beside torch's threads" if device == "cpu" else ""
    return "try " + ", ".join(tries[:-1]) + (" or " if len(tries) > 1 else "") + tries[-1] + where
