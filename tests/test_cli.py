"""End-to-end tests of the `yoloaccum` command line through `python -m yoloaccum`: user errors, cfg and plan.

Only cfg and plan run here (no training), so each call takes a few seconds at most.
"""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

import yoloaccum
from yoloaccum.commands import plan as plan_
from yoloaccum.config import settings as config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BROKEN_BRACKET = "batch: 8\nnbs: 64\nepochs: [1, 2\n"  # unclosed bracket on line 3
BROKEN_INDENT = "batch: 8\nnbs: 64\n  epochs: 3\n"  # bad indent on line 3


@pytest.fixture
def recipes(tmp_path: Path) -> Path:
    """A folder of recipes for the bad-input table, which names them as {tmp}/name.yaml."""
    (tmp_path / "bracket.yaml").write_text(BROKEN_BRACKET)
    (tmp_path / "indent.yaml").write_text(BROKEN_INDENT)
    (tmp_path / "typo.yaml").write_text("bacth: 8\n")
    return tmp_path


# Every mistake a user can make in the configuration: exit code 2 and one line on stderr that holds these phrases.
BAD_INPUT = [
    pytest.param(("cfg", "bacth=8"), ("unknown argument 'bacth'", "did you mean 'batch'"), id="unknown-key"),
    pytest.param(("cfg", "cfg={tmp}/typo.yaml"), ("typo.yaml 'bacth'", "did you mean 'batch'"), id="unknown-in-recipe"),
    pytest.param(("cfg", "batch=abc"), ("batch=abc is not an integer",), id="wrong-type"),
    pytest.param(("cfg", "amp=yes"), ("amp=yes is not true/false",), id="wrong-type-bool"),
    pytest.param(("cfg", "batch=0"), ("batch=0 must be a whole number of images",), id="batch-zero"),
    pytest.param(("cfg", "batch=2.5"), ("batch=2.5 must be a whole number of images",), id="batch-fractional"),
    pytest.param(("cfg", "nbs=0"), ("nbs=0 must be greater than 0",), id="nbs-zero"),
    pytest.param(("cfg", "epochs=0"), ("epochs=0 must be greater than 0",), id="epochs-zero"),
    pytest.param(("cfg", "lr0=-0.1"), ("lr0=-0.1 must be between 0 and 1",), id="negative-lr"),
    pytest.param(("cfg", "imgsz=100"), ("imgsz=100 must be a multiple of 32",), id="imgsz-not-multiple-of-32"),
    pytest.param(("cfg", "norm=bogus"), ("norm=bogus is not one of window, micro",), id="not-a-choice"),
    pytest.param(("cfg", "batch"), ("'batch' is not key=value",), id="not-key-value"),
    pytest.param(("cfg", "cfg=/nonexistent.yaml"), ("/nonexistent.yaml does not exist",), id="missing-recipe"),
    pytest.param(("cfg", "cfg={tmp}/indent.yaml"), ("{tmp}/indent.yaml:3", "malformed YAML"), id="yaml-bad-indent"),
    pytest.param(
        ("cfg", "cfg={tmp}/bracket.yaml"),
        ("{tmp}/bracket.yaml:3", "malformed YAML"),
        id="yaml-unclosed-bracket",
    ),
    pytest.param(("cfg", "accumulate=4"), ("accumulate is derived", "set nbs to batch x N"), id="derived-accumulate"),
    pytest.param(
        ("cfg", "profile=True"), ("'profile' is an Ultralytics setting", "does not take: ONNX"), id="ultralytics-key"
    ),
    pytest.param(("train", "nbs=abc"), ("nbs=abc is not an integer",), id="train-wrong-type"),
    pytest.param(("val",), ("val needs trained weights", "model=path/to/best.pt"), id="val-without-weights"),
    pytest.param(("plan", "batch=8"), ("give data=dataset.yaml or images=N",), id="plan-without-images"),
    pytest.param(
        ("plan", "batch=6", "device=0,1,2,3", "images=100"),
        ("batch=6 does not divide over 4 devices",),
        id="batch-not-divisible-by-devices",
    ),
]


