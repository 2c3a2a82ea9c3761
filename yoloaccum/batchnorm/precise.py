"""Precise BatchNorm statistics: recompute every BatchNorm layer's running mean and variance over N training images.

During training, BatchNorm's running statistics are an exponential average (momentum 0.03) of per-micro-batch
estimates. Small micro-batches make them noisy; few iterations per epoch leave them many epochs behind the weights.
Validation and inference read them, so both problems show up as a model that validates below what its weights can
do. As detectron2's PreciseBN and mmengine's hook, this recomputes them from a forward pass over N images.

Unlike an average of per-batch variances, which misses the variance between batches, each layer gets the mean and
variance over all N images of what it sees: per-channel sums of x and x^2 over every micro-batch (and every rank).

Upstream layers normalise with each micro-batch's own statistics during the pass (one pass, as detectron2 does). With
one micro-batch of all N images that is exactly what inference will see: every layer upstream normalises with the
statistics of all N images of its input, which are the ones the recompute gives it (tests/test_precise_bn.py). Small
micro-batches add their own statistics' noise to every layer downstream: micro-batches of 16 left a run buried in
false positives, and micro-batches of 64 rescued it, as far as one batch of all 256 images did (docs/accuracy.md).
So the pass runs in micro-batches of BATCH images, halved while a device runs out of memory. Its cost is one forward
pass over N images. Which images: data.precise_bn_images (by default as the recipe's augmentation draws them); how many:
schedule.precise_bn_count.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from yoloaccum.core import backoff
from yoloaccum.core.buffers import Kept
from yoloaccum.core.micro_batch import model_input
from yoloaccum.distributed import ddp as distributed
from yoloaccum.distributed.ddp import Context
from yoloaccum.model import freeze

_BN = nn.modules.batchnorm._BatchNorm
BATCH = 64  # images per forward pass: as good as one pass of all 256 images on the runs measured (docs/accuracy.md)


class _Moments:
    """Per-channel count, sum of x and sum of x^2 of one layer's inputs, accumulated in float64.

    The layer computes each micro-batch's mean and variance itself (it normalises with them): with momentum 1 its
    running statistics are exactly those after every forward, so this hook only reads C numbers of each. Computing
    them again from the input, as the hook first did, cost as much as the forward pass (benchmarks/precise_bn.md)."""

    def __init__(self, layer: _BN):
        self.sums = torch.zeros(3, layer.num_features, dtype=torch.float64, device=layer.running_mean.device)

    def __call__(self, layer: _BN, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        x = inputs[0]
        count = x.numel() // x.shape[1]
        mean = layer.running_mean.double()
        var = layer.running_var.double() * (count - 1) / count  # BatchNorm keeps the unbiased estimate
        self.sums[0] += count
        self.sums[1] += mean * count
        self.sums[2] += (var + mean * mean) * count


def bn_layers(model: nn.Module, frozen: tuple[str, ...] = ()) -> list[_BN]:
    """The BatchNorm layers whose statistics are recomputed: all but those of layers freeze= froze."""
    return [
        m
        for n, m in model.named_modules()
        if isinstance(m, _BN) and m.track_running_stats and not freeze.is_frozen(n, frozen)
    ]


@torch.no_grad()
def recompute(model: nn.Module, batches: Iterable[torch.Tensor], ctx: Context, frozen: tuple[str, ...] = ()) -> int:
    """Set every BatchNorm layer's running statistics to those of all images in `batches`, summed over ranks; those
    of the layers freeze= froze (`frozen`) keep theirs.

    `batches` yields model inputs (float, on ctx.device). Every rank must call this together: one all-reduce of all
    layers' sums follows the pass. Returns the number of images seen by this rank. The model's modes are restored.
    """
    layers = bn_layers(model, frozen)
    if not layers:
        return 0
    moments = [_Moments(layer) for layer in layers]
    hooks = [layer.register_forward_hook(m) for layer, m in zip(layers, moments)]
    modes = {m: m.training for m in model.modules()}
    momenta = [layer.momentum for layer in layers]
    before = [Kept(layer) for layer in layers]  # put back where the pass fails, or where no image reached
    model.eval()
    for layer in layers:
        layer.train()  # normalise with each micro-batch's statistics; its running statistics become them (momentum 1)
        layer.momentum = 1.0
        layer.running_mean.zero_()  # 0 x a non-finite statistic would stay non-finite
        layer.running_var.fill_(1.0)
    num_images = 0
    try:
        for img in batches:
            model(img)
            num_images += img.shape[0]
    except BaseException:
        for kept in before:
            kept.put_back()
        raise
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes.items():
            m.train(training)
        for layer, momentum in zip(layers, momenta):
            layer.momentum = momentum
    for i in _set_statistics(layers, moments, ctx):
        before[i].put_back()
    return num_images


def recompute_images(
    model: nn.Module, images: torch.Tensor, ctx: Context, batch: int = BATCH, frozen: tuple[str, ...] = ()
) -> int:
    """recompute over `images` (this rank's, uint8 NCHW on the host) in micro-batches of `batch` images, halved on
    out-of-memory until a pass fits. Returns the micro-batch that fitted, to start from next time. A rank that backs
    off reaches the all-reduce after the pass later, never a different one, so the ranks stay matched."""
    while True:
        try:
            parts = images.split(batch) if len(images) else ()  # a rank with no images still joins the all-reduce
            recompute(model, (model_input(x, ctx.device) for x in parts), ctx, frozen)
            return batch
        except RuntimeError as e:
            if not backoff.is_out_of_memory(e) or batch == 1:
                raise
            batch //= 2
            torch.cuda.empty_cache()


def _set_statistics(layers: list[_BN], moments: list[_Moments], ctx: Context) -> list[int]:
    """Each layer's running mean and unbiased variance from its moments, summed over ranks in one all-reduce.
    Returns the layers no image reached (in eval mode, a branch only training runs): they keep what they had."""
    flat = distributed.all_reduce_sum(torch.cat([m.sums.flatten() for m in moments]), ctx)  # one collective
    unreached = []
    for i, (layer, sums) in enumerate(zip(layers, flat.split([m.sums.numel() for m in moments]))):
        count, total, total_sq = sums.view(3, -1)
        if count[0] < 2:
            unreached.append(i)
            continue
        mean = total / count
        var = (total_sq / count - mean * mean).clamp(min=0) * count / (count - 1)  # unbiased, as BatchNorm keeps it
        layer.running_mean.copy_(mean)
        layer.running_var.copy_(var)
    return unreached
