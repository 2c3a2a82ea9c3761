"""Precise BatchNorm statistics: recompute every BatchNorm layer's running mean and variance over N training images.

During training, BatchNorm's running statistics are an exponential average (momentum 0.03) of per-micro-batch
estimates. Small micro-batches make them noisy; few iterations per epoch leave them many epochs behind the weights.
Validation and inference read them, so both problems show up as a model that validates below what its weights can
do. As detectron2's PreciseBN and mmengine's hook, this recomputes them from a forward pass over N images.

Unlike an average of per-batch variances, which misses the variance between batches, each layer gets the mean and
variance over all N images of what it sees: per-channel sums of x and x^2 over every micro-batch (and every rank).
Upstream layers normalise with each micro-batch's own statistics during the pass (one pass, as detectron2 does), so
the cost is one forward pass over N images, with no augmentation (the images inference sees). recompute_layerwise
is the alternative that inference matches exactly, upstream layers normalising with their new running statistics,
at the cost of a pass per layer; docs/accuracy.md compares the two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from yoloaccum import distributed
from yoloaccum.distributed import Context

_BN = nn.modules.batchnorm._BatchNorm


class _Moments:
    """Per-channel count, sum of x and sum of x^2 of one layer's inputs, accumulated in float64."""

    def __init__(self, layer: _BN):
        self.sums = torch.zeros(3, layer.num_features, dtype=torch.float64, device=layer.running_mean.device)

    def __call__(self, layer: _BN, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0].detach()
        dims = [d for d in range(x.ndim) if d != 1]
        count = x.numel() // x.shape[1]
        # Each micro-batch's moments in float32 about its own mean (stable), then combined in float64.
        var, mean = torch.var_mean(x.float(), dim=dims, unbiased=False)
        mean, var = mean.double(), var.double()
        self.sums[0] += count
        self.sums[1] += mean * count
        self.sums[2] += (var + mean * mean) * count


def bn_layers(model: nn.Module) -> list[_BN]:
    return [m for m in model.modules() if isinstance(m, _BN) and m.track_running_stats]


@torch.no_grad()
def recompute(model: nn.Module, batches: Iterable[torch.Tensor], ctx: Context) -> int:
    """Set every BatchNorm layer's running statistics to those of all images in `batches`, summed over ranks.

    `batches` yields model inputs (float, on ctx.device). Every rank must call this together: one all-reduce of all
    layers' sums follows the pass. Returns the number of images seen by this rank. The model's modes are restored.
    """
    layers = bn_layers(model)
    if not layers:
        return 0
    moments = [_Moments(layer) for layer in layers]
    hooks = [layer.register_forward_pre_hook(m) for layer, m in zip(layers, moments)]
    modes = {m: m.training for m in model.modules()}
    model.eval()
    for layer in layers:
        layer.train()  # normalise with each micro-batch's statistics; its running update is overwritten below
    num_images = 0
    try:
        for img in batches:
            model(img)
            num_images += img.shape[0]
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes.items():
            m.train(training)
    _set_statistics(layers, moments, ctx)
    return num_images


class _Reached(Exception):
    """Raised by a hook to end a forward pass at the layer being measured: nothing after it is needed."""


@torch.no_grad()
def recompute_layerwise(model: nn.Module, batches: list[torch.Tensor], ctx: Context) -> None:
    """As recompute, but with every layer upstream of the one measured normalising with its new running statistics
    (eval mode), as inference will: each layer in the order the forward pass reaches it, one pass over all images
    per layer, each pass stopped at that layer. Exact for what inference sees, at about (layers / 2) passes' cost."""
    layers = bn_layers(model)
    reached: list[_BN] = []

    def note(layer: _BN, inputs: tuple[torch.Tensor, ...]) -> None:
        if layer not in reached:
            reached.append(layer)

    modes = {m: m.training for m in model.modules()}
    model.eval()
    hooks = [layer.register_forward_pre_hook(note) for layer in layers]
    try:
        model(batches[0][:1])  # the order the forward pass reaches the layers in
    finally:
        for h in hooks:
            h.remove()
    try:
        for layer in reached:
            moments = _Moments(layer)

            def measure(layer: _BN, inputs: tuple[torch.Tensor, ...], moments: _Moments = moments) -> None:
                moments(layer, inputs)
                raise _Reached

            hook = layer.register_forward_pre_hook(measure)
            try:
                for img in batches:
                    with contextlib.suppress(_Reached):
                        model(img)
            finally:
                hook.remove()
            _set_statistics([layer], [moments], ctx)  # from now on, the layers after it see what inference sees
    finally:
        for m, training in modes.items():
            m.train(training)


def _set_statistics(layers: list[_BN], moments: list[_Moments], ctx: Context) -> None:
    """Each layer's running mean and unbiased variance from its moments, summed over ranks in one all-reduce."""
    flat = distributed.all_reduce_sum(torch.cat([m.sums.flatten() for m in moments]), ctx)  # one collective
    for layer, sums in zip(layers, flat.split([m.sums.numel() for m in moments])):
        count, total, total_sq = sums.view(3, -1)
        if count[0] < 2:
            continue  # no images reached this layer: keep what it had
        mean = total / count
        var = (total_sq / count - mean * mean).clamp(min=0) * count / (count - 1)  # unbiased, as BatchNorm keeps it
        layer.running_mean.copy_(mean)
        layer.running_var.copy_(var)
