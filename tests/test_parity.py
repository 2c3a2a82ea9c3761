"""Same recipe, same schedule: Ultralytics' own DetectionTrainer, instrumented with callbacks, against
`yoloaccum plan --json remainder=carry`, iteration by iteration.

Compared at every iteration ni: accumulate, whether the optimizer steps, each parameter group's lr, momentum and
weight decay, and the optimizer's type with its betas or momentum and nesterov flag. Ultralytics trains for real (a
tiny Detect model, 32 px, a handful of images) and is stopped after the first iterations of each run.
"""

import json

import pytest
from conftest import shapes_yaml

import yoloaccum.config.ultra  # noqa: F401  (ultralytics offline before it is imported)
from yoloaccum.data import shapes

pytestmark = pytest.mark.numerics  # every test here is an exactness proof: `make numerics`

# The schedule does not depend on the architecture, only on the parameter groups; a Detect head keeps MuSGD's
# class-head groups (cv3) and a forward + backward costs next to nothing.
TINY_MODEL = """nc: 4
backbone:
  - [-1, 1, Conv, [8, 3, 2]]
  - [-1, 1, Conv, [8, 3, 2]]
  - [-1, 1, Conv, [8, 3, 2]]
  - [-1, 1, Conv, [8, 3, 2]]
  - [-1, 1, Conv, [8, 3, 2]]
head:
  - [[2, 3, 4], 1, Detect, [nc]]
"""
COMMON = {"imgsz": 32, "batch": 4, "workers": 0, "seed": 0, "close_mosaic": 0}
# (images, iterations to compare, recipe): optimizer=auto just over and at Ultralytics' 10,000-iteration threshold
# (ceil(8 / max(batch, nbs)) * epochs); cosine lr without warmup; fractional warmup with a batch that does not divide
# the images (10 / 4: a short last micro-batch); nbs < batch, where weight decay is scaled up; Adam's betas.
CASES = {
    "auto-musgd": (8, 260, {"optimizer": "auto", "epochs": 10001, "warmup_epochs": 100}),
    "auto-adamw": (8, 120, {"optimizer": "auto", "epochs": 10000, "warmup_epochs": 50}),
    "cos-lr-no-warmup": (10, 90, {"optimizer": "SGD", "epochs": 30, "cos_lr": True, "warmup_epochs": 0, "nbs": 16}),
    "fractional-warmup": (10, 90, {"optimizer": "sgd", "epochs": 30, "warmup_epochs": 2.5, "nbs": 16}),
    "nbs-below-batch": (10, 60, {"optimizer": "RMSProp", "epochs": 20, "nbs": 2, "warmup_epochs": 1}),
    "adam": (10, 60, {"optimizer": "Adam", "epochs": 20, "nbs": 8, "warmup_epochs": 1.5, "momentum": 0.95}),
}


class _Enough(Exception):
    """Raised from a callback to end Ultralytics' run after the iterations compared."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("parity")
    (folder / "tiny.yaml").write_text(TINY_MODEL)
    data = {}
    for n in (8, 10):  # generated here: Ultralytics reads the set, it does not make it
        (folder / f"n{n}").mkdir()
        data[n] = shapes_yaml(folder / f"n{n}", num_train=n, num_val=2)
        shapes.ensure(folder / f"n{n}/shapes", num_train=n, num_val=2, imgsz=64, seed=3)
    return {"folder": folder, "model": folder / "tiny.yaml", "data": data}


def ultralytics_iterations(setup: dict, num_images: int, iterations: int, recipe: dict) -> tuple[dict, list[dict]]:
    """What Ultralytics' trainer does at each iteration: read after the iteration, so after any optimizer step."""
    from ultralytics.models.yolo.detect import DetectionTrainer

    args = {
        **COMMON,
        **recipe,
        "model": str(setup["model"]),
        "data": str(setup["data"][num_images]),
        "project": str(setup["folder"]),
        "name": "ultralytics",
        "exist_ok": True,
        "device": "cpu",
        "val": False,
        "save": False,
        "plots": False,
        "amp": False,
        "pretrained": False,
        "verbose": False,
    }
    trainer = DetectionTrainer(overrides=args)
    records, steps, optimizer = [], [], {}

    def on_train_start(t):
        opt = t.optimizer
        opt.register_step_post_hook(lambda *_: steps.append(len(records)))  # the step taken at this ni
        lr0 = t.args.lr0  # optimizer=auto has written its own choice here
        labels = [g["param_group"] + ("_head" if g["initial_lr"] > 2 * lr0 else "") for g in opt.param_groups]
        built = [{k: g[k] for k in ("momentum", "betas", "nesterov") if k in g} for g in opt.param_groups]
        optimizer.update(type=type(opt).__name__, labels=labels, built=built)  # as constructed, before warmup

    def on_train_batch_end(t):
        groups = dict(zip(optimizer["labels"], t.optimizer.param_groups))
        records.append(
            {
                "accumulate": t.accumulate,
                "step": steps[-1:] == [len(records)],
                "lr": {k: g["lr"] for k, g in groups.items()},
                "weight_decay": {k: g["weight_decay"] for k, g in groups.items()},
                "momentum": {k: g.get("momentum", g.get("betas", (None,))[0]) for k, g in groups.items()},
            }
        )
        if len(records) == iterations:
            raise _Enough

    trainer.add_callback("on_train_start", on_train_start)
    trainer.add_callback("on_train_batch_end", on_train_batch_end)
    with pytest.raises(_Enough):
        trainer.train()
    return optimizer, records


@pytest.mark.parametrize("case", CASES)
def test_schedule_matches_ultralytics_trainer(case, setup, run_cli):
    num_images, iterations, recipe = CASES[case]
    theirs_optimizer, theirs = ultralytics_iterations(setup, num_images, iterations, recipe)
    args = [f"{k}={v}" for k, v in {**COMMON, **recipe}.items()]
    r = run_cli("plan", f"data={setup['data'][num_images]}", *args, "remainder=carry", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    summary, ours = plan["summary"], plan["iterations"][:iterations]

    assert summary["optimizer"] == theirs_optimizer["type"]
    expected = {k: v for k, v in summary["optimizer_args"].items() if k in ("momentum", "betas", "nesterov")}
    for built in theirs_optimizer["built"]:
        assert {k: list(v) if k == "betas" else v for k, v in built.items()} == expected
    assert set(theirs_optimizer["labels"]) <= set(summary["param_groups"])
    for ni, (mine, t) in enumerate(zip(ours, theirs, strict=True)):
        where = f"{case}, ni={ni}"
        assert (mine["accumulate"], mine["step"]) == (t["accumulate"], t["step"]), where
        for label in t["lr"]:
            # The same formulas on both sides; only the order of float operations may differ.
            assert mine["lr"][label] == pytest.approx(t["lr"][label], rel=1e-12, abs=1e-15), f"{where}, {label} lr"
            assert t["weight_decay"][label] == pytest.approx(summary["param_groups"][label]["weight_decay"]), where
            assert t["momentum"][label] == pytest.approx(mine["momentum"], rel=1e-12), f"{where}, {label} momentum"
    assert sum(t["step"] for t in theirs) > 3  # the comparison covered optimizer steps, not only accumulation
