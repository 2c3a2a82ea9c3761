"""model.py: gradient checkpointing gives the gradients of the plain model, and leaves BatchNorm as it would."""

import copy
import sys

import pytest
import torch
from conftest import REPO

from yoloaccum.config import settings as config
from yoloaccum.config.ultra import ultralytics_args
from yoloaccum.core.loss import WindowLoss
from yoloaccum.model.build import checkpoint_blocks, checkpoint_units

sys.path.insert(0, str(REPO / "benchmarks"))
from common import make_batches  # noqa: E402


def yolo(seed: int = 0):
    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(seed)
    model = DetectionModel("yolo26n.yaml", nc=4, verbose=False).to(memory_format=torch.channels_last)
    model.args = ultralytics_args(config.resolve(overrides=dict(imgsz=64)))
    return model.train()


def gradients_and_buffers(model, batch):
    loss = WindowLoss(model, "window")
    loss(model(batch["img"]), batch)[0].backward()
    return [p.grad for p in model.parameters()], list(model.buffers())


@pytest.mark.numerics
def test_checkpointed_blocks_give_the_same_gradients_and_batchnorm_statistics():
    plain = yolo()
    checkpointed = copy.deepcopy(plain)
    checkpoint_blocks(checkpointed)
    batch = make_batches(1, 4, 64)[0]
    grads, buffers = gradients_and_buffers(plain, batch)
    grads_ckpt, buffers_ckpt = gradients_and_buffers(checkpointed, batch)
    # The recomputation repeats the same float operations in the same order: equal, not merely close.
    for a, b in zip(grads, grads_ckpt):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # Backward runs each block's forward again; its BatchNorm statistics must still be updated once, not twice.
    for a, b in zip(buffers, buffers_ckpt):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_a_copy_of_a_checkpointed_model_runs_its_own_blocks():
    model = yolo()
    checkpoint_blocks(model)
    copied = copy.deepcopy(model)  # what ModelEMA and validation do
    units = [unit for block in copied.model for unit in checkpoint_units(block)]
    assert len(units) > len(copied.model)  # the head's towers are units of their own
    assert all(unit.forward.__self__ is unit for unit in units)
    with torch.no_grad():
        copied.eval()(torch.zeros(1, 3, 64, 64))
