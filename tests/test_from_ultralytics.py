"""What a user coming from `yolo train` brings: an Ultralytics run's args.yaml as the recipe, a .pt to fine-tune with
freeze=, a time= budget, periodic saves for sessions killed without a signal, amp=bf16, classes= and multi_scale=."""

import copy
import json
import signal
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    PLUMBING,
    SERIAL,
    TINY_MODEL,
    final_weights,
    relative_difference,
    shapes_yaml,
)

import yoloaccum.config.ultra  # noqa: F401  (ultralytics offline before it is imported)
from yoloaccum.batchnorm import precise as precise_bn
from yoloaccum.batchnorm import window as norm
from yoloaccum.config import settings as config
from yoloaccum.core import schedule
from yoloaccum.data import multiscale
from yoloaccum.distributed import ddp as distributed
from yoloaccum.model import checkpoint, freeze
from yoloaccum.training import clock, components

pytestmark = pytest.mark.usefixtures("settings_kept")  # runs built in this process
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SMALL = ("imgsz=64", "batch=4", "nbs=8", "workers=0", "warmup_epochs=0", "close_mosaic=0", "plots=False")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return shapes_yaml(tmp_path_factory.mktemp("data"), num_train=32, num_val=4, seed=5)


@pytest.fixture(scope="module")
def ultralytics_run(data, tmp_path_factory) -> Path:
    """A real `yolo train` run (Ultralytics' own trainer, one short epoch): its folder, args.yaml included."""
    from ultralytics.models.yolo.detect import DetectionTrainer

    from yoloaccum.data import datasets as data_

    data_.load_spec(data)  # the shapes set generates itself on first use; Ultralytics' trainer needs it made
    project = tmp_path_factory.mktemp("ultralytics")
    args = dict(
        model=TINY_MODEL,
        data=str(data),
        imgsz=32,
        epochs=1,
        batch=8,
        workers=0,
        device="cpu",
        amp=False,
        plots=False,
        val=False,
        project=str(project),
        name="train",
        exist_ok=True,
        verbose=False,
    )
    DetectionTrainer(overrides=args).train()
    return project / "train"


@pytest.fixture(scope="module")
def pretrained_pt(tmp_path_factory) -> Path:
    """Weights as Ultralytics saves them: yolo26n for COCO's 80 classes, written by ultralytics.YOLO.save."""
    from ultralytics import YOLO

    path = tmp_path_factory.mktemp("weights") / "yolo26n-80.pt"
    torch.manual_seed(0)
    YOLO("yolo26n.yaml").save(path)
    return path


def test_the_args_yaml_of_a_real_yolo_train_run_trains(ultralytics_run, data, tmp_path, run_cli):
    recipe = ultralytics_run / "args.yaml"
    assert {"save_dir", "mode", "task"} <= yaml.safe_load(recipe.read_text()).keys()
    r = run_cli(
        "train",
        f"cfg={recipe}",
        f"data={data}",
        "epochs=1",
        "imgsz=64",
        f"project={tmp_path}",
        "name=ours",
        "val=False",
        "precise_bn=0",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    dropped = [line for line in r.stdout.splitlines() if line.startswith("the recipe's keys that yoloaccum does not")]
    assert len(dropped) == 1 and "save_dir" in dropped[0] and "(they describe a run, not a recipe)" in dropped[0]
    saved = yaml.safe_load((tmp_path / "ours/args.yaml").read_text())
    assert saved["model"] == TINY_MODEL and saved["batch"] == 8  # the recipe's, as Ultralytics ran it


def test_cfg_and_plan_list_what_the_recipe_dropped(cli_in_process):
    """A recipe of an earlier 8.x release: retired keys (half, label_smoothing, ...) and run keys are dropped and
    listed, on stderr, so `cfg`'s YAML on stdout stays pure."""
    recipe = FIXTURES / "ultralytics-8.0-args.yaml"
    for args in (("cfg",), ("plan", "images=100", "data=")):
        r = cli_in_process(*args, f"cfg={recipe}", "batch=8")
        assert r.returncode == 0, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("the recipe's keys that yoloaccum does not take were dropped")
        for key in ("save_dir", "half", "label_smoothing", "v5loader", "boxes", "keras"):
            assert key in lines[0], key
    assert yaml.safe_load(cli_in_process("cfg", f"cfg={recipe}").stdout)["lr0"] == 0.01


def test_plan_of_a_fine_tune_names_bn_autos_choice_and_why(pretrained_pt, data, cli_in_process):
    def summary(*args):
        r = cli_in_process("plan", f"data={data}", "batch=2", "--json", *args)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])["summary"]

    tuned = summary(f"model={pretrained_pt}")
    assert (tuned["bn"], tuned["bn_reason"]) == ("window", schedule.bn_auto_reason(2, from_weights=True))
    assert schedule.BN_AUTO_FROM_WEIGHTS_WHY in tuned["bn_reason"]
    assert not any("with bn=batch" in w for w in tuned["warnings"])
    scratch = summary()
    assert (scratch["bn"], scratch["bn_reason"]) == ("window", "for 2 images per device")


