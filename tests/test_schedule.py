"""The schedule's arithmetic against hand-computed cases and an independent copy of Ultralytics' step rule."""

import math

import numpy as np
import pytest

from yoloaccum.config import settings as config
from yoloaccum.core import schedule
from yoloaccum.errors import UserError


def build(num_images=512, world=1, nc=80, **overrides):
    return schedule.build(config.resolve(overrides=overrides), num_images, world, nc)


@pytest.mark.parametrize(
    ("batch", "nbs", "accumulate", "wd_factor"),
    [(16, 64, 4, 1.0), (8, 64, 8, 1.0), (48, 64, 1, 0.75), (128, 64, 1, 2.0)],
)
def test_accumulate_and_weight_decay(batch, nbs, accumulate, wd_factor):
    s = build(batch=batch, nbs=nbs)
    assert s.accumulate == accumulate
    assert s.effective_batch == batch * accumulate
    assert s.weight_decay == pytest.approx(0.0005 * wd_factor)


def test_global_batch_over_four_devices():
    s = build(world=4, batch=16, nbs=128)
    assert (s.micro_batch, s.accumulate, s.effective_batch) == (4, 8, 128)


def test_batch_must_divide_over_devices():
    with pytest.raises(UserError, match="does not divide over 4 devices"):
        build(world=4, batch=6)


def test_accumulate_is_capped_by_the_run_length():
    s = build(num_images=16, batch=8, nbs=64, epochs=2)  # 2 batches x 2 epochs
    assert s.accumulate == 4
    assert s.weight_decay == pytest.approx(0.0005 * 8 * 4 / 64)  # by the accumulate used: 32 images per step


def test_warmup_iterations():
    assert build(num_images=512, batch=8, epochs=10, warmup_epochs=3).warmup_iterations == 192
    assert build(epochs=1, warmup_epochs=3).warmup_iterations == 0  # leaves the final epoch for training
    assert build(warmup_epochs=0).warmup_iterations == 0
    assert build(num_images=100, batch=8, epochs=10, warmup_epochs=0.5).warmup_iterations == round(0.5 * 13)


def test_ramp_end_points_and_monotonic():
    s = build(batch=8, nbs=64, epochs=10, warmup_epochs=3)
    nw = s.warmup_iterations
    assert s.accumulate_at(0) == 1
    assert s.accumulate_at(nw) == s.accumulate == 8
    assert s.accumulate_at(nw + 1) == 8
    ramp = [s.accumulate_at(ni) for ni in range(nw + 1)]
    assert ramp == sorted(ramp)


def test_lr_and_momentum_warmup():
    s = build(batch=8, nbs=64, epochs=10, optimizer="SGD", lr0=0.01, lrf=0.01, warmup_bias_lr=0.1)
    nw = s.warmup_iterations
    assert s.lr_at(0, 0.01, bias=False) == 0.0
    assert s.lr_at(0, 0.01, bias=True) == pytest.approx(0.1)
    epoch = nw // s.batches_per_epoch
    assert s.lr_at(nw, 0.01, bias=True) == pytest.approx(0.01 * s.lf(epoch))
    assert s.momentum_at(0) == pytest.approx(0.8)
    assert s.momentum_at(nw) == pytest.approx(0.937)
    last = s.total_iterations - 1
    assert s.lr_at(last, 0.01, bias=False) == pytest.approx(0.01 * (max(1 - 9 / 10, 0) * 0.99 + 0.01))


def test_cosine_lr_factor():
    s = build(cos_lr=True, lrf=0.1, epochs=10)
    assert s.lf(0) == pytest.approx(1.0)
    assert s.lf(10) == pytest.approx(0.1)
    assert s.lf(5) == pytest.approx(0.55)


@pytest.mark.parametrize(
    ("num_images", "nc", "expected"), [(512, 80, ("AdamW", 0.000119)), (10**6, 4, ("MuSGD", 0.01))]
)
def test_optimizer_auto(num_images, nc, expected):
    s = build(num_images=num_images, nc=nc, optimizer="auto", batch=16, nbs=64, epochs=100)
    assert (s.optimizer, s.lr0) == expected
    assert s.initial_momentum == 0.9 and s.warmup_bias_lr == 0.0


