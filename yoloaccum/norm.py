"""bn=window: BatchNorm for small micro-batches, normalising with the statistics of the last images of the window.

At micro-batch 2 each BatchNorm layer normalises with the mean and variance of 2 images, noise the network learns
under and that no recompute of the running statistics (precise_bn) can take back. WindowBatchNorm2d normalises
instead with the statistics of the last `window` images this layer saw (by default nbs / devices, the accumulation
window's images on this rank), across micro-batches and windows: each micro-batch's per-channel mean and mean of
squares go into a small queue, and the pooled mean and variance of the queue and the current micro-batch are what it
normalises with in the forward pass.

The gradient is Batch Renormalization's (Ioffe 2017): y = ((x - mu_B) / sigma_B * r + d) * gamma + beta with
r = sigma_B / sigma and d = (mu_B - mu) / sigma taken as constants, so that the forward uses the window's mu and sigma
exactly, while the backward goes through the micro-batch's own statistics. r and d are clipped (R_MAX, D_MAX) so that
a micro-batch far from the window cannot blow a layer's output up. Inside one accumulation window the weights do not
change, so statistics of earlier micro-batches of the window are those the current weights give (Cross-Iteration BN's
observation); those from before the last optimizer step are one step old.

The window is counted in images, not micro-batches, so an out-of-memory back-off (half the micro-batch, twice the
micro-steps) normalises over the same images. The queue lives in non-persistent buffers: the state_dict, the EMA,
best.pt and last.pt's weights are a plain BatchNorm2d's, and the trainer keeps the queue for an exact resume apart
(state() / load_state()). In eval mode the layer is a plain BatchNorm2d on its running statistics, which training
updates with the pooled statistics it normalised with.
"""

from __future__ import annotations

import torch
from torch import nn

from yoloaccum.errors import UserError

R_MAX, D_MAX = 3.0, 5.0  # Batch Renormalization's final clipping values


class _Window:
    """Which queued micro-batches the window keeps, shared by all WindowBatchNorm2d layers of one model: every layer
    sees the same micro-batches, so this is worked out once per forward, by hooks on the model, not once per layer.

    The queue has as many slots as the window has images (a micro-batch holds at least one). `count` is each slot's
    images (0: empty), `age` orders the slots (larger is newer). Both are buffers of every layer (the same tensors),
    so that whatever puts a model's buffers back (a skipped window, a back-off, a recomputation) puts them back too.
    """

    def __init__(self, images: int, device: torch.device):
        self.images = int(images)
        slots = max(self.images, 1)
        self.count = torch.zeros(slots, device=device)
        self.age = torch.full((slots,), -1.0, device=device)
        self.clock = torch.zeros((), device=device)
        self.kept = self.total = self.slot = None  # this forward's: set by before()

    def before(self, module: nn.Module, args) -> None:
        """Before the model's forward in training: the kept images of each slot beside the micro-batch's, their total,
        and the slot the micro-batch goes into (the oldest, never a kept one)."""
        if not module.training:
            return
        with torch.no_grad():
            images = args[0].shape[0]
            order = torch.argsort(self.age, descending=True)
            counts = self.count[order]
            fits = (counts.cumsum(0) + images <= self.images) & (counts > 0)
            self.kept = torch.zeros_like(counts).index_copy_(0, order, torch.where(fits, counts, 0.0))
            self.total = self.kept.sum() + images
            self.slot = torch.argmin(self.age).reshape(1)

    def after(self, module: nn.Module, args, output) -> None:
        if not module.training:
            return
        with torch.no_grad():
            self.count.index_fill_(0, self.slot, float(args[0].shape[0]))
            self.age.index_copy_(0, self.slot, self.clock.reshape(1))
            self.clock.add_(1)


class WindowBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d that, in training, normalises with the pooled statistics of its model's window (see _Window)."""

    def __init__(self, num_features: int, window: _Window, eps: float = 1e-5, momentum: float | None = 0.1, **kwargs):
        super().__init__(num_features, eps=eps, momentum=momentum, **kwargs)
        self.window = window
        device = window.count.device
        self.register_buffer("queue_count", window.count, persistent=False)
        self.register_buffer("queue_age", window.age, persistent=False)
        self.register_buffer("queue_clock", window.clock, persistent=False)
        # per slot: the micro-batch's per-channel mean, then its mean of squares
        self.register_buffer("queue_moments", torch.zeros(window.count.numel(), 2 * num_features, device=device),
                             persistent=False)  # fmt: skip

    @classmethod
    def from_batchnorm(cls, bn: nn.BatchNorm2d, window: _Window) -> WindowBatchNorm2d:
        """A WindowBatchNorm2d sharing bn's parameters and running statistics (the same tensors)."""
        new = cls(bn.num_features, window, eps=bn.eps, momentum=bn.momentum, affine=bn.affine,
                  track_running_stats=bn.track_running_stats, device=bn.running_mean.device)  # fmt: skip
        new.weight, new.bias = bn.weight, bn.bias
        new.running_mean, new.running_var, new.num_batches_tracked = (
            bn.running_mean,
            bn.running_var,
            bn.num_batches_tracked,
        )
        new.train(bn.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        w, images, values = self.window, x.shape[0], x.numel() // x.shape[1]
        with torch.no_grad():
            # The micro-batch's mean and mean of squares in float32: sums, which are fast in any memory layout
            # (torch.var_mean is several times slower than BatchNorm itself on the CPU).
            xf = x if x.dtype == torch.float32 else x.float()
            moments_b = torch.cat([xf.sum((0, 2, 3)), (xf * xf).sum((0, 2, 3))]) / values
            pooled = torch.addmv(moments_b * images, self.queue_moments.t(), w.kept) / w.total
            # row 0 the micro-batch's, row 1 the window's: (mean, std) of both in one go (few ops: each costs a
            # dispatch, and the layers are many and small)
            means, squares = torch.stack([moments_b, pooled]).chunk(2, dim=1)
            var = (squares - means * means).clamp_(min=0)
            std = var.add(self.eps).sqrt_()
            r = (std[0] / std[1]).clamp_(1 / R_MAX, R_MAX)
            d = ((means[0] - means[1]) / std[1]).clamp_(-D_MAX, D_MAX)
            self.queue_moments.index_copy_(0, w.slot, moments_b.reshape(1, -1))
            if self.track_running_stats:  # what training normalised with (biased: the count is hundreds or more)
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 0.1
                torch._foreach_lerp_([self.running_mean, self.running_var], [means[1], var[1]], momentum)
        # Renormalised: gamma * (xhat_B * r + d) + beta, with r and d constants, is BatchNorm over the micro-batch
        # with weight gamma * r and bias beta + gamma * d: its forward is the window's normalisation (exactly, unless
        # r or d was clipped), its backward BatchNorm's through the micro-batch's statistics.
        weight = self.weight * r if self.affine else r
        bias = torch.addcmul(self.bias, self.weight, d) if self.affine else d
        return torch.nn.functional.batch_norm(x, None, None, weight, bias, True, 0.0, self.eps)


def convert(model: nn.Module, images: int) -> int:
    """Replace every BatchNorm2d in model by a WindowBatchNorm2d over the last `images` images, in place, sharing
    parameters and running statistics, with one window for all (hooks on model keep it). Returns how many were
    replaced; a model without BatchNorm is a user error."""
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.BatchNorm2d]  # fmt: skip
    if not found:
        raise UserError("bn=window needs BatchNorm2d layers, and this model has none; use bn=batch")
    window = _Window(images, found[0][2].running_mean.device)
    for parent, name, child in found:
        setattr(parent, name, WindowBatchNorm2d.from_batchnorm(child, window))
    model.register_forward_pre_hook(window.before)
    model.register_forward_hook(window.after)
    return len(found)


def layers(model: nn.Module) -> list[tuple[str, WindowBatchNorm2d]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, WindowBatchNorm2d)]


def state(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The queues, on the host, for last.pt (they are not in the state_dict)."""
    return {n: {k: b.detach().cpu().clone() for k, b in m.named_buffers(recurse=False) if k.startswith("queue_")}
            for n, m in layers(model)}  # fmt: skip


def load_state(model: nn.Module, saved: dict[str, dict[str, torch.Tensor]]) -> None:
    for n, m in layers(model):
        for k, b in m.named_buffers(recurse=False):
            if k.startswith("queue_"):
                b.copy_(saved[n][k])