@pytest.mark.slow
def test_fine_tune_frozen_stops_on_time_and_resumes_with_the_frozen_layers_bitwise(
    pretrained_pt, data, tmp_path, run_cli
):
    """The issue's command: model=<a .pt> freeze=10 time=...: the class head is adapted (80 classes to 4), training
    stops when time= is spent with a resumable last.pt, and after the resume the frozen layers' weights and
    BatchNorm buffers are bitwise those of the .pt, in the model, the EMA and best.pt."""
    args = ("train", f"model={pretrained_pt}", f"data={data}", "freeze=10", *SMALL, "epochs=2", f"project={tmp_path}")
    r = run_cli(*args, "name=ft", "time=0.000001", timeout=600)  # 3.6 ms: spent by the first window's end
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "(80 classes -> 4)" in r.stdout
    assert "freeze=10: layers 0-9 frozen" in r.stdout
    said = " ".join(r.stdout.split())
    reason = schedule.bn_auto_reason(4, from_weights=True)  # the study's word on bn=window from weights, below 8
    assert f"BatchNorm: bn=auto chose bn=window {' '.join(reason.split())}: each micro-batch of 4" in said
    assert " ".join(schedule.PRECISE_BN_FROM_WEIGHTS_WHY.split()) in said and "recomputed over" not in said
    assert "time=1e-06 hours spent: stopped in epoch 1/2" in r.stdout, r.stdout[-2000:]
    last = tmp_path / "ft/weights/last.pt"
    state = checkpoint.load(last)["yoloaccum"]
    assert not state["finished"]
    r = run_cli("train", f"resume={last}", "time=none", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    source = checkpoint.model_of(checkpoint.load(pretrained_pt)).state_dict()
    done = checkpoint.load(last)
    assert done["yoloaccum"]["finished"] and done["yoloaccum"]["training"]["position"]["epoch"] == 2
    best = checkpoint.load(tmp_path / "ft/weights/best.pt")["model"].float().state_dict()
    frozen = freeze.prefixes(10)
    for name, weights in (
        ("model", done["yoloaccum"]["model"]),
        ("ema", done["yoloaccum"]["ema"]["weights"]),
        ("best", best),
    ):
        keys = [k for k in weights if freeze.is_frozen(k, frozen)]
        assert any(k.endswith("running_var") for k in keys)
        reference = {k: source[k].half().float() if name == "best" else source[k] for k in keys}
        assert all(torch.equal(weights[k], reference[k]) for k in keys), name
        trained = [k for k in weights if not freeze.is_frozen(k, frozen) and k.endswith("conv.weight")]
        assert any(not torch.equal(weights[k], source[k]) for k in trained if weights[k].shape == source[k].shape)


@pytest.mark.slow
@pytest.mark.numerics
def test_save_minutes_survives_sigkill_and_resumes_bitwise(data, tmp_path, run_cli):
    """save_minutes=: last.pt at window boundaries as training goes; a SIGKILL (a notebook session that ends without
    a signal) after one of them, and the resume from it ends bitwise where a run that was never killed ends."""
    recipe = ("train", f"data={data}", *PLUMBING, *SMALL, "epochs=3", f"project={tmp_path}")
    r = run_cli(*recipe, "name=whole", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # SIGKILL at iteration 10 (YOLOACCUM_FAULT=kill): the save_minutes save at the window boundary before it, inside
    # epoch 2, is the newest last.pt; the epoch's own save at its end never came.
    killed = run_cli(*recipe, "name=killed", "save_minutes=0.0001", env={**SERIAL, "YOLOACCUM_FAULT": "kill@10"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    last = tmp_path / "killed/weights/last.pt"
    assert checkpoint.load(last)["yoloaccum"]["training"]["position"] == {"epoch": 1, "batch": 2}
    r = run_cli("train", f"resume={last}", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert relative_difference(final_weights(tmp_path / "killed"), final_weights(tmp_path / "whole")) == 0.0
    assert (tmp_path / "killed/schedule.csv").read_text() == (tmp_path / "whole/schedule.csv").read_text()


def first_window_gradient(cfg: config.Config) -> tuple[torch.Tensor, list[torch.dtype]]:
    """The real run's parts (yolo26n, the dataset pipeline, the Engine): the gradient its first optimizer step
    takes, and the dtypes its convolutions computed in."""
    parts = components.build(cfg)
    seen, dtypes = [], []
    parts.engine.optimizer.register_step_pre_hook(
        lambda opt, *_: seen.append(torch.cat([p.grad.flatten() for g in opt.param_groups for p in g["params"]]))
    )
    conv = next(m for m in parts.raw_model.modules() if isinstance(m, torch.nn.Conv2d))
    conv.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    batches = iter(parts.loader)
    parts.raw_model.train()
    for ni in range(parts.schedule.accumulate):
        parts.engine.iteration(ni, next(batches), ni == parts.schedule.accumulate - 1)
    parts.engine.step(parts.schedule.accumulate - 1)
    assert parts.engine.scaler.is_enabled() is False  # bfloat16 needs no GradScaler, and fp32 none either
    return seen[0], dtypes


def test_amp_bf16_trains_in_bfloat16_on_the_cpu_close_to_fp32(data, tmp_path):
    """amp=bf16 through the real Engine on the CPU's bfloat16 autocast: the forward computes in bfloat16, no
    GradScaler is used, and the window's gradient points where fp32's does (bfloat16 keeps 8 bits of mantissa)."""
    overrides = dict(
        data=str(data),
        model="yolo26n.yaml",
        imgsz=64,
        batch=4,
        nbs=8,
        epochs=1,
        warmup_epochs=0,
        workers=0,
        plots=False,
        mosaic=0.0,
        bn="batch",
        project=str(tmp_path),
        seed=1,
    )
    fp32, fp32_types = first_window_gradient(config.resolve(overrides={**overrides, "amp": False, "name": "fp32"}))
    bf16, bf16_types = first_window_gradient(config.resolve(overrides={**overrides, "amp": "bf16", "name": "bf16"}))
    assert set(fp32_types) == {torch.float32} and set(bf16_types) == {torch.bfloat16}
    # The norm is the sharp check (a loss left scaled, or bfloat16 gradients gone wrong, move it by orders of
    # magnitude); the direction less so: from fresh weights the loss's label assignment is decided by near-ties
    # that bfloat16's rounding flips, which turns some anchors' gradients around (cosines of 0.78 to 0.87 seen).
    cosine = torch.nn.functional.cosine_similarity(fp32.double(), bf16.double(), dim=0).item()
    assert cosine > 0.5, cosine
    assert abs(bf16.norm() / fp32.norm() - 1) < 0.02


def test_classes_keeps_the_listed_classes_boxes(data, tmp_path):
    cfg = config.resolve(overrides=dict(data=str(data), classes=[1], imgsz=64, batch=4, project=str(tmp_path)))
    from yoloaccum.data import datasets as data_

    dataset = data_.build_dataset(cfg, data_.load_spec(cfg.data), "train")
    classes = {int(c) for label in dataset.labels for c in label["cls"].flatten()}
    assert classes == {1}


def test_multi_scale_sizes_follow_ultralytics_rule_and_the_seed():
    sizes = {multiscale.draw(640, 0.5, seed=0, epoch=0, i=i) for i in range(400)}
    assert min(sizes) >= 320 and max(sizes) <= 960 and all(s % 32 == 0 for s in sizes) and len(sizes) > 10
    assert multiscale.draw(640, 0.5, 3, 2, 7) == multiscale.draw(640, 0.5, 3, 2, 7)  # a resumed run draws the same
    batch = {"img": torch.zeros(2, 3, 64, 64, dtype=torch.uint8), "cls": torch.zeros(1, 1)}
    out = multiscale.resize(batch, 96, torch.device("cpu"))
    assert out["img"].shape == (2, 3, 96, 96) and out["img"].dtype == torch.float32 and out["cls"] is batch["cls"]


def test_bn_window_statistics_over_micro_batches_of_two_sizes_are_those_the_micro_steps_see():
    """With multi_scale a window's micro-batches have different sizes: the pass sums every size's statistics, which
    equal those of the same images passed one size at a time through plain BatchNorm in training mode."""
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    model = torch.nn.Sequential(conv)
    small, large = torch.rand(2, 3, 16, 16), torch.rand(2, 3, 24, 24)
    feats = [conv[0](x).detach() for x in (small, large)]
    values = torch.cat([f.permute(1, 0, 2, 3).reshape(4, -1) for f in feats], dim=1)
    norm.convert(model)
    stats = norm.WindowStatistics(model)
    stats([{"img": small}, {"img": large}])
    layer = model[0][1]
    torch.testing.assert_close(layer.window_mean, values.mean(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.window_var, values.var(1, unbiased=False), rtol=1e-4, atol=1e-6)


def test_frozen_layers_keep_plain_batchnorm_and_their_statistics():
    """bn=window converts only the layers that train, and precise_bn recomputes only theirs."""
    from ultralytics.nn.tasks import DetectionModel

    model = DetectionModel("yolo26n.yaml", nc=4, verbose=False)
    frozen = freeze.apply(model, 3)
    ema = copy.deepcopy(model)  # precise_bn recomputes the EMA's statistics, whose layers stay plain BatchNorm
    converted = norm.convert(model, frozen)
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert all(k is torch.nn.BatchNorm2d for n, k in kinds.items() if freeze.is_frozen(n, frozen))
    assert converted == sum(not freeze.is_frozen(n, frozen) for n in kinds)
    before = {k: v.clone() for k, v in ema.state_dict().items() if k.endswith("running_mean")}
    precise_bn.recompute(ema, [torch.rand(2, 3, 64, 64)], distributed.Context(0, 0, 1, torch.device("cpu")), frozen)
    after = ema.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if freeze.is_frozen(k, frozen))
    assert any(not torch.equal(before[k], after[k]) for k in before if not freeze.is_frozen(k, frozen))
    assert not any(p.requires_grad for n, p in model.named_parameters() if freeze.is_frozen(n, frozen))


def test_freeze_names_layers_as_ultralytics_does():
    assert freeze.prefixes(3) == ("model.0.", "model.1.", "model.2.")
    assert freeze.prefixes([0, "23.cv2"]) == ("model.0.", "model.23.cv2.")
    assert freeze.is_frozen("model.1.bn", ("model.1.",)) and not freeze.is_frozen("model.10.bn", ("model.1.",))
    assert freeze.is_frozen("module.model.0.conv.weight", ("model.0.",))  # under DDP


def test_the_clock_stops_on_time_saves_on_schedule_and_fits_epochs_to_the_budget():
    now = [0.0]
    c = clock.RunClock(hours=1.0, save_minutes=10, now=lambda: now[0])
    assert not c.over_time() and not c.save_due()
    now[0] = 600
    assert c.save_due()
    c.saved()
    assert not c.save_due()
    now[0] = 1200  # two epochs in 20 minutes: 6 fit an hour, as Ultralytics' ceil(time / mean epoch time)
    assert c.epochs_for_budget(epochs_done=2, epochs_done_here=2) == 6
    assert c.epochs_for_budget(epochs_done=9, epochs_done_here=2) == 9  # never fewer than are done
    now[0] = 3601
    assert c.over_time()
    assert not clock.RunClock(hours=1.0, save_minutes=10, is_main=False, now=lambda: now[0] + 1e9).over_time()