@pytest.mark.parametrize(("args", "phrases"), BAD_INPUT)
def test_bad_input_exits_2_with_one_line(
    run_cli, recipes: Path, args: tuple[str, ...], phrases: tuple[str, ...]
) -> None:
    result = run_cli(*(a.format(tmp=recipes) for a in args))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase.format(tmp=recipes) in lines[0]


@pytest.mark.parametrize(
    ("args", "env"),
    [
        pytest.param(("--verbose", "cfg", "batch=abc"), None, id="verbose"),
        pytest.param(("-v", "cfg", "batch=abc"), None, id="v"),
        pytest.param(("cfg", "batch=abc"), {"YOLOACCUM_DEBUG": "1"}, id="debug-env"),
        pytest.param(
            ("cfg", "batch=abc", "--verbose"),
            None,
            id="verbose-after-command",
        ),
    ],
)
def test_debug_shows_the_traceback(run_cli, args: tuple[str, ...], env: dict[str, str] | None) -> None:
    result = run_cli(*args, env=env)
    assert result.returncode == 2  # still a mistake's exit code
    assert "Traceback" in result.stderr
    assert "UserError: batch=abc is not an integer" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == "error: batch=abc is not an integer or a number; e.g. batch=16"


def test_version(run_cli) -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"yoloaccum {yoloaccum.__version__}"


@pytest.mark.parametrize("command", ["train", "val", "predict", "plan", "cfg", "shapes"])
def test_help_of_each_command(run_cli, command: str) -> None:
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"yoloaccum {command} [OPTIONS]" in result.stdout
    if command == "plan":
        assert "--json" in result.stdout and "--plot" in result.stdout


