"""The accumulation schedule: pure arithmetic with no training state.

From a resolved config, the number of training images and the world size it decides, for every iteration ni (one
micro-batch on every device), how many micro-batches make a window, whether the optimizer steps after it, and the
learning rate and momentum. The formulas are Ultralytics 8.4's BaseTrainer; where yoloaccum differs it says so.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from yoloaccum.config.settings import Config, is_auto_batch
from yoloaccum.errors import UserError

# Optimizers whose momentum is Adam's beta1: built with betas, and not ramped during warmup (as Ultralytics).
ADAM = frozenset({"Adam", "Adamax", "AdamW", "NAdam", "RAdam"})
# Optimizers whose update does not grow with the gradient's scale (they divide by a running gradient magnitude). The
# loss is a sum over images, so for the others (SGD and MuSGD, whose SGD part it is) the update already grows
# linearly with the effective batch, and for these it does not grow at all.
ADAPTIVE = ADAM | {"RMSprop"}
# lr_scale: how the update size should follow effective batch / nbs, as an exponent of that ratio
LR_SCALE_EXPONENT = {"linear": 1.0, "sqrt": 0.5, "none": 0.0}
HEAD_LR_SCALE = 3  # MuSGD trains the class heads (cv3) at 3 x lr0, as Ultralytics
# bn=auto: each window's statistics (bn=window) below this many images per device, where a micro-batch's own cost
# accuracy; each micro-batch's (bn=batch) from here on, where they cost little and the pass would (docs/batchnorm.md).
# The same for a run from trained weights: fine-tuning below 8, bn=window kept both sets of the study close to a real
# batch of 64, where bn=batch fell far short on one; on the other bn=batch ended ahead and level with Ultralytics'
# trainer, which bn=window trailed. No mode met every target; this one's worst is the least bad (docs/finetuning.md).
BN_AUTO_BELOW = 8
BN_AUTO_FROM_WEIGHTS_WHY = (
    "fine-tuning at micro-batch 2 and 4, bn=window kept both sets of the study within 3% of a real batch of 64, "
    "where bn=batch fell short on one by 14% to 26%; on the other bn=batch ended 4% ahead, level with yolo train, "
    "which bn=window trailed by 3% to 4%: docs/finetuning.md"
)

# precise_bn=auto from scratch: an eighth of the training set, within these bounds. The floor keeps the pass a small
# part of an epoch on a small set at no measured loss of accuracy; sets of 512 images and more never reach it
# (benchmarks/precise_bn.md measured the choice, docs/accuracy.md).
PRECISE_BN_SHARE, PRECISE_BN_MIN, PRECISE_BN_MAX = 8, 48, 256
# precise_bn=auto from trained weights (fine-tuning): no recompute. The checkpoint's running statistics, moved by every
# micro-batch since, validated better than the recompute's on one set of the fine-tuning study and barely worse on the
# other, and the pass costs time before every validation (docs/finetuning.md).
PRECISE_BN_FROM_WEIGHTS = 0
PRECISE_BN_FROM_WEIGHTS_WHY = (
    "precise_bn=auto recomputes no BatchNorm statistics for a run from trained weights: validation reads the "
    "running statistics, as Ultralytics'; fine-tuning, the recompute did worse on one set and barely better on the "
    "other (docs/finetuning.md)"
)
# why precise_bn=auto recomputes no statistics with bn=frozen (a recompute broke it in the fine-tuning study)
FROZEN_KEEPS = "bn=frozen keeps the running statistics its weights train against"


@dataclass(frozen=True)
class Schedule:
    """When the optimizer steps and with which hyperparameters, for a run of `epochs` epochs."""

    num_images: int  # training images per epoch
    world_size: int  # devices (DDP ranks)
    batch: int  # global micro-batch: images in one iteration over all devices
    nbs: int  # nominal batch size of the recipe
    epochs: int
    remainder: str  # step: an epoch's short last window steps; carry: Ultralytics' global rule
    warmup_epochs: float
    base_weight_decay: float
    optimizer: str  # resolved: never "auto"
    lr0: float
    lrf: float
    cos_lr: bool
    momentum: float  # SGD momentum (Adam's beta1) that warmup ramps to: the recipe's
    initial_momentum: float  # what the optimizer is built with; differs for optimizer=auto, as in Ultralytics
    warmup_momentum: float
    warmup_bias_lr: float
    lr_scale: str = "ultralytics"  # the rule of lr_multiplier; the default of runs saved before it existed

    @property
    def micro_batch(self) -> int:
        """Images per device in one forward pass."""
        return self.batch // self.world_size

    @property
    def batches_per_epoch(self) -> int:
        """Iterations per epoch; the last one is short when num_images is not a multiple of batch."""
        return math.ceil(self.num_images / self.batch)

    @property
    def total_iterations(self) -> int:
        return self.batches_per_epoch * self.epochs

    @cached_property  # read for every window: computed once (the schedule is frozen)
    def accumulate(self) -> int:
        """Nominal micro-batches per window after warmup, round(nbs / batch); never more than the run has."""
        return min(max(round(self.nbs / self.batch), 1), self.total_iterations)

    @property
    def effective_batch(self) -> int:
        """Images per optimizer step over all devices: micro-batch x accumulate x devices."""
        return self.batch * self.accumulate

    @property
    def implicit_exponent(self) -> float:
        """How the update already grows with effective batch / nbs, at a fixed lr: linearly for SGD-type optimizers
        (the loss sums over images), not at all for adaptive ones."""
        return 0.0 if self.optimizer in ADAPTIVE else 1.0

    @property
    def lr_multiplier(self) -> float:
        """What every group's lr is multiplied by (lr_scale), so that the update size follows (effective batch / nbs)
        to the rule's exponent: ratio ** (exponent - implicit). `ultralytics` is 1: the lr as given, whatever the
        effective batch."""
        if self.lr_scale == "ultralytics":
            return 1.0
        ratio = self.effective_batch / self.nbs
        return ratio ** (LR_SCALE_EXPONENT[self.lr_scale] - self.implicit_exponent)

    @property
    def weight_decay(self) -> float:
        """weight_decay scaled to the images per optimizer step, batch x accumulate / nbs, with the accumulate the run
        uses. Ultralytics scales by round(nbs / batch) alone; the two differ only where the cap applies (a run of fewer
        iterations than that), where Ultralytics would never step at all."""
        return self.base_weight_decay * self.batch * self.accumulate / self.nbs

    @cached_property
    def warmup_iterations(self) -> int:
        """nw: warmup leaves at least the final epoch for regular training."""
        if self.warmup_epochs <= 0:
            return 0
        return round(min(self.warmup_epochs, max(self.epochs - 1, 0)) * self.batches_per_epoch)

    @property
    def optimizer_args(self) -> dict[str, Any]:
        """The optimizer's constructor arguments besides its groups, as Ultralytics gives them."""
        if self.optimizer in ADAM:
            return {"lr": self.lr0, "betas": (self.initial_momentum, 0.999)}
        if self.optimizer == "RMSprop":
            return {"lr": self.lr0, "momentum": self.initial_momentum}
        muon = {"muon": 0.2, "sgd": 1.0} if self.optimizer == "MuSGD" else {}
        return {"lr": self.lr0, "momentum": self.initial_momentum, "nesterov": True, **muon}

    @property
    def param_groups(self) -> dict[str, tuple[str, float, float]]:
        """The optimizer's parameter groups by label: (Ultralytics' param_group name, initial lr, weight decay).
        MuSGD adds a muon group (matrices and conv filters), and each group's class-head part as `<name>_head`."""
        groups = {
            "weight": ("weight", self.lr0, self.weight_decay),
            "bn": ("bn", self.lr0, 0.0),
            "bias": ("bias", self.lr0, 0.0),
        }
        if self.optimizer == "MuSGD":
            groups["muon"] = ("muon", self.lr0, self.weight_decay)
            groups.update({f"{k}_head": (g, lr * HEAD_LR_SCALE, wd) for k, (g, lr, wd) in groups.items()})
        return groups

    def accumulate_at(self, ni: int) -> int:
        """Micro-batches per window at iteration ni: ramps from 1 to the nominal value over warmup."""
        nw = self.warmup_iterations
        if nw and ni <= nw:
            return max(1, round(_interp(ni, nw, 1.0, float(self.accumulate))))
        return self.accumulate

    def lf(self, epoch: int) -> float:
        """Learning-rate factor of an epoch: linear from 1 to lrf, or cosine with cos_lr."""
        if self.cos_lr:
            return max((1 - math.cos(epoch * math.pi / self.epochs)) / 2, 0) * (self.lrf - 1) + 1
        return max(1 - epoch / self.epochs, 0) * (1.0 - self.lrf) + self.lrf

    def lr_at(self, ni: int, base_lr: float, bias: bool) -> float:
        """Learning rate at ni of a parameter group whose initial lr is base_lr (lr0, or a multiple for MuSGD), times
        lr_multiplier (which scales the warmup's start with the rest: the whole update follows the rule)."""
        target = base_lr * self.lf(ni // self.batches_per_epoch)
        nw = self.warmup_iterations
        if nw and ni <= nw:  # biases fall from warmup_bias_lr, everything else rises from 0
            target = float(np.interp(ni, [0, nw], [self.warmup_bias_lr if bias else 0.0, target]))
        return target * self.lr_multiplier

    def momentum_at(self, ni: int) -> float:
        """Momentum at ni. As in Ultralytics, only warmup sets it: from warmup_momentum to the recipe's momentum,
        which it then keeps; without warmup, or for Adam-family betas (their groups have no momentum), it stays as
        the optimizer was built."""
        nw = self.warmup_iterations
        if not nw or self.optimizer in ADAM:
            return self.initial_momentum
        if ni <= nw:
            return float(np.interp(ni, [0, nw], [self.warmup_momentum, self.momentum]))
        return self.momentum

    def window_ends(self, epoch: int) -> tuple[int, ...]:
        """In-epoch indices i after which the optimizer steps; each window's last micro-batch."""
        return self._ends[epoch]

    def steps_after(self, ni: int) -> bool:
        nb = self.batches_per_epoch
        return ni % nb in self._end_sets[ni // nb]

    def steps_per_epoch(self, epoch: int) -> int:
        return len(self._ends[epoch])

    @property
    def total_steps(self) -> int:
        return sum(map(len, self._ends))

    @cached_property
    def _end_sets(self) -> list[frozenset[int]]:
        return [frozenset(e) for e in self._ends]

    @cached_property
    def _ends(self) -> list[tuple[int, ...]]:
        if self.remainder == "carry":
            return self._carry_ends()
        nb, ends = self.batches_per_epoch, []
        for epoch in range(self.epochs):
            # A window holds accumulate(ni) micro-batches counted from its first one and never spans two epochs:
            # the epoch's last micro-batches form a shorter window, so no image is dropped at the end of the run.
            i, epoch_ends = 0, []
            while i < nb:
                i = min(i + self.accumulate_at(epoch * nb + i), nb)
                epoch_ends.append(i - 1)
            ends.append(tuple(epoch_ends))
        return ends

    def _carry_ends(self) -> list[tuple[int, ...]]:
        # Ultralytics' rule, exactly: step after ni when ni - last_opt_step >= accumulate(ni), last_opt_step from -1.
        # A window may span two epochs, and the last epoch's tail never steps.
        nb, nw, steps, last = self.batches_per_epoch, self.warmup_iterations, [], -1
        for ni in range(min(nw + 1, self.total_iterations)):
            if ni - last >= self.accumulate_at(ni):
                steps.append(last := ni)
        # After warmup accumulate is constant, so the remaining steps are an arithmetic sequence.
        first = max(last + self.accumulate, nw + 1)
        steps.extend(range(first, self.total_iterations, self.accumulate))
        ends: list[list[int]] = [[] for _ in range(self.epochs)]
        for ni in steps:
            ends[ni // nb].append(ni % nb)
        return [tuple(e) for e in ends]


def bn_mode(bn: str, micro_batch: int) -> str:
    """The BatchNorm mode a run trains with: `bn`, or for bn=auto the choice for `micro_batch` images per device."""
    if bn != "auto":
        return bn
    return "window" if micro_batch < BN_AUTO_BELOW else "batch"


def bn_auto_reason(micro_batch: int, from_weights: bool) -> str:
    """Why bn=auto chose what it chose, for the run's first lines and `plan`."""
    if from_weights and micro_batch < BN_AUTO_BELOW:
        return f"for {micro_batch} images per device, from trained weights as from scratch ({BN_AUTO_FROM_WEIGHTS_WHY})"
    return f"for {micro_batch} images per device"


def precise_bn_count(precise_bn: int | str, num_train: int, *, from_weights: bool, bn: str) -> int:
    """How many training images precise_bn's recompute passes: precise_bn of them (all, if fewer), or with `auto`
    an eighth of the training set within PRECISE_BN_MIN and PRECISE_BN_MAX from scratch, and none for a run from
    trained weights or with bn=frozen. On a small set the pass over all its images would be a large part of every
    epoch, and fewer give the same statistics (benchmarks/precise_bn.md)."""
    if precise_bn != "auto":
        return min(int(precise_bn), num_train)
    if bn == "frozen":  # why: FROZEN_KEEPS
        return 0
    if from_weights:
        return min(PRECISE_BN_FROM_WEIGHTS, num_train)
    return min(PRECISE_BN_MAX, max(PRECISE_BN_MIN, num_train // PRECISE_BN_SHARE), num_train)


def build(cfg: Config, num_images: int, world_size: int = 1, nc: int = 80) -> Schedule:
    """The schedule of a run; nc is needed only to pick lr0 when optimizer=auto."""
    check_batch(cfg.batch)
    check_precise_bn(cfg)
    if num_images < 1:
        raise UserError("the training split has no images; check the dataset's train entry")
    if cfg.batch % world_size:
        raise UserError(
            f"batch={cfg.batch} does not divide over {world_size} devices; use a multiple of {world_size}, "
            f"e.g. batch={max(1, cfg.batch // world_size) * world_size}"
        )
    optimizer, lr0, momentum, warmup_bias_lr = cfg.optimizer, cfg.lr0, cfg.momentum, cfg.warmup_bias_lr
    if optimizer == "auto":  # Ultralytics' choice: AdamW for short runs, MuSGD for long ones
        iterations = math.ceil(num_images / max(cfg.batch, cfg.nbs)) * cfg.epochs
        optimizer, lr0 = ("MuSGD", 0.01) if iterations > 10000 else ("AdamW", round(0.002 * 5 / (4 + nc), 6))
        # Built at 0.9; a warmup then ramps MuSGD's momentum to the recipe's (AdamW's beta1 stays 0.9).
        momentum, warmup_bias_lr = 0.9, 0.0
    return Schedule(
        num_images=num_images,
        world_size=world_size,
        batch=cfg.batch,
        nbs=cfg.nbs,
        epochs=cfg.epochs,
        remainder=cfg.remainder,
        warmup_epochs=cfg.warmup_epochs,
        base_weight_decay=cfg.weight_decay,
        optimizer=optimizer,
        lr0=lr0,
        lrf=cfg.lrf,
        cos_lr=cfg.cos_lr,
        momentum=cfg.momentum,
        initial_momentum=momentum,
        warmup_momentum=cfg.warmup_momentum,
        warmup_bias_lr=warmup_bias_lr,
        lr_scale=cfg.lr_scale,
    )


def _interp(x: int, x1: int, y0: float, y1: float) -> float:
    """np.interp(x, [0, x1], [y0, y1]) for 0 <= x <= x1, computed as numpy computes it (the same floats), without the
    cost of a numpy call per iteration: plan walks every window of a run."""
    if x == x1:
        return y1
    return (y1 - y0) / x1 * x + y0


def even_cuts(n: int, parts: int) -> list[int]:
    """Where n items are cut into `parts` consecutive runs whose lengths differ by at most one, longer ones last:
    parts + 1 offsets from 0 to n (a run is empty when n < parts)."""
    return [n * j // parts for j in range(parts + 1)]


def cut_sizes(n: int, parts: int) -> set[int]:
    """The lengths of the non-empty runs even_cuts(n, parts) makes: one length, or two that differ by one."""
    cuts = even_cuts(n, parts)
    return {b - a for a, b in zip(cuts, cuts[1:])} - {0}


def precise_bn_conflicts(cfg: Config) -> bool:
    """Whether cfg asks precise_bn to recompute statistics that bn=frozen keeps: its weights train against the running
    statistics, which a recompute would replace (what precise_bn=auto does with bn=frozen is precise_bn_count's)."""
    return cfg.bn == "frozen" and cfg.precise_bn not in ("auto", 0)


def check_precise_bn(cfg: Config) -> None:
    """A new run's precise_bn and bn: a count with bn=frozen is refused (a resumed one drops it: resume.load)."""
    if precise_bn_conflicts(cfg):
        raise UserError(
            f"precise_bn={cfg.precise_bn} would recompute the BatchNorm statistics bn=frozen keeps and its "
            "weights train against (in the fine-tuning study that broke every such run); remove precise_bn=, or use "
            "another bn"
        )


def check_bn_adapt(cfg: Config) -> None:
    """bn_adapt= adapts the statistics bn=frozen keeps: any other mode recomputes them as it trains, so it is refused
    there (a resumed run's check: resume.load)."""
    if cfg.bn_adapt and cfg.bn != "frozen":
        raise UserError(
            f"bn_adapt={cfg.bn_adapt} adapts the running statistics that bn=frozen keeps; with bn={cfg.bn} they train "
            "anyway: add bn=frozen, or remove bn_adapt="
        )


def check_batch(batch: int | float) -> None:
    """A schedule needs the micro-batch in images: train and plan resolve batch=-1 or a fraction first (autobatch)."""
    assert not is_auto_batch(batch), f"batch={batch} reached the schedule unresolved; autobatch.choose() resolves it"


def extend(planned: Schedule, epochs: int) -> Schedule:
    """A run's schedule continued to a new number of epochs (resume=... epochs=N): the lr decay, and with it every
    later epoch's lr, is rebuilt for `epochs`; the optimizer, lr0 and warmup stay as the run began (warmup_epochs is
    pinned to the length it had, which the longer run would otherwise let grow)."""
    warmup = min(planned.warmup_epochs, max(planned.epochs - 1, 0))
    return dataclasses.replace(planned, epochs=epochs, warmup_epochs=warmup)
