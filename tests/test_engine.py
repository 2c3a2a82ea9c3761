"""The accumulation loop (engine.Engine) on a BatchNorm-free toy model: when it steps, and what each step does.

The toy loss follows the WindowLoss protocol with a mean loss times the micro-batch size, as Ultralytics' loss is,
so the accumulated gradient is a sum over images.
"""

import copy

import pytest
import torch
from torch import nn

from yoloaccum.config import settings as config
from yoloaccum.core import optim, schedule
from yoloaccum.core.engine import Engine
from yoloaccum.distributed import ddp as distributed

pytestmark = pytest.mark.numerics  # every test here is an exactness proof: `make numerics`

CPU = distributed.Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


class MeanLoss:
    """Mean squared error x images: the WindowLoss protocol with nothing to normalise at the window's end. Computed
    in fp32 (also under autocast); `extra` is added to every loss (a constant inf: the loss non-finite, not the
    gradient)."""

    def __init__(self, model: nn.Module, extra: float = 0.0):
        self.params, self.extra = [list(model.parameters())], extra

    def __call__(self, preds, batch):
        loss = ((preds.float() - batch["target"]) ** 2).mean() * preds.shape[0] + self.extra
        return loss, loss.detach().view(1), torch.tensor([float(preds.shape[0])])

    def param_groups(self):
        return self.params

    def normalise_gradients(self, counts, world):
        pass


