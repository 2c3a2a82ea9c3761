"""bn=window: BatchNorm for small micro-batches: every micro-batch of a window normalised with the whole window's
statistics, as one batch of the window's images would be.

At micro-batch 2 each BatchNorm layer of bn=batch normalises with the mean and variance of 2 images, noise the
network learns under and that no recompute of the running statistics (precise_bn) takes back. Inside one
accumulation window the weights do not change, so the window's statistics can be known before its first micro-step:
a statistics pass, a forward pass without gradients over the window's images (WindowStatistics, which the Engine
runs at each window's start), gives every layer the mean and variance of its input over the window, each layer
upstream normalising with the window's statistics too. The micro-steps then normalise with them (WindowBatchNorm2d):
each micro-batch's forward is exactly that of the window as one batch.

What a micro-batch cannot have is the gradient through the statistics of images it does not hold. Its gradient is
Batch Renormalization's (Ioffe 2017): y = gamma * (xhat_B * r + d) + beta with r = sigma_B / sigma and
d = (mu_B - mu) / sigma taken as constants, so the forward is the window's normalisation and the backward goes
through the micro-batch's own statistics; r and d are clipped (R_MAX, D_MAX). Measured inside a real batch of 64
(benchmarks/bn_ghost.py) this recovers what per-micro-batch statistics lose, where the earlier bn=window, a queue
of past micro-batches' statistics one optimizer step old, did not (benchmarks/records/batchnorm-tried.md).

The pass costs one forward pass (no backward) over the window's images, in chunks of up to `chunk` images (all of
them by default), halved when the device runs out of memory; bn_window can cap the images it passes. It also
updates the running statistics, once per window with the window's statistics, as a real batch's step does. The
layers hold the window's statistics in non-persistent buffers: the state_dict, the EMA, best.pt and last.pt are
those of plain BatchNorm2d layers, and there is nothing to keep for a resume: each window's statistics come from
its own images.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from yoloaccum.core import backoff
from yoloaccum.core.micro_batch import model_input
from yoloaccum.errors import UserError
from yoloaccum.model import freeze

R_MAX, D_MAX = 3.0, 5.0  # Batch Renormalization's final clipping values


class WindowBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d that, in training, normalises with the statistics its model's last statistics pass gave it
    (before the first pass: mean 0 and variance 1, which no optimizer step ever sees, as the Engine passes over each
    window before its first micro-step). In eval mode it is a plain BatchNorm2d. During a pass (`_sums` set) it
    normalises with the chunk's own statistics and adds them up.

    Its training forward has a single branch, so that a compiled model's graphs (compile=True) are those training
    runs; the pass itself runs eager (WindowStatistics)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, **kwargs: Any):
        super().__init__(num_features, eps=eps, momentum=momentum, **kwargs)
        device = self.running_mean.device
        # the window's mean and biased variance as the pass leaves them, for inspection and the tests
        self.register_buffer("window_mean", torch.zeros(num_features, device=device), persistent=False)
        self.register_buffer("window_var", torch.ones(num_features, device=device), persistent=False)
        # what the micro-steps read, computed once a window: 1 / sqrt(window_var + eps) and -window_mean * that
        self.register_buffer(
            "window_invstd", torch.full((num_features,), (1 + eps) ** -0.5, device=device), persistent=False
        )
        self.register_buffer("window_shift", torch.zeros(num_features, device=device), persistent=False)
        self._sums: torch.Tensor | None = None  # during a pass: count, sum and sum of squares per channel (float64)
        self._chunk_mean = self._chunk_var = None  # during a pass: scratch for batch_norm's statistics of a chunk
        self._count = 0  # during a pass: the values per channel so far, on the host (no read-back to branch on it)

    @classmethod
    def from_batchnorm(cls, bn: nn.BatchNorm2d) -> WindowBatchNorm2d:
        """A WindowBatchNorm2d sharing bn's parameters and running statistics (the same tensors)."""
        new = cls(
            bn.num_features,
            eps=bn.eps,
            momentum=bn.momentum,
            affine=bn.affine,
            track_running_stats=bn.track_running_stats,
            device=bn.running_mean.device,
        )
        new.weight, new.bias = bn.weight, bn.bias
        new.running_mean, new.running_var = bn.running_mean, bn.running_var
        new.num_batches_tracked = bn.num_batches_tracked
        new.train(bn.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        if self._sums is not None:
            return self._collect(x)
        return _Renormalize.apply(x, self.weight, self.bias, self.window_invstd, self.window_shift, self.eps)

    def _collect(self, x: torch.Tensor) -> torch.Tensor:
        """In a statistics pass: normalise the chunk with its own statistics (those of the whole window when the pass
        is one chunk) and add its per-channel moments to the window's."""
        y = F.batch_norm(x, self._chunk_mean, self._chunk_var, self.weight, self.bias, True, 1.0, self.eps)
        count = x.numel() // x.shape[1]
        self._count += count
        mean = self._chunk_mean.double()
        var = self._chunk_var.double() * ((count - 1) / count if count > 1 else 0.0)  # batch_norm keeps it unbiased
        self._sums += torch.stack([torch.full_like(mean, count), mean * count, (var + mean * mean) * count])
        return y

    def _start(self) -> None:
        self._sums = torch.zeros(3, self.num_features, dtype=torch.float64, device=self.running_mean.device)
        self._chunk_mean, self._chunk_var = torch.zeros_like(self.running_mean), torch.ones_like(self.running_var)
        self._count = 0

    def _finish(self) -> None:
        """The window's mean and (biased) variance from the pass's moments; the running statistics updated once, as
        BatchNorm's step over one batch of the window would update them."""
        count, total, total_sq = self._sums
        self._sums = self._chunk_mean = self._chunk_var = None
        if self._count < 1:  # no image reached this layer
            return
        mean = total / count
        var = (total_sq / count - mean * mean).clamp(min=0)
        self.window_mean.copy_(mean)
        self.window_var.copy_(var)
        invstd = (var + self.eps).rsqrt()
        self.window_invstd.copy_(invstd)
        self.window_shift.copy_(-mean * invstd)
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            momentum = self.momentum if self.momentum is not None else 0.1
            unbiased = var * count / (count - 1) if self._count > 1 else var
            self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
            self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)


