"""The detection loss, normalised over the whole accumulation window (norm=window) or per micro-batch (norm=micro).

Ultralytics divides the box, cls and dfl/l1 sums of a micro-batch by that micro-batch's target-score sum T, so a
micro-batch with few objects weighs as much as one with many. With norm=window each micro-batch back-propagates its
unnormalised sums S, and once the window's last forward pass has made the window's T known, the accumulated gradients
are rescaled by images / T. Gradients are linear in the loss, so this equals the gradient of one batch made of all the
window's images, without a second forward pass. The loss code itself stays Ultralytics': we wrap its assigner to
read T, and call its own branches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from yoloaccum.errors import UserError


def _quiet(message: str) -> None:
    pass


class _TargetScoreSum:
    """Wraps a TaskAlignedAssigner to keep the target-score sum T of the last call, on the device (no host sync)."""

    def __init__(self, assigner: nn.Module):
        self.assigner = assigner
        self.last: torch.Tensor | None = None
        self.log: Callable[[str], None] = _quiet

    def __call__(self, *args, **kwargs):
        # Ultralytics' assigner catches its own out-of-memory error and assigns one image at a time instead (the same
        # targets, slower), warning through its logger, which yoloaccum keeps quiet: say it here, once.
        warned = getattr(self.assigner, "_oom_warned", True)
        out = self.assigner(*args, **kwargs)
        if not warned and getattr(self.assigner, "_oom_warned", False):
            self.log(
                "[yellow]warning:[/] the loss's target assignment ran out of device memory and now assigns one "
                "image at a time (the same targets, slower); a smaller batch or grad_checkpointing=True avoids "
                "it"
            )
        self.last = out[2].detach().sum()  # (_, target_bboxes, target_scores, fg_mask, target_gt_idx)
        return out

    def __getattr__(self, name: str):
        if name == "assigner":  # not set yet (copy and pickle build the object without __init__)
            raise AttributeError(name)
        return getattr(self.assigner, name)


@dataclass
class _Branch:
    """One normalised term of the criterion: Ultralytics' loss for one head output, with its own T."""

    loss: object  # a v8DetectionLoss
    key: str | None  # which output of the head it reads ("one2many", "one2one"), None for single-head models
    weight: Callable[[], float]  # E2ELoss's o2m/o2o gains change every epoch
    tss: _TargetScoreSum


class WindowLoss:
    """The model's own Ultralytics criterion, driven per micro-batch and normalised per window.

    Per micro-batch, `__call__` returns the loss to back-propagate, the detached loss items for logging, and a
    count vector [images, T_0, T_1, ...] to be summed over the window (and over ranks). After the window's last
    backward, `normalise_gradients(window_counts, world)` rescales the accumulated gradients once.

    YOLO26's end-to-end loss has two branches with different T (one-to-many and one-to-one). The one-to-one head sees
    detached features, so the branches train disjoint parameters and each parameter is rescaled by its own branch.
    """

    def __init__(self, model: nn.Module, norm: str):
        from ultralytics.utils.loss import E2ELoss, v8DetectionLoss

        self.norm = norm
        self.criterion = model.criterion = model.init_criterion()
        c = self.criterion
        if isinstance(c, E2ELoss):
            specs = [(c.one2many, "one2many", lambda: c.o2m), (c.one2one, "one2one", lambda: c.o2o)]
        elif type(c) is v8DetectionLoss:
            specs = [(c, None, lambda: 1.0)]
        else:
            raise UserError(f"{type(c).__name__} is not a detection loss; yoloaccum trains detection models only")
        self.branches = []
        for loss, key, weight in specs:
            loss.assigner = tss = _TargetScoreSum(loss.assigner)
            self.branches.append(_Branch(loss, key, weight, tss))
        head = model.model[-1]
        one2one = {id(p) for m in getattr(head, "one2one", {}).values() for p in m.parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [[p for p in params if id(p) not in one2one], [p for p in params if id(p) in one2one]]
        self._param_groups = groups[: len(self.branches)]
        assert sum(map(len, self._param_groups)) == len(params)

    def set_log(self, log: Callable[[str], None]) -> None:
        """Where the loss says what it changed by itself (its assigner's out-of-memory fallback)."""
        for b in self.branches:
            b.tss.log = log

    def param_groups(self) -> list[list[nn.Parameter]]:
        """The parameters each branch trains, in branch order; disjoint, and together all trainable parameters."""
        return self._param_groups

    def __call__(self, preds, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        preds = preds[1] if isinstance(preds, tuple) else preds
        num_images = batch["img"].shape[0]
        if self.norm == "micro":  # exactly Ultralytics: the criterion's own call, loss x micro-batch size
            loss, items = self.criterion(preds, batch)
            loss = loss.sum()
        else:
            loss = 0.0
            for b in self.branches:
                vec, items = b.loss.get_assigned_targets_and_loss(preds[b.key] if b.key else preds, batch)[1:]
                # vec is S / max(T, 1): multiplying by the (constant) max(T, 1) leaves S, the unnormalised sum.
                loss = loss + b.weight() * vec.sum() * b.tss.last.clamp(min=1)
        ts = [b.tss.last for b in self.branches]
        images = torch.full((), float(num_images), device=ts[0].device)  # a fill, not a host-to-device copy: no sync
        counts = torch.stack([images, *ts])
        return loss, torch.stack(list(items.values())), counts

    def normalise_gradients(self, window_counts: torch.Tensor, world: int) -> None:
        """Rescale the window's accumulated gradients in place, once, before unscale, clip and step.

        window_counts is the sum of the micro-batches' count vectors over the window and over all ranks. With
        norm=window each branch's parameters are multiplied by images / max(T, 1) of the whole window. DDP averages
        gradients over ranks, so `world` restores the sum over images in both modes.
        """
        for j, params in enumerate(self._param_groups):
            if self.norm == "micro":
                if world == 1:
                    continue  # exactly Ultralytics: nothing to do
                factor = float(world)
            else:
                factor = world * window_counts[0] / window_counts[1 + j].clamp(min=1)  # stays on the device
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], factor)

    def end_epoch(self) -> None:
        """E2ELoss decays its one-to-many gain once per epoch, as Ultralytics' trainer does."""
        if hasattr(self.criterion, "update"):
            self.criterion.update()