def toy_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def toy_batches(num_images: int, micro: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(num_images, 6, generator=g), torch.randn(num_images, 2, generator=g)
    return [{"img": x[i : i + micro], "target": y[i : i + micro]} for i in range(0, num_images, micro)]


def make_engine(model, num_images, batch, nbs, epochs=1, warmup_epochs=0.0, clip_grad=1e9, **cfg):
    cfg = config.resolve(
        overrides=dict(batch=batch, nbs=nbs, epochs=epochs, warmup_epochs=warmup_epochs, optimizer="SGD", **cfg)
    )
    s = schedule.build(cfg, num_images)
    return Engine.build(model, MeanLoss(model), s, CPU, clip_grad=clip_grad)


def step_indices(engine: Engine, epoch: int, batches: list[dict]) -> list[int]:
    """Micro-batch indices after which the optimizer stepped, seen by torch's own hooks."""
    seen, steps = [0], []
    engine.model.register_forward_hook(lambda *_: seen.__setitem__(0, seen[0] + 1))
    engine.optimizer.register_step_post_hook(lambda *_: steps.append(seen[0] - 1))
    engine.train_epoch(epoch, batches)
    return steps


def test_steps_exactly_at_window_ends_including_the_short_last_window():
    # 10 micro-batches of 8 (the last one of 4), accumulate 4: windows end after 3, 7 and the short 9.
    engine = make_engine(toy_model(), num_images=76, batch=8, nbs=32)
    assert step_indices(engine, 0, toy_batches(76, 8)) == [3, 7, 9] == list(engine.schedule.window_ends(0))


def test_steps_follow_the_warmup_ramp():
    engine = make_engine(toy_model(), num_images=160, batch=8, nbs=64, epochs=3, warmup_epochs=1)
    batches = toy_batches(160, 8)
    for epoch in range(3):
        assert step_indices(engine, epoch, batches) == list(engine.schedule.window_ends(epoch))


def test_ema_updates_once_per_step():
    from ultralytics.utils.torch_utils import ModelEMA

    engine = make_engine(toy_model(), num_images=80, batch=8, nbs=32)
    engine.ema = ModelEMA(engine.raw_model)
    engine.train_epoch(0, toy_batches(80, 8))
    assert engine.ema.updates == engine.schedule.steps_per_epoch(0) == 3


def test_a_skipped_window_leaves_batchnorm_statistics_as_they_were_at_its_start():
    """The third window's loss is not finite: it is skipped, and BatchNorm's running statistics go back to their values
    at its start, not at the start of an earlier window (the snapshot is refreshed in place each window)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))
    batches = toy_batches(64, 8)  # 8 micro-batches, windows of 2
    batches[5] = {**batches[5], "img": batches[5]["img"] * float("nan")}
    engine = make_engine(model, num_images=64, batch=8, nbs=16)
    seen = {}
    engine.train_epoch(0, batches, lambda i, *_: seen.__setitem__(i, [b.clone() for b in model.buffers()]))
    assert engine.skipped == [5]
    assert not torch.equal(seen[4][0], seen[3][0])  # the window's first micro-batch did move them
    assert all(torch.equal(a, b) for a, b in zip(seen[5], seen[3]))


def test_clip_once_per_step_on_the_accumulated_gradient(monkeypatch):
    model = toy_model()
    reference = copy.deepcopy(model)
    batches = toy_batches(32, 8)
    sum(((reference(b["img"]) - b["target"]) ** 2).mean() * 8 for b in batches).backward()
    window_norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm()

    seen = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def spy(parameters, max_norm, **kw):  # records, then clips for real
        parameters = list(parameters)
        seen.append(torch.cat([p.grad.flatten() for p in parameters]).norm())
        return real_clip(parameters, max_norm, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    engine = make_engine(model, num_images=32, batch=8, nbs=32, clip_grad=0.5)
    stepped = []  # the norm of the gradient the optimizer steps with: clipped to clip_grad
    engine.optimizer.register_step_pre_hook(
        lambda opt, *_: stepped.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    )
    engine.train_epoch(0, batches)
    assert len(seen) == 1 and window_norm > 0.5
    torch.testing.assert_close(seen[0], window_norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(stepped[0], torch.tensor(0.5), rtol=1e-5, atol=0)


def test_four_micro_batches_of_8_equal_one_batch_of_32():
    """The seed's check, through the engine: same gradient, and the same weights after one SGD step."""
    data = toy_batches(32, 32)[0]
    small = make_engine(toy_model(), num_images=32, batch=8, nbs=32)
    big = make_engine(toy_model(), num_images=32, batch=32, nbs=32)

    grads = {}
    for name, engine, batches in (("small", small, toy_batches(32, 8)), ("big", big, [data])):
        engine.optimizer.register_step_pre_hook(
            lambda opt, *_, name=name: grads.__setitem__(
                name, torch.cat([p.grad.flatten() for p in opt.param_groups[0]["params"]])
            )
        )
        engine.train_epoch(0, batches)
    # Both are sums over the 32 images; divided by 32 they are the gradient of the batch's mean loss. float32 sums
    # in another order differ by ~1e-7 there: 1e-6 is above rounding and far below any real difference.
    assert ((grads["small"] - grads["big"]) / 32).abs().max() <= 1e-6
    for a, b in zip(small.raw_model.parameters(), big.raw_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_windows_of_micro_batches_equal_a_plain_loop_of_big_batch_steps():
    """Three windows of 4 micro-batches through the engine end with the weights of a plain loop (zero_grad, the
    window's 32 images in one backward, the schedule's lr and momentum, step) with the same optimizer. Catches a window
    whose gradients leak into the next (no zero_grad after the step): an engine at batch 32 would leak the same way,
    so the reference is not an engine."""
    small = make_engine(toy_model(), num_images=96, batch=8, nbs=32)
    small.train_epoch(0, toy_batches(96, 8))
    reference = toy_model()
    s = small.schedule
    opt = optim.build_optimizer(reference, s)
    for k, window in enumerate(toy_batches(96, 32)):
        opt.zero_grad(set_to_none=True)
        (((reference(window["img"]) - window["target"]) ** 2).mean() * 32).backward()
        optim.set_hyperparameters(opt, s, ni=4 * k + 3)
        opt.step()
    for a, b in zip(small.raw_model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # float32 sums in another order: ~1e-7


def test_weight_decay_in_the_optimizer_is_the_scheduled_value():
    from ultralytics.nn.tasks import DetectionModel

    cfg = config.resolve(overrides=dict(batch=48, nbs=64, optimizer="SGD"))
    s = schedule.build(cfg, 1000)
    opt = optim.build_optimizer(DetectionModel("yolo11n.yaml", nc=3, verbose=False), s)
    decays = {g["param_group"]: g["weight_decay"] for g in opt.param_groups}
    assert decays == {"weight": pytest.approx(s.weight_decay), "bn": 0.0, "bias": 0.0}
    assert s.weight_decay == pytest.approx(0.0005 * 0.75)


def test_learning_rate_and_momentum_at_each_step_come_from_the_schedule():
    engine = make_engine(toy_model(), num_images=160, batch=8, nbs=32, epochs=2, warmup_epochs=1)
    seen = []
    engine.optimizer.register_step_pre_hook(
        lambda opt, *_: seen.append({g["param_group"]: (g["lr"], g["momentum"]) for g in opt.param_groups})
    )
    batches = toy_batches(160, 8)
    for epoch in range(2):
        engine.train_epoch(epoch, batches)
    s, nb = engine.schedule, engine.schedule.batches_per_epoch
    ends = [epoch * nb + i for epoch in range(2) for i in s.window_ends(epoch)]
    assert len(seen) == len(ends)
    for record, ni in zip(seen, ends):
        assert record["bias"] == pytest.approx((s.lr_at(ni, s.lr0, bias=True), s.momentum_at(ni)))
        assert record["weight"] == pytest.approx((s.lr_at(ni, s.lr0, bias=False), s.momentum_at(ni)))


def test_nan_patience_counts_on_across_a_saved_and_loaded_engine():
    """state_dict() keeps the streak of skipped windows: two non-finite windows before a save and one after it make
    the three in a row that nan_patience=3 stops at, as in an uninterrupted run (before last.pt format 5 a resume
    started the count again)."""

    def diverging_engine(num_images):
        engine = make_engine(toy_model(), num_images=num_images, batch=2, nbs=2)
        engine.loss, engine.nan_patience = MeanLoss(engine.raw_model, extra=float("inf")), 3
        return engine

    saved = diverging_engine(4)  # an epoch of 2 windows
    assert saved.train_epoch(0, toy_batches(4, 2)).stopped is None  # windows 0 and 1: skipped, two in a row
    assert saved.skipped == [0, 1] and saved.skipped_in_a_row == 2
    resumed = diverging_engine(8)  # the run continued: 4 windows, from the third
    resumed.load_state_dict(saved.state_dict())
    result = resumed.train_epoch(0, toy_batches(8, 2)[2:], start=2)
    assert result.stopped == "diverged" and result.done == 3 and resumed.skipped == [0, 1, 2]
