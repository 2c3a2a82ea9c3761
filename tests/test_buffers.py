"""buffers.Kept and buffers.kept: a module's buffers put back as they were kept."""

import pytest
import torch
from torch import nn

from yoloaccum.core.buffers import Kept, kept


def bn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()


def test_kept_puts_the_statistics_back_also_when_the_block_raises():
    model = bn()
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(RuntimeError, match="inside"), kept(model):
        model(torch.randn(2, 3, 8, 8))  # updates running_mean, running_var, num_batches_tracked
        assert not torch.equal(model[1].running_mean, before[0])
        raise RuntimeError("inside")
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), before, strict=True))


def test_keep_copies_into_the_same_tensors_and_put_back_restores_the_last_kept():
    model = bn()
    saved = Kept(model)
    tensors = saved.tensors
    model(torch.randn(2, 3, 8, 8))
    saved.keep()
    assert saved.tensors is tensors and all(t is u for t, u in zip(saved.tensors, tensors))  # no new allocation
    after_one = [b.clone() for b in model.buffers()]
    model(torch.randn(2, 3, 8, 8))
    saved.put_back()
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), after_one, strict=True))
