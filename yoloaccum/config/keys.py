"""Generated from cfg/default.yaml by `python -m yoloaccum.config.schema`; do not edit. The
configuration's keys with their types, for type checkers and editors: a Config reads as Keys.
tests/test_config.py checks it is current."""

from __future__ import annotations


class Keys:
    __slots__ = ()

    model: str
    data: str | None
    pretrained: bool | str
    cls_remap: bool
    freeze: int | list | None
    trust_weights: bool
    epochs: int
    time: float | None
    save_minutes: float
    patience: int
    batch: int | float
    nbs: int
    imgsz: int
    device: str | None
    workers: int
    ddp_timeout: int
    cache: bool | str
    fraction: float
    single_cls: bool
    classes: int | list | None
    rect: bool
    multi_scale: float
    project: str | None
    name: str | None
    exist_ok: bool
    resume: bool | str
    save: bool
    save_period: int
    seed: int
    deterministic: bool
    amp: bool | str
    channels_last: bool
    compile: bool | str
    grad_checkpointing: bool
    verbose: bool
    plots: bool
    tensorboard: bool
    log_every: int
    norm: str
    bn: str
    bn_adapt: int
    bn_window: int
    precise_bn: int | str
    precise_bn_aug: bool
    mosaic_buffer: str
    remainder: str
    clip_grad: float
    nan_patience: int
    optimizer: str
    lr0: float
    lrf: float
    lr_scale: str
    momentum: float
    weight_decay: float
    warmup_epochs: float
    warmup_momentum: float
    warmup_bias_lr: float
    cos_lr: bool
    close_mosaic: int
    box: float
    cls: float
    dfl: float
    hsv_h: float
    hsv_s: float
    hsv_v: float
    degrees: float
    translate: float
    scale: float
    shear: float
    perspective: float
    flipud: float
    fliplr: float
    bgr: float
    mosaic: float
    mixup: float
    cutmix: float
    val: bool
    split: str
    conf: float | None
    iou: float
    max_det: int
    source: str | None
