"""Build Ultralytics' DetectionModel from a model YAML (or a .pt), with the dataset's classes and local weights."""

from __future__ import annotations

import contextlib
import re
import types
from pathlib import Path

import torch
from torch import nn

from yoloaccum.config.settings import Config
from yoloaccum.config.ultra import ultralytics_args
from yoloaccum.core.buffers import Kept, kept
from yoloaccum.data.datasets import DatasetSpec
from yoloaccum.errors import UserError
from yoloaccum.model import checkpoint, freeze


def resolve_yaml(name: str) -> str:
    """A model YAML by path, or by Ultralytics name (yolo26n.yaml: architecture yolo26, scale n)."""
    from ultralytics.nn.tasks import yaml_model_load

    if Path(name).is_file():
        return str(Path(name).resolve())
    if Path(name).is_dir():
        raise UserError(f"model={name} is a folder; give a model YAML such as yolo26n.yaml, or a .pt file")
    try:
        yaml_model_load(name)  # searches Ultralytics' cfg/models folders; never downloads a non-URL name
    except FileNotFoundError as e:
        raise UserError(
            f"model {name} does not exist; give a model YAML such as yolo26n.yaml or yolo11s.yaml, "
            "a path to one, or a local .pt file"
        ) from e
    return name


# Ultralytics' released detection weights, which `yolo train model=yolo26n.pt` downloads by name.
_RELEASED = re.compile(r"^(yolov?\d+[a-z]*|rtdetr-[a-z]+)(-[a-z0-9]+)?\.pt$", re.IGNORECASE)


def load_weights(path: str, trust: bool) -> nn.Module:
    """The fp32 model of a local .pt; a released name that is not on disk says where to get it."""
    if not Path(path).exists() and _RELEASED.match(path):
        raise UserError(
            f"{path} is not here, and yoloaccum downloads nothing: download it from Ultralytics' releases "
            f"(https://github.com/ultralytics/assets/releases, or `yolo predict model={path}` on a machine with "
            f"ultralytics and a network) and give its path, e.g. model=weights/{path}"
        )
    return checkpoint.model_of(checkpoint.load(path, trust))


def build(cfg: Config, spec: DatasetSpec, verbose: bool = False, announce: bool = True) -> nn.Module:
    """The model to train: from cfg.model (YAML or .pt), sized for the dataset, with cfg.pretrained weights loaded
    as Ultralytics loads them (DetectionModel.load: what matches by name and shape, the class head's hidden layers
    at the source's width, and with cls_remap its rows for classes of the same name)."""
    from ultralytics.nn.tasks import DetectionModel

    source, source_path = None, None
    if str(cfg.model).endswith(".pt"):
        source, source_path = load_weights(cfg.model, cfg.trust_weights), cfg.model
        model = DetectionModel(source.yaml, nc=spec.nc, verbose=verbose)
        if cfg.pretrained is False:  # as Ultralytics: the .pt's architecture, trained from scratch
            source = None
    else:
        model = DetectionModel(resolve_yaml(cfg.model), nc=spec.nc, verbose=verbose)
    model.args = ultralytics_args(cfg)  # the loss reads its gains (box, cls, dfl) and epochs from here
    if isinstance(cfg.pretrained, str):
        source, source_path = load_weights(cfg.pretrained, cfg.trust_weights), cfg.pretrained
    # Before loading: with cls_remap the class rows follow the names (placeholder names match nothing)
    model.names = dict(spec.names) if cfg.cls_remap else {i: str(i) for i in range(spec.nc)}
    if source is not None:
        matched, total = load_pretrained(model, source)
        if not matched:
            raise UserError(f"no tensor of {source_path} matches {cfg.model}; check the architecture")
        if announce:
            classes = "" if len(source.names) == spec.nc else f" ({len(source.names)} classes -> {spec.nc})"
            print(f"pretrained: transferred {matched}/{total} tensors from {source_path}{classes}")
    model.names = dict(spec.names)
    return model


def load_pretrained(model: nn.Module, source: nn.Module) -> tuple[int, int]:
    """Ultralytics' transfer of source's weights into model (DetectionModel.load); returns (tensors of model that
    source has by name and shape, tensors of model)."""
    model.load(source, verbose=False)
    theirs, own = source.state_dict(), model.state_dict()
    return sum(k in theirs and theirs[k].shape == v.shape for k, v in own.items()), len(own)


def set_bn_mode(model: nn.Module, bn: str, frozen: tuple[str, ...] = ()) -> None:
    """After model.train(): with bn=frozen every BatchNorm layer, and those of the layers freeze= froze in any mode,
    normalise with and keep their running statistics (bn=frozen's affine still trains)."""
    if bn == "frozen":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    freeze.keep_statistics(model, frozen)


def checkpoint_blocks(model: nn.Module) -> None:
    """grad_checkpointing=True: each block of the model (model.model[i]) keeps only its input for backward and runs
    its forward again there, so a micro-batch holds a fraction of its activations, at the cost of a second forward.

    The detection head is the exception: it runs a tower of convolutions per scale and per branch (one-to-many and,
    in end-to-end heads, one-to-one), and together they save more for backward than any other block (a quarter of
    yolo26n's activations). Each tower is checkpointed on its own instead, so backward recomputes one at a time.

    The forward is replaced on the instance, as a method bound to it, so that a deepcopy (the EMA, validation) runs
    its own copy; the state_dict and the checkpoints written are unchanged. Call it after the EMA is made: the EMA
    only evaluates and needs none of this.
    """
    for block in model.model:
        for unit in checkpoint_units(block):
            unit.forward = types.MethodType(_checkpointed_forward, unit)


def checkpoint_units(block: nn.Module) -> list[nn.Module]:
    """The modules of a block that grad_checkpointing recomputes as units: the block, or a head's towers."""
    from ultralytics.nn.modules.head import Detect

    if not isinstance(block, Detect):
        return [block]
    towers = [child for child in block.children() if isinstance(child, nn.ModuleList)]
    return [tower for towers_ in towers for tower in towers_]


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    forward = type(self).forward.__get__(self)
    if not (self.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    # Non-reentrant checkpointing takes any inputs (Concat and the head get lists) and works under DDP and autocast.
    return checkpoint(forward, *args, use_reentrant=False, context_fn=lambda: _recompute_contexts(self), **kwargs)


def _recompute_contexts(block: nn.Module):
    """The recomputation in backward must see the block's buffers as the first forward saw them, and leave them as
    the first forward left them: BatchNorm's running statistics are not updated twice (bn=batch updates them in every
    training forward; bn=window's layers only read buffers there, and are recomputed exactly either way)."""
    first_saw: list[Kept] = []
    return _buffers_kept(block, first_saw), _buffers_as_before(block, first_saw)


@contextlib.contextmanager
def _buffers_kept(block: nn.Module, first_saw: list[Kept]):
    first_saw.append(Kept(block))
    yield


@contextlib.contextmanager
def _buffers_as_before(block: nn.Module, first_saw: list[Kept]):
    with kept(block):  # afterwards, as the first forward left them
        first_saw[0].put_back()  # during the recomputation, as the first forward saw them
        yield