def test_optimizer_auto_musgd_warms_up_to_the_recipe_momentum():
    # Ultralytics builds MuSGD at 0.9, then its warmup ramps every group's momentum to args.momentum, kept after.
    s = build(num_images=10**6, optimizer="auto", batch=16, nbs=64, epochs=100, momentum=0.937)
    nw = s.warmup_iterations
    assert s.momentum_at(0) == pytest.approx(0.8)
    assert s.momentum_at(nw) == s.momentum_at(nw + 10**5) == pytest.approx(0.937)
    # Without warmup nothing moves it from where it was built; AdamW's beta1 is never ramped.
    assert build(num_images=10**6, optimizer="auto", warmup_epochs=0, epochs=100).momentum_at(10**5) == 0.9
    assert build(num_images=512, optimizer="auto", epochs=100).momentum_at(10**4) == 0.9


def test_step_remainder_windows_never_span_epochs():
    # 10 batches per epoch, accumulate 4: windows [0-3] [4-7] [8-9]; nothing dropped, short last window steps.
    s = build(num_images=80, batch=8, nbs=32, epochs=3, warmup_epochs=0, remainder="step")
    assert s.batches_per_epoch == 10 and s.accumulate == 4
    for epoch in range(3):
        assert s.window_ends(epoch) == (3, 7, 9)
    assert s.total_steps == 9
    assert s.steps_after(29)  # the very last micro-batch of the run always steps


def test_step_remainder_with_warmup_ramp():
    s = build(num_images=80, batch=8, nbs=32, epochs=3, warmup_epochs=1, remainder="step")
    nb = s.batches_per_epoch
    for epoch in range(s.epochs):
        ends, start = s.window_ends(epoch), 0
        for end in ends:  # each window holds accumulate(first ni) micro-batches, or fewer at the epoch's end
            assert end - start + 1 == min(s.accumulate_at(epoch * nb + start), nb - start)
            start = end + 1
        assert ends[-1] == nb - 1


def naive_ultralytics_steps(nb, epochs, nbs, batch, warmup_epochs):
    """Ultralytics 8.4's loop, restated deliberately naively: step when ni - last_opt_step >= accumulate."""
    acc0 = max(round(nbs / batch), 1)
    acc0 = min(acc0, nb * epochs)
    we = min(warmup_epochs, max(epochs - 1, 0))
    nw = round(we * nb) if warmup_epochs > 0 else 0
    steps, last_opt_step, accumulate = [], -1, acc0
    for epoch in range(epochs):
        for i in range(nb):
            ni = i + nb * epoch
            if nw and ni <= nw:
                accumulate = max(1, int(np.interp(ni, [0, nw], [1, acc0]).round()))
            if ni - last_opt_step >= accumulate:
                steps.append(ni)
                last_opt_step = ni
    return steps


@pytest.mark.parametrize(
    ("num_images", "batch", "nbs", "epochs", "warmup"),
    [(80, 8, 32, 3, 0), (80, 8, 32, 3, 1), (1000, 16, 64, 5, 3), (37, 4, 64, 4, 2.5), (500, 8, 48, 2, 0.3)],
)
def test_carry_matches_ultralytics_rule(num_images, batch, nbs, epochs, warmup):
    s = build(num_images=num_images, batch=batch, nbs=nbs, epochs=epochs, warmup_epochs=warmup, remainder="carry")
    nb = math.ceil(num_images / batch)
    ours = [ni for ni in range(s.total_iterations) if s.steps_after(ni)]
    assert ours == naive_ultralytics_steps(nb, epochs, nbs, batch, warmup)


def test_carry_drops_the_last_epochs_tail_and_step_does_not():
    kw = dict(num_images=80, batch=8, nbs=32, epochs=3, warmup_epochs=0)
    carry, step = build(remainder="carry", **kw), build(remainder="step", **kw)
    assert not carry.steps_after(carry.total_iterations - 1)  # 30 batches, steps at 3, 7, ..., 27: 28-29 dropped
    assert step.steps_after(step.total_iterations - 1)


@pytest.mark.parametrize("warmup_epochs", [3.0, 0.5])
def test_extending_a_run_rebuilds_the_lr_decay_and_keeps_warmup_and_the_optimizer(warmup_epochs):
    """resume=... epochs=N: two epochs planned, five run; warmup and optimizer=auto's choice stay as they began."""
    planned = build(epochs=2, batch=16, nbs=64, warmup_epochs=warmup_epochs)
    longer = schedule.extend(planned, 5)
    assert (longer.optimizer, longer.lr0, longer.warmup_iterations) == (
        planned.optimizer,
        planned.lr0,
        planned.warmup_iterations,
    )
    nb = planned.batches_per_epoch
    for ni in range(2 * nb):  # the epochs done: the same windows, and the same accumulate
        assert (longer.steps_after(ni), longer.accumulate_at(ni)) == (
            planned.steps_after(ni),
            planned.accumulate_at(ni),
        )
    ni = 3 * nb  # epoch 4 of 5: the 5-epoch linear decay
    assert longer.lr_at(ni, longer.lr0, bias=False) == pytest.approx(longer.lr0 * ((1 - 3 / 5) * (1 - 0.01) + 0.01))
    assert build(epochs=5, warmup_epochs=warmup_epochs).warmup_iterations >= longer.warmup_iterations


