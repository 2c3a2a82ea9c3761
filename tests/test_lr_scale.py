"""lr_scale= (schedule.Schedule.lr_multiplier): the lr each rule gives, for SGD and AdamW, at effective batches 32, 64,
72 and 256 against nbs 64. The loss sums over images, so SGD's update already grows linearly with the effective batch
(`linear` is then the lr as given) and AdamW's does not grow at all (`none` is then the lr as given)."""

import json

import pytest

from yoloaccum.config import settings as config
from yoloaccum.core import schedule

# effective batch: (batch, images, epochs) giving it with nbs 64; 32 comes from accumulate capped at the run's 2
# iterations (batch 16, 32 images, 1 epoch)
EFFECTIVE = {32: (16, 32, 1), 64: (8, 6400, 10), 72: (24, 7200, 10), 256: (256, 25600, 10)}
# lr after warmup at epoch 0 (lr0 x lf(0) = lr0): SGD lr0=0.01, AdamW lr0=0.001
EXPECTED = {
    ("SGD", "ultralytics"): {32: 0.01, 64: 0.01, 72: 0.01, 256: 0.01},
    ("SGD", "linear"): {32: 0.01, 64: 0.01, 72: 0.01, 256: 0.01},
    ("SGD", "sqrt"): {32: 0.0141421356, 64: 0.01, 72: 0.0094280904, 256: 0.005},
    ("SGD", "none"): {32: 0.02, 64: 0.01, 72: 0.0088888889, 256: 0.0025},
    ("AdamW", "ultralytics"): {32: 0.001, 64: 0.001, 72: 0.001, 256: 0.001},
    ("AdamW", "linear"): {32: 0.0005, 64: 0.001, 72: 0.001125, 256: 0.004},
    ("AdamW", "sqrt"): {32: 0.0007071068, 64: 0.001, 72: 0.0010606602, 256: 0.002},
    ("AdamW", "none"): {32: 0.001, 64: 0.001, 72: 0.001, 256: 0.001},
}


def build(optimizer: str, rule: str, effective: int) -> schedule.Schedule:
    batch, images, epochs = EFFECTIVE[effective]
    lr0 = 0.01 if optimizer == "SGD" else 0.001
    cfg = config.resolve(
        overrides=dict(batch=batch, nbs=64, epochs=epochs, warmup_epochs=0, optimizer=optimizer, lr0=lr0, lr_scale=rule)
    )
    s = schedule.build(cfg, images)
    assert s.effective_batch == effective
    return s


@pytest.mark.parametrize(("optimizer", "rule"), list(EXPECTED))
def test_each_rule_gives_the_lr_that_makes_the_update_follow_it(optimizer, rule):
    for effective, lr in EXPECTED[optimizer, rule].items():
        s = build(optimizer, rule, effective)
        for bias in (False, True):
            assert s.lr_at(0, s.lr0, bias=bias) == pytest.approx(lr, rel=1e-9, abs=1e-10), (effective, bias)


def test_the_default_is_ultralytics_lr_exactly():
    cfg = config.resolve(overrides=dict(batch=24, nbs=64, epochs=3, optimizer="AdamW", lr0=0.001))
    s = schedule.build(cfg, 2400)
    assert s.lr_scale == "ultralytics" and s.lr_multiplier == 1.0


def test_warmup_stays_gradual_and_is_scaled_with_the_rest():
    """The warmup ramp keeps its shape: every point of it is multiplied, biases' warmup_bias_lr start included."""
    cfg = dict(batch=256, nbs=64, epochs=10, warmup_epochs=1, optimizer="SGD", lr0=0.01)
    plain = schedule.build(config.resolve(overrides=cfg), 25600)
    scaled = schedule.build(config.resolve(overrides={**cfg, "lr_scale": "none"}), 25600)
    for ni in range(0, plain.warmup_iterations + 2):
        for bias in (False, True):
            assert scaled.lr_at(ni, 0.01, bias) == pytest.approx(plain.lr_at(ni, 0.01, bias) * 0.25)


def test_plan_shows_the_rule_and_warns_for_adamw_far_from_nbs(run_cli):
    r = run_cli("plan", "images=25600", "batch=256", "nbs=64", "optimizer=AdamW", "lr0=0.001", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["summary"]
    assert (s["lr_scale"], s["optimizer_family"], s["effective_batch_ratio"], s["lr_multiplier"]) == (
        "ultralytics",
        "adaptive",
        4.0,
        1.0,
    )
    (warning,) = [w for w in s["warnings"] if "lr_scale=ultralytics the lr does not follow the batch" in w]
    assert "lr_scale=linear kept accuracy closest to a real batch of nbs at 2x and 4x" in warning  # as measured
    r = run_cli("plan", "images=25600", "batch=256", "nbs=64", "optimizer=AdamW", "lr0=0.001", "lr_scale=sqrt")
    assert r.returncode == 0, r.stderr
    assert "lr × 2; after warmup weight 0.002" in r.stdout.replace("\n", " ").replace("│", "").replace("  ", " ")
    assert "does not follow the batch" not in r.stdout


def test_every_rule_is_taken_from_the_command_line(run_cli):
    """lr_scale=none is the rule `none`, not an empty setting (the command line reads `none` as null elsewhere)."""
    assert config.resolve(["lr_scale=none"]).lr_scale == "none"
    r = run_cli("plan", "images=25600", "batch=256", "nbs=64", "optimizer=SGD", "lr_scale=none", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["summary"]["lr_multiplier"] == 0.25


def test_an_unknown_rule_is_refused(run_cli):
    r = run_cli("plan", "images=100", "lr_scale=cubic")
    assert r.returncode == 2 and "lr_scale" in r.stderr and "Traceback" not in r.stderr
