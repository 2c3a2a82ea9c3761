"""AMP through the real Engine, without a GPU: fp16 autocast on the CPU with torch.amp.GradScaler("cpu").

CUDA's GradScaler and the CPU's are one class with one algorithm (scale the loss, unscale once, skip on a non-finite
gradient, halve or grow the scale), so what the Engine does with it is tested here; only the kernels differ on a GPU
(../shared/gpu/gpu_check.sh compares them there).
"""

import copy

import pytest
import torch
from test_engine import MeanLoss
from torch import nn

from yoloaccum.config import settings as config
from yoloaccum.core import schedule
from yoloaccum.core.engine import AMP_SCALE_FLOOR, Engine, load_scaler_state
from yoloaccum.distributed import ddp as distributed

CPU = distributed.Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))


def batches(num_images: int, micro: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(num_images, 6, generator=g), torch.randn(num_images, 2, generator=g)
    return [{"img": x[i : i + micro], "target": y[i : i + micro]} for i in range(0, num_images, micro)]


def engine_for(model, num_images=32, batch=4, nbs=16, amp=True, init_scale=2.0**10, loss=None, **kw) -> Engine:
    from ultralytics.utils.torch_utils import ModelEMA

    cfg = config.resolve(overrides=dict(batch=batch, nbs=nbs, epochs=1, warmup_epochs=0, optimizer="SGD"))
    s = schedule.build(cfg, num_images)
    return Engine.build(
        model,
        loss or MeanLoss(model),
        s,
        CPU,
        amp=amp,
        ema=ModelEMA(model),
        scaler=torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=amp),
        **kw,
    )


def counting(obj, name: str, calls: dict) -> None:
    """Count calls of obj.name, which still runs."""
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)


def window_gradient(engine: Engine, data: list[dict]) -> torch.Tensor:
    """The unscaled gradient the optimizer steps with, over one epoch of a single window."""
    seen = []
    engine.optimizer.register_step_pre_hook(
        lambda opt, *_: seen.append(torch.cat([p.grad.flatten() for g in opt.param_groups for p in g["params"]]))
    )
    engine.train_epoch(0, data)
    assert len(seen) == 1
    return seen[0]


def test_amp_window_gradient_of_the_real_model_is_fp32s_within_fp16_rounding(tmp_path):
    """yolo26n at 64 px, two micro-batches of the real WindowLoss: the gradient the AMP step takes (normalised over the
    window, unscaled once) against fp32's. fp16 keeps 11 bits, so a gradient a few parts in a thousand away is
    rounding; a scale applied twice or not at all, or a window normalised per micro-batch, is off by far more."""
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum.config.ultra import ultralytics_args
    from yoloaccum.core import loss
    from yoloaccum.model.autobatch import synthetic_batch

    torch.manual_seed(0)
    model = DetectionModel("yolo26n.yaml", nc=4, verbose=False)
    model.args = ultralytics_args(config.resolve(overrides={}))  # the loss reads its gains here
    model.train()
    for m in model.modules():  # running statistics, as at inference: fp16's batch statistics are not the subject
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    data = [synthetic_batch(2, 64, 3, torch.device("cpu")) for _ in range(2)]
    grads = {}
    for amp in (False, True):
        m = copy.deepcopy(model)
        e = engine_for(m, num_images=4, batch=2, nbs=4, amp=amp, init_scale=2.0**8, loss=loss.WindowLoss(m, "window"))
        grads[amp] = window_gradient(e, [dict(b) for b in data])
    fp32, fp16 = grads[False], grads[True]
    assert torch.isfinite(fp16).all()
    relative = ((fp16 - fp32).norm() / fp32.norm()).item()
    assert relative < 2e-2, relative


