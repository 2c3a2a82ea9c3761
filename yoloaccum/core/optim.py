"""The optimizer: Ultralytics' parameter groups, with lr, momentum and weight decay taken from the schedule."""

from __future__ import annotations

import torch
from torch import nn

from yoloaccum.core.schedule import Schedule

# foreach: each update operation runs once over all tensors rather than once per tensor. On the CPU, where torch would
# loop per tensor, that makes the step faster with bit-identical results (tests/test_speed_settings.py); on CUDA it is
# torch's default anyway. NAdam's and RAdam's foreach versions round differently, so they keep torch's default.
_FOREACH = {"SGD", "Adam", "Adamax", "AdamW", "RMSprop"}


def build_optimizer(model: nn.Module, schedule: Schedule) -> torch.optim.Optimizer:
    """Groups as Ultralytics: weights with the scaled weight decay, norm-layer weights and biases without.

    Each group records its `initial_lr` (lr0, or 3 x lr0 for MuSGD's heads) and `param_group` name; set_hyperparameters
    derives the current values from those and the schedule.
    """
    name = schedule.optimizer
    norm_types = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    use_muon = name == "MuSGD"
    groups: dict[str, list[nn.Parameter]] = {"weight": [], "bn": [], "bias": [], "muon": []}
    for module in model.modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if use_muon and param.ndim in {2, 4}:  # muon orthogonalises matrices and conv filters only
                groups["muon"].append(param)
            elif param_name == "bias":
                groups["bias"].append(param)
            elif isinstance(module, norm_types) or "logit_scale" in param_name:
                groups["bn"].append(param)
            else:
                groups["weight"].append(param)
    spec = schedule.param_groups
    boosted = _head_cls_params(model) if use_muon else set()  # MuSGD trains the class heads at a higher lr
    param_groups = []
    for group, params in groups.items():
        for boost in (True, False) if use_muon else (False,):
            chosen = [p for p in params if (id(p) in boosted) == boost]
            if not chosen and (use_muon or group == "muon"):
                continue  # Ultralytics always has weight, bn and bias groups; the others only when used
            _, base_lr, decay = spec[f"{group}_head" if boost else group]
            param_groups.append(
                {
                    "params": chosen,
                    "param_group": group,
                    "weight_decay": decay,
                    "initial_lr": base_lr,
                    "lr": base_lr,
                    **({"use_muon": True} if group == "muon" else {}),
                }
            )
    args = schedule.optimizer_args
    if name == "MuSGD":
        from ultralytics.optim import MuSGD

        return MuSGD(param_groups, **args)
    foreach = True if name in _FOREACH else None  # None: torch's default
    return getattr(torch.optim, name)(param_groups, **args, foreach=foreach)


def _head_cls_params(model: nn.Module) -> set[int]:
    head = model.model[-1]
    return {
        id(p) for m in (getattr(head, "cv3", None), getattr(head, "one2one_cv3", None)) if m for p in m.parameters()
    }


def set_hyperparameters(optimizer: torch.optim.Optimizer, schedule: Schedule, ni: int) -> None:
    """Set every group's lr and momentum for the optimizer step taken after iteration ni."""
    momentum = schedule.momentum_at(ni)
    for g in optimizer.param_groups:
        g["lr"] = schedule.lr_at(ni, g["initial_lr"], bias=g["param_group"] == "bias")
        if "momentum" in g:  # as Ultralytics: SGD-style momentum only; Adam's betas stay as built
            g["momentum"] = momentum
