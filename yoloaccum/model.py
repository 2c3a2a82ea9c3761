"""Build Ultralytics' DetectionModel from a model YAML (or a .pt), with the dataset's classes and local weights."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from yoloaccum import checkpoint
from yoloaccum.config import Config
from yoloaccum.data import DatasetSpec
from yoloaccum.errors import UserError
from yoloaccum.ultra import ultralytics_args


def resolve_yaml(name: str) -> str:
    """A model YAML by path, or by Ultralytics name (yolo26n.yaml: architecture yolo26, scale n)."""
    from ultralytics.nn.tasks import yaml_model_load

    if Path(name).is_file():
        return str(Path(name).resolve())
    try:
        yaml_model_load(name)  # searches Ultralytics' cfg/models folders; never downloads a non-URL name
    except FileNotFoundError as e:
        raise UserError(
            f"model {name} does not exist; give a model YAML such as yolo26n.yaml or yolo11s.yaml, "
            "a path to one, or a local .pt file"
        ) from e
    return name


def build(cfg: Config, spec: DatasetSpec, verbose: bool = False, announce: bool = True) -> nn.Module:
    """The model to train: from cfg.model (YAML or .pt), sized for the dataset, with cfg.pretrained weights loaded."""
    from ultralytics.nn.tasks import DetectionModel

    source, source_path = None, None
    if str(cfg.model).endswith(".pt"):
        source, source_path = checkpoint.model_of(checkpoint.load(cfg.model, cfg.trust_weights)), cfg.model
        model = DetectionModel(source.yaml, nc=spec.nc, verbose=verbose)
        if cfg.pretrained is False:  # as Ultralytics: the .pt's architecture, trained from scratch
            source = None
    else:
        model = DetectionModel(resolve_yaml(cfg.model), nc=spec.nc, verbose=verbose)
    model.names = dict(spec.names)
    model.args = ultralytics_args(cfg)  # the loss reads its gains (box, cls, dfl) and epochs from here
    if isinstance(cfg.pretrained, str):
        source, source_path = checkpoint.model_of(checkpoint.load(cfg.pretrained, cfg.trust_weights)), cfg.pretrained
    if source is not None:
        matched, total = load_matching(model, source)
        if not matched:
            raise UserError(f"no tensor of {source_path} matches {cfg.model}; check the architecture")
        if announce:
            print(f"pretrained: transferred {matched}/{total} tensors from {source_path}")
    return model


def load_matching(model: nn.Module, source: nn.Module) -> tuple[int, int]:
    """Copy every tensor whose name and shape match; returns (matched, tensors in model)."""
    own = model.state_dict()
    theirs = {k: v for k, v in source.state_dict().items() if k in own and v.shape == own[k].shape}
    model.load_state_dict(theirs, strict=False)
    return len(theirs), len(own)


def set_bn_mode(model: nn.Module, bn: str) -> None:
    """bn=frozen: BatchNorm layers normalise with, and keep, their running statistics; their affine still trains."""
    if bn == "frozen":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