def test_one_unscale_step_and_update_per_window():
    engine = engine_for(bn_model(), num_images=32, batch=4, nbs=16)  # 8 micro-batches, windows of 4
    calls = {}
    for name in ("unscale_", "step", "update"):
        counting(engine.scaler, name, calls)
    engine.train_epoch(0, batches(32, 4))
    assert calls == {"unscale_": 2, "step": 2, "update": 2}
    assert engine.ema.updates == 2 and engine.skipped == []


def test_an_overflowing_window_runs_again_at_half_the_scale_and_ends_with_that_scales_gradient():
    """A scale of 2**40 overflows fp16 gradients while the fp32 loss stays finite: the scaler finding its scale. The
    window is not skipped but run again, its BatchNorm statistics put back first, at half the scale each time,
    until its gradients fit; the step then takes exactly the gradient the same window has when run at that scale."""
    model = bn_model()
    fresh = copy.deepcopy(model)
    engine = engine_for(model, num_images=16, batch=4, nbs=16, init_scale=2.0**40)
    seen = []
    engine.optimizer.register_step_pre_hook(lambda opt, *_: seen.append([p.grad.clone() for p in model.parameters()]))
    engine.train_epoch(0, batches(16, 4))
    replays = len(engine.replays)
    assert replays > 0 and engine.replays == [3] * replays and engine.skipped == []
    assert engine.history[-1].replays == replays and not engine.history[-1].skipped
    assert engine.ema.updates == 1 and engine.skipped_in_a_row == 0
    final_scale = 2.0**40 / 2**replays
    again = engine_for(fresh, num_images=16, batch=4, nbs=16, init_scale=final_scale)
    reference = []
    again.optimizer.register_step_pre_hook(
        lambda opt, *_: reference.append([p.grad.clone() for p in fresh.parameters()])
    )
    again.train_epoch(0, batches(16, 4))
    assert again.replays == [] and len(seen) == len(reference) == 1
    for a, b in zip(seen[0], reference[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same computation at the same scale: bitwise
    for a, b in zip(model.buffers(), fresh.buffers()):  # BatchNorm saw the window once, not once per replay
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_no_window_of_the_real_model_is_lost_while_the_scaler_finds_its_scale():
    """yolo26n at 64 px with the real WindowLoss, fp16 autocast and GradScaler("cpu") at its default start of 2**16,
    which overflows the first windows' gradients: every window steps, after runs again at smaller scales."""
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum.config.ultra import ultralytics_args
    from yoloaccum.core import loss
    from yoloaccum.model.autobatch import synthetic_batch

    torch.manual_seed(0)
    model = DetectionModel("yolo26n.yaml", nc=4, verbose=False)
    model.args = ultralytics_args(config.resolve(overrides={}))
    model.train()
    data = [synthetic_batch(2, 64, 3, torch.device("cpu")) for _ in range(2)]  # fp16 on the CPU is slow: 2 windows
    e = engine_for(model, num_images=4, batch=2, nbs=2, init_scale=2.0**16, loss=loss.WindowLoss(model, "window"))
    e.train_epoch(0, data)
    assert e.replays, "the scaler's start did not overflow: this test no longer tests the replay"
    assert e.skipped == [] and len(e.history) == 2 and not any(r.skipped for r in e.history)
    assert e.ema.updates == 2 and e.scaler.get_scale() < 2.0**16


def test_nan_patience_fires_on_nan_gradients_under_amp():
    """Gradients NaN for ever, loss finite: the first window runs again at halved scales down to AMP_SCALE_FLOOR
    (8 -> 4 -> 2 -> 1); below it each window is skipped and counts, and nan_patience stops the run."""
    model = bn_model()
    model[0].weight.register_hook(lambda g: g * float("nan"))
    weights = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    engine = engine_for(model, num_images=4 * 40, batch=4, nbs=4, init_scale=8.0, nan_patience=3)
    result = engine.train_epoch(0, batches(4 * 40, 4))
    assert result.stopped == "diverged"
    assert engine.replays == [0, 0, 0] and engine.skipped == [0, 1, 2]
    assert engine.scaler.get_scale() < AMP_SCALE_FLOOR
    assert engine.ema.updates == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers))  # skipped windows' statistics put back