def test_plotted_training_batches_are_ultralytics_iterations():
    from yoloaccum.evaluation import plots

    s = build(num_images=100, batch=10, epochs=6)  # 10 iterations an epoch
    assert plots.train_batch_indices(s, close_mosaic=2) == {0, 1, 2, 40, 41, 42}
    assert plots.train_batch_indices(s, close_mosaic=0) == {0, 1, 2}


@pytest.mark.parametrize(
    ("n", "parts", "cuts"),
    [(8, 2, [0, 4, 8]), (5, 2, [0, 2, 5]), (7, 3, [0, 2, 4, 7]), (2, 4, [0, 0, 1, 1, 2]), (0, 2, [0, 0, 0])],
)
def test_even_cuts_differ_by_at_most_one_and_cover_every_item(n, parts, cuts):
    assert schedule.even_cuts(n, parts) == cuts


@pytest.mark.parametrize(
    ("overrides", "from_weights"),
    [
        ({"model": "yolo26n.yaml"}, False),
        ({"model": "runs/x/weights/best.pt"}, True),
        ({"model": "yolo26n.pt", "pretrained": False}, False),  # the .pt's architecture, trained from scratch
        ({"model": "yolo26n.yaml", "pretrained": "w.pt"}, True),
    ],
)
def test_a_run_starts_from_weights_with_a_pt_model_or_a_pretrained_path(overrides, from_weights):
    assert config.resolve(overrides=overrides).from_weights is from_weights


@pytest.mark.parametrize(
    ("bn", "micro", "mode"),
    [
        ("auto", 2, "window"),
        ("auto", 7, "window"),
        ("auto", 8, "batch"),
        ("auto", 16, "batch"),
        ("window", 16, "window"),  # a mode given is the mode in force
        ("batch", 2, "batch"),
        ("frozen", 16, "frozen"),
    ],
)
def test_bn_auto_chooses_by_micro_batch(bn, micro, mode):
    assert schedule.bn_mode(bn, micro) == mode


def test_bn_autos_reason_from_weights_gives_the_studys_word_below_8_only():
    assert schedule.bn_auto_reason(2, from_weights=False) == "for 2 images per device"
    assert schedule.bn_auto_reason(8, from_weights=True) == "for 8 images per device"
    reason = schedule.bn_auto_reason(4, from_weights=True)
    assert reason.startswith("for 4 images per device, from trained weights as from scratch")
    assert schedule.BN_AUTO_FROM_WEIGHTS_WHY in reason


def test_precise_bn_auto_is_an_eighth_of_the_set_from_scratch_none_from_weights_and_a_count_is_as_given():
    def size(precise_bn, n, from_weights=False):
        return schedule.precise_bn_count(precise_bn, n, from_weights=from_weights, bn="batch")

    assert [size("auto", n) for n in (4, 40, 292, 400, 512, 1000, 118_287)] == [4, 40, 48, 50, 64, 125, 256]
    assert size(100, 40) == 40 and size(100, 512) == 100 and size(0, 512) == 0
    # from trained weights auto recomputes nothing (the fine-tuning study); a count is still taken as given
    assert size("auto", 292, from_weights=True) == 0 and size(48, 292, from_weights=True) == 48


def test_bn_frozen_recomputes_no_statistics_and_refuses_a_precise_bn_count():
    """bn=frozen's weights train against the running statistics: precise_bn=auto recomputes none, from scratch or
    from weights, and a count, which would replace them, is refused in one line."""
    size = schedule.precise_bn_count
    assert size("auto", 292, from_weights=False, bn="frozen") == size("auto", 292, from_weights=True, bn="frozen") == 0
    assert size("auto", 292, from_weights=False, bn="batch") == size("auto", 292, from_weights=False, bn="window") == 48
    assert build(bn="frozen", precise_bn=0).micro_batch == build(bn="frozen").micro_batch == 16
    with pytest.raises(UserError, match=r"^precise_bn=48 would recompute the BatchNorm statistics bn=frozen keeps"):
        build(bn="frozen", precise_bn=48)