def test_cfg_prints_the_resolved_configuration(run_cli, tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("batch: 8\nnbs: 128\nlr0: 1\n")
    args = (f"cfg={recipe}", "batch=4", "amp=false", "device=0")
    result = run_cli("cfg", *args)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed == dict(config.resolve(args))
    overridden = {k: printed[k] for k in ("batch", "nbs", "lr0", "amp", "device")}
    assert overridden == {"batch": 4, "nbs": 128, "lr0": 1.0, "amp": False, "device": "0"}


def test_cfg_loads_an_ultralytics_recipe(run_cli, tmp_path: Path) -> None:
    recipe = tmp_path / "ultralytics.yaml"
    recipe.write_text("task: detect\nmode: train\nrect: False\noverlap_mask: True\nbatch: 8\n")
    result = run_cli("cfg", f"cfg={recipe}")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["batch"] == 8
    assert not {"task", "mode", "overlap_mask"} & printed.keys() and printed["rect"] is False


# plan -------------------------------------------------------------------------------------------------------------
PLAN_ARGS = ("plan", "batch=8", "nbs=64", "images=512", "epochs=10")


def _plan_json(run_cli, *args: str) -> dict:
    result = run_cli("plan", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def plan_json(run_cli) -> dict:
    return _plan_json(run_cli, *PLAN_ARGS[1:])


def test_plan_prints_the_summary(run_cli) -> None:
    result = run_cli(*PLAN_ARGS)
    assert result.returncode == 0, result.stderr
    assert "accumulate" in result.stdout and "8 (nbs=64)" in result.stdout
    assert "64 images per optimizer step" in result.stdout


def test_plan_json_top_level(plan_json: dict) -> None:
    assert plan_json.keys() == {"version", "summary", "iterations"}
    assert plan_json["version"] == plan_.JSON_VERSION


def test_plan_json_summary(plan_json: dict) -> None:
    s = plan_json["summary"]
    documented = {
        "images",
        "world_size",
        "micro_batch_per_device",
        "accumulate",
        "effective_batch",
        "weight_decay",
        "weight_decay_scaled",
        "warmup_iterations",
        "accumulate_ramp",
        "optimizer",
        "lr0",
        "steps_per_epoch",
        "total_steps",
        "warnings",
    }
    assert documented <= s.keys()
    assert (s["images"], s["world_size"], s["micro_batch_per_device"]) == (512, 1, 8)
    assert (s["accumulate"], s["effective_batch"]) == (8, 64)
    assert s["weight_decay"] == s["weight_decay_scaled"] == 0.0005  # batch * accumulate == nbs: no scaling
    assert s["warmup_iterations"] == 3 * 64  # warmup_epochs=3 at 64 iterations per epoch
    ramp = s["accumulate_ramp"]
    assert (ramp[0]["first_ni"], ramp[0]["accumulate"], ramp[-1]["accumulate"]) == (0, 1, 8)  # 1 rises to 8
    assert s["optimizer"] == "AdamW" and s["lr0"] > 0  # auto picks AdamW for a run this short
    assert len(s["steps_per_epoch"]) == 10 and sum(s["steps_per_epoch"]) == s["total_steps"]
    assert s["warnings"] == []
    assert s["precise_bn_images"] == 512 // 8  # precise_bn=auto from scratch: an eighth of the training set


def test_plan_says_what_a_run_from_trained_weights_takes_for_batchnorm(run_cli) -> None:
    """From a .pt, bn=auto takes bn=window below 8 images per device, as from scratch, and says why; precise_bn=auto
    recomputes nothing. plan says so from the config alone, before any weights are read, and a precise_bn given is
    taken as given."""
    s = _plan_json(run_cli, "model=runs/x/weights/best.pt", "batch=2", "nbs=64", "images=292")["summary"]
    assert (s["bn"], s["precise_bn_images"]) == ("window", 0)
    assert "from trained weights as from scratch" in s["bn_reason"] and "fell short" in s["bn_reason"]
    for given, count in (("100", 100), ("500", 292)):  # as given, at most the training set
        args = ("model=runs/x/weights/best.pt", "batch=2", "images=292", f"precise_bn={given}")
        assert _plan_json(run_cli, *args)["summary"]["precise_bn_images"] == count
    printed = run_cli("plan", "model=runs/x/weights/best.pt", "batch=2", "images=292").stdout
    assert "precise BatchNorm" in printed and "none recomputed" in printed


def test_plan_says_bn_frozen_recomputes_nothing_and_refuses_a_precise_bn_count(cli_in_process) -> None:
    """bn=frozen keeps the running statistics its weights train against: no recompute by default, and a count that
    would replace them is a user error, one line, from plan and from train before anything is made."""
    summary = json.loads(cli_in_process("plan", "bn=frozen", "batch=4", "images=292", "--json").stdout)["summary"]
    assert summary["precise_bn_images"] == 0
    printed = cli_in_process("plan", "bn=frozen", "batch=4", "images=292").stdout
    row = re.sub(r"[│\s]+", " ", printed)  # the table's cell, whatever width wrapped it
    assert "none recomputed: bn=frozen keeps the running statistics its weights train against" in row
    for command in (("plan", "images=292"), ("train", "data=missing.yaml")):  # train: before it reads the data
        r = cli_in_process(*command, "bn=frozen", "precise_bn=48")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "precise_bn=48 would recompute the BatchNorm statistics bn=frozen keeps" in r.stderr


def test_plan_json_iterations(plan_json: dict) -> None:
    s, records = plan_json["summary"], plan_json["iterations"]
    assert len(records) == s["batches_per_epoch"] * 10 == 640
    assert [r["ni"] for r in records] == list(range(640))
    for r in records:
        assert r.keys() == {"ni", "epoch", "accumulate", "step", "lr", "momentum"}
        assert r["lr"].keys() == {"weight", "bn", "bias"}
        assert r["epoch"] == r["ni"] // 64
    assert sum(r["step"] for r in records) == s["total_steps"]
    for epoch, num_steps in enumerate(s["steps_per_epoch"]):
        assert sum(r["step"] for r in records if r["epoch"] == epoch) == num_steps
    assert records[-1]["step"]  # remainder=step: the run's last micro-batch is stepped


def test_plan_plot_writes_a_png(run_cli, tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    result = run_cli(*PLAN_ARGS, "--plot", png)
    assert result.returncode == 0, result.stderr
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_plan_warns_about_a_small_micro_batch_with_bn_batch(run_cli) -> None:
    warnings = _plan_json(run_cli, "batch=4", "nbs=64", "images=512", "bn=batch")["summary"]["warnings"]
    assert len(warnings) == 1
    assert "micro-batch 4 per device with bn=batch" in warnings[0]


@pytest.mark.parametrize(("batch", "bn"), [(2, "window"), (4, "window"), (8, "batch"), (16, "batch")])
def test_plan_says_what_bn_auto_takes_for_the_micro_batch(run_cli, batch, bn) -> None:
    """Below 8 images per device bn=auto (the default) normalises with the window's statistics, and plan says what
    that does instead of only warning; from 8 on it is bn=batch, with nothing to say."""
    summary = _plan_json(run_cli, f"batch={batch}", "nbs=64", "images=512")["summary"]
    assert summary["bn"] == bn
    warnings = [w for w in summary["warnings"] if "BatchNorm" in w]
    if bn == "window":
        assert len(warnings) == 1
        assert f"micro-batch {batch} per device: bn=auto takes bn=window" in warnings[0]
        assert f"statistics of its window's {batch * round(64 / batch)} images" in warnings[0]
    else:
        assert warnings == []


def test_plan_warns_when_nbs_is_below_batch(run_cli) -> None:
    warnings = _plan_json(run_cli, "batch=8", "nbs=4", "images=512")["summary"]["warnings"]
    assert len(warnings) == 1
    assert "nbs=4 < batch=8" in warnings[0]


def test_plan_splits_the_batch_over_devices_without_cuda(run_cli) -> None:
    s = _plan_json(run_cli, "device=0,1,2,3", "batch=16", "nbs=128", "images=1000")["summary"]
    assert (s["world_size"], s["micro_batch_per_device"], s["accumulate"], s["effective_batch"]) == (4, 4, 8, 128)


@pytest.mark.parametrize(
    ("device", "ids"),
    [("", []), ("cpu", []), ("0", [0]), ("0,1", [0, 1]), ("cuda", [0]), ("cuda:1", [1]), ("cuda:0,cuda:1", [0, 1])],
)
def test_device_strings_have_one_parser(device: str, ids: list[int]) -> None:
    """train, val, predict and plan all read device= through distributed.cuda_ids (val once built cuda:cuda:0)."""
    from yoloaccum.distributed import ddp as distributed

    assert distributed.cuda_ids(device) == ids
    assert distributed.world_size(device) == max(len(ids), 1)
    if not ids or torch.cuda.is_available() and max(ids) < torch.cuda.device_count():
        expected = torch.device("cuda", ids[0]) if ids else torch.device("cpu")
        assert distributed.select_device(device) == expected


@pytest.mark.parametrize(("fraction", "corrupt", "num_images"), [(0.5, False, 12), (1.0, True, 24)])
def test_plan_counts_the_images_training_uses(run_cli, tmp_path: Path, fraction, corrupt, num_images) -> None:
    """Ultralytics' fraction of the files, less the images its label check skips: what training reports."""
    from conftest import shapes_yaml

    from yoloaccum.data import datasets as data

    yaml_file = shapes_yaml(tmp_path, num_train=24, num_val=4)
    if corrupt:
        root = data.load_spec(yaml_file).root  # generates the set
        (root / "images/train/corrupt.jpg").write_bytes(b"\xff\xd8 not a JPEG")
        (root / "labels/train/corrupt.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    s = _plan_json(run_cli, f"data={yaml_file}", "batch=2", "nbs=4", "epochs=1", f"fraction={fraction}")["summary"]
    assert s["images"] == num_images


def test_the_network_guard_blocks_downloads():
    """The guard the CLI tests run under really refuses a connection beyond this machine."""
    import subprocess
    import sys

    from conftest import offline_env

    code = "import urllib.request; urllib.request.urlopen('http://example.com', timeout=5)"
    r = subprocess.run([sys.executable, "-c", code], env=offline_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "blocked" in r.stderr


@pytest.mark.parametrize("args", [("train", "nbs=abc"), ("plan", "images=118287", "batch=8"), ("cfg",)])
def test_commands_that_train_nothing_answer_without_importing_torch(args):
    """A typo, a plan and the configuration answer before torch, Ultralytics or matplotlib load (their import takes
    seconds here; benchmarks/startup.py times the commands)."""
    import subprocess
    import sys

    from conftest import REPO, offline_env

    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "yoloaccum", *args],
        cwd=REPO,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    imported = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines() if "import time:" in line}
    assert not imported & {"torch", "ultralytics", "matplotlib"}, sorted(imported & {"torch", "ultralytics"})