def test_a_non_finite_loss_with_finite_gradients_does_not_step_under_amp():
    """A constant inf added to the loss makes it non-finite but leaves the gradients finite: GradScaler would step,
    while the window is recorded as skipped. The optimizer must not step."""
    model = bn_model()
    engine = engine_for(model, num_images=16, batch=4, nbs=16, loss=MeanLoss(model, extra=float("inf")))
    weights = [p.detach().clone() for p in model.parameters()]
    calls = {}
    counting(engine.optimizer, "step", calls)
    engine.train_epoch(0, batches(16, 4))
    assert engine.skipped == [3] and engine.skipped_in_a_row == 1
    assert calls == {} and engine.ema.updates == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))


@pytest.mark.parametrize("saved_amp, resumed_amp", [(False, True), (True, False), (True, True)])
def test_scaler_state_loads_across_amp_settings(saved_amp, resumed_amp):
    """A CPU last.pt holds an empty scaler state, which GradScaler.load_state_dict refuses with AMP on."""
    saved = torch.amp.GradScaler("cpu", init_scale=512.0, enabled=saved_amp)
    if saved_amp:
        saved.get_scale()  # a state_dict of a used scaler
    resumed = torch.amp.GradScaler("cpu", enabled=resumed_amp)
    note = load_scaler_state(resumed, saved.state_dict())
    if saved_amp and resumed_amp:
        assert note is None and resumed.get_scale() == 512.0
    elif resumed_amp:
        assert "loss scale starts at 65536" in note
    else:
        assert "not used" in note


def _carry(first: Engine, second: Engine, data: list[dict]) -> torch.Tensor:
    """Half a window in `first`, saved as remainder=carry saves it and reopened in `second`, which ends it."""
    for b in data[:2]:
        first.micro_step(dict(b))
    window = first.open_window()
    second.restore_window(window)
    for b in data[2:]:
        second.micro_step(dict(b))
    seen = []
    second.optimizer.register_step_pre_hook(
        lambda opt, *_: seen.append([p.grad.clone() for p in opt.param_groups[0]["params"]])
    )
    second.step(3)
    return torch.cat([g.flatten() for g in seen[0]])


@pytest.mark.parametrize("resumed_scale", [2.0**6, None])
def test_a_carried_window_resumed_with_another_scale_or_without_amp_has_the_uninterrupted_gradient(resumed_scale):
    """remainder=carry saves scaled gradients. Resumed with another scale (or AMP off) they are rescaled to it, so the
    step sees the gradient of the uninterrupted window: powers of two rescale fp16 exactly, hence the tight tolerance;
    without the rescale the carried half is 16x (or 1024x) too large."""
    data = batches(16, 4)
    model = bn_model()
    uninterrupted = engine_for(copy.deepcopy(model), num_images=16, batch=4, nbs=16, init_scale=2.0**10)
    for b in data:
        uninterrupted.micro_step(dict(b))
    reference = []
    uninterrupted.optimizer.register_step_pre_hook(
        lambda opt, *_: reference.append(torch.cat([p.grad.flatten() for p in opt.param_groups[0]["params"]]))
    )
    uninterrupted.step(3)
    first = engine_for(copy.deepcopy(model), num_images=16, batch=4, nbs=16, init_scale=2.0**10)
    amp = resumed_scale is not None
    second = engine_for(copy.deepcopy(model), num_images=16, batch=4, nbs=16, amp=amp, init_scale=resumed_scale or 1.0)
    got = _carry(first, second, data)
    # the second half ran in fp32 without AMP: fp16 rounding of that half only (a few parts in a thousand)
    tolerance = 1e-6 if amp else 2e-2
    assert ((got - reference[0]).norm() / reference[0].norm()).item() < tolerance
