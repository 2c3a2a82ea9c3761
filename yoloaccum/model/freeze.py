"""freeze=: layers that do not train. Their parameters get no gradient and no update, and their BatchNorm layers keep
the running statistics they came with, in the model and in the EMA, bitwise.

Ultralytics' rule picks the layers: freeze=N freezes model.0 to model.N-1, a list freezes each index or module name
("23.cv2"), and DFL's fixed convolution is always frozen. Ultralytics also trains the frozen layers' BatchNorm
statistics; yoloaccum keeps them, as detectron2 and mmdetection do for a frozen backbone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from yoloaccum.errors import UserError

_BN = nn.modules.batchnorm._BatchNorm


def prefixes(freeze: int | list | None) -> tuple[str, ...]:
    """The module-name prefixes freeze= names, as Ultralytics' trainer builds them."""
    items = range(freeze) if isinstance(freeze, int) else (freeze or [])
    return tuple(f"model.{x}." for x in items)


def is_frozen(name: str, frozen: Iterable[str]) -> bool:
    """Whether a parameter or module name lies in a frozen layer (a DDP wrapper's "module." prefix included)."""
    return any(p in f"{name}." for p in frozen)


def apply(model: nn.Module, freeze: int | list | None) -> tuple[str, ...]:
    """Turn gradients off in the frozen layers; returns their prefixes. A list entry that names no layer, or a
    freeze that leaves nothing to train, is a user error."""
    frozen = prefixes(freeze)
    names = [n for n, _ in model.named_parameters()]
    if isinstance(freeze, list):
        for entry, prefix in zip(freeze, frozen):
            if not any(prefix in f"{n}." for n in names):
                raise UserError(
                    f"freeze={freeze}: {entry!r} names no layer of the model (layers 0 to "
                    f"{len(model.model) - 1}, or a module such as '23.cv2')"
                )
    for name, p in model.named_parameters():
        if is_frozen(name, frozen):
            p.requires_grad_(False)
    if frozen and not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"freeze={freeze} freezes the whole model ({len(model.model)} layers); freeze fewer")
    return frozen


def norms(model: nn.Module, frozen: Iterable[str]) -> list[_BN]:
    """The BatchNorm layers inside frozen layers."""
    frozen = tuple(frozen)
    return [m for n, m in model.named_modules() if isinstance(m, _BN) and frozen and is_frozen(n, frozen)]


def keep_statistics(model: nn.Module, frozen: Iterable[str]) -> None:
    """Put the frozen layers' BatchNorm in eval mode: they normalise with, and keep, their running statistics.
    Call it after every model.train()."""
    for m in norms(model, frozen):
        m.eval()


def keep_in_ema(ema, model: nn.Module, frozen: Iterable[str]) -> None:
    """Make ema.update leave the frozen layers' entries bitwise as the model holds them (FrozenInEMA)."""
    keep, update = FrozenInEMA(ema, model, frozen), ema.update

    def update_keeping_frozen(model: nn.Module) -> None:
        update(model)
        keep.restore()

    ema.update = update_keeping_frozen


class FrozenInEMA:
    """Keeps the EMA's copy of the frozen layers bitwise: the EMA's update (v = d v + (1 - d) v') would round a
    value it averages with itself, so the frozen entries are copied back from the model after each update."""

    def __init__(self, ema, model: nn.Module, frozen: Iterable[str]):
        frozen = tuple(frozen)
        own = model.state_dict()
        self.pairs = [(v, own[k]) for k, v in ema.ema.state_dict().items() if frozen and is_frozen(k, frozen)]

    @torch.no_grad()
    def restore(self) -> None:
        for ema_value, value in self.pairs:
            ema_value.copy_(value)