class _Renormalize(torch.autograd.Function):
    """Batch Renormalization of one micro-batch against its window's statistics, one batch-norm kernel each way.

    y = gamma * (xhat_B * r + d) + beta, with xhat_B the micro-batch's own normalisation and r = sigma_B / sigma,
    d = (mu_B - mu) / sigma constants clipped to [1/R_MAX, R_MAX] and [-D_MAX, D_MAX]: that is BatchNorm over the
    micro-batch with weight gamma * r and bias beta + gamma * d. Unclipped, its forward is the window's normalisation
    and its backward BatchNorm's, through the micro-batch's own statistics.

    Written as a Function for speed on small micro-batches: the micro-batch's statistics come from one ATen call
    (batch_norm_update_stats, fast on the channels-last activations where plain sums are not), the forward applies
    them as an eval-mode batch_norm does, and the backward is ATen's batch_norm backward given those statistics.
    Composed of autograd operations (sums, then a training batch_norm) the layer cost 1.3x-1.4x BatchNorm2d's
    training step at micro-batch 2 and 8; see docs/batchnorm.md. Differentiable once: nothing in yoloaccum takes a
    gradient of a gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, window_invstd, window_shift, eps):  # type: ignore[override]
        # the micro-batch's mean and biased variance in one ATen call; fp16 and bf16 (autocast) in float32, since the
        # CPU's kernel would return them in the input's precision
        low = x.dtype in (torch.float16, torch.bfloat16)
        mean_b, var_b = torch.batch_norm_update_stats(x.float() if low else x, None, None, 0.0)
        invstd_b = (var_b + eps).rsqrt()
        r = torch.div(window_invstd, invstd_b).clamp_(1 / R_MAX, R_MAX)
        d = torch.addcmul(window_shift, mean_b, window_invstd).clamp_(-D_MAX, D_MAX)
        scale = weight * r if weight is not None else r
        shift = torch.addcmul(bias, weight, d) if weight is not None else d
        ctx.save_for_backward(x, scale, mean_b, invstd_b, r, d)
        ctx.affine = weight is not None
        # eps given to batch_norm, which adds it to var_b as invstd_b has it: torch 2.11 refuses eps=0 even in eval
        # mode ("batch_norm eps must be positive"; 2.14 only in training), which the pyproject allows (docs/gpu.md)
        return F.batch_norm(x, mean_b, var_b, scale, shift, False, 0.0, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        x, scale, mean_b, invstd_b, r, d = ctx.saved_tensors
        affine = ctx.affine and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        mask = [ctx.needs_input_grad[0], affine, affine]
        dx, dscale, dshift = torch.ops.aten.native_batch_norm_backward(
            grad, x, scale, None, None, mean_b, invstd_b, True, 0.0, mask
        )
        if not affine:
            return dx, None, None, None, None, None
        # through scale = gamma * r and shift = beta + gamma * d
        return dx, dscale.mul_(r).addcmul_(dshift, d), dshift, None, None, None


class WindowStatistics:
    """bn=window's statistics pass over a window's images, for the Engine to run before the window's micro-steps.

    `images`: at most this many of the window's images per device (0: all of them). `chunk`: images per forward pass
    of the statistics pass (0: all at once, which makes the statistics exact); halved while the device runs out of
    memory. The pass runs the model's training-mode forward without gradients, so the model must be the raw model,
    not a DDP wrapper: each rank's statistics are those of its own images, and no collective runs."""

    def __init__(
        self,
        model: nn.Module,
        images: int = 0,
        chunk: int = 0,
        amp: bool = False,
        amp_dtype: torch.dtype = torch.float16,
    ):
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, WindowBatchNorm2d)]
        assert self.layers, "norm.convert the model first"
        self.images = images
        self.chunk = chunk
        self.amp, self.amp_dtype = amp, amp_dtype  # as the micro-steps run: the statistics of the same activations

    @torch.no_grad()
    def __call__(self, batches: list[dict[str, Any]]) -> None:
        """Set every layer's window statistics to those of the images of `batches` (loader batches, whose "img" the
        micro-steps may already have made the model's input: a back-off runs the pass again)."""
        device = self.layers[0].running_mean.device
        # multi_scale= gives a window's micro-batches different sizes: each size is its own forward, and the sums
        # over all of them make the window's statistics as the micro-steps will see its images
        imgs = [model_input(b["img"], device) for b in batches]
        if self.images:
            imgs = _first(imgs, self.images)
        if len({x.shape[1:] for x in imgs}) == 1:
            imgs = [torch.cat(imgs)]
        largest = max(len(x) for x in imgs)
        while True:
            try:  # eager: compile=True compiled the training forward, and the pass is not worth its own graphs
                autocast = torch.autocast(device.type, dtype=self.amp_dtype, enabled=self.amp)
                with torch.compiler.set_stance("force_eager"), autocast:
                    self._pass(imgs)
                return
            except RuntimeError as e:
                if not backoff.is_out_of_memory(e) or self._chunk(largest) == 1:
                    raise
                self.chunk = self._chunk(largest) // 2
                torch.cuda.empty_cache()

    def _chunk(self, n: int) -> int:
        return min(self.chunk or n, n)

    def _pass(self, imgs: list[torch.Tensor]) -> None:
        for layer in self.layers:
            layer._start()
        try:
            for same_size in imgs:
                for part in same_size.split(self._chunk(len(same_size))):
                    self.model(part)
        except BaseException:
            for layer in self.layers:
                layer._sums = None
            raise
        for layer in self.layers:
            layer._finish()


def _first(imgs: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The first n images of a list of image batches, as a list of batches."""
    out = []
    for x in imgs:
        if n <= 0:
            break
        out.append(x[:n])
        n -= len(x)
    return out


def convert(model: nn.Module, frozen: tuple[str, ...] = ()) -> int:
    """Replace every BatchNorm2d in model by a WindowBatchNorm2d, in place, sharing parameters and running statistics;
    those of layers freeze= froze stay as they are (they keep their running statistics). Returns how many were
    replaced; a model without BatchNorm is a user error."""
    found = [
        (parent, name, child)
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if type(child) is nn.BatchNorm2d and not freeze.is_frozen(f"{parent_name}.{name}", frozen)
    ]
    if not found:
        raise UserError("bn=window needs BatchNorm2d layers, and this model has none; use bn=batch")
    for parent, name, child in found:
        setattr(parent, name, WindowBatchNorm2d.from_batchnorm(child))
    return len(found)
