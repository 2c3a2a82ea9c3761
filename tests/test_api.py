"""The Python API, in this process and in a real Jupyter kernel: a short real training returns its metrics and
weights, a mistake raises UserError with the CLI's message, and the kernel lives on after it."""

import json
from pathlib import Path

import pytest
from conftest import REPO, TINY_MODEL, offline_env, shapes_yaml

import yoloaccum
from yoloaccum import UserError, train

pytestmark = pytest.mark.usefixtures("settings_kept")  # runs built in this process
TINY = dict(model=TINY_MODEL, imgsz=64, epochs=1, batch=4, nbs=8, workers=0, plots=False, warmup_epochs=0)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return shapes_yaml(tmp_path_factory.mktemp("data"), num_train=8, num_val=4)


def test_train_returns_metrics_folder_and_weights(data, tmp_path):
    r = train(data=data, project=tmp_path, name="api", **TINY)
    assert r.save_dir == tmp_path / "api"
    assert {"metrics/mAP50(B)", "metrics/mAP50-95(B)", "fitness"} <= r.metrics.keys()
    assert r.best == tmp_path / "api/weights/best.pt" and r.last == tmp_path / "api/weights/last.pt"
    assert r.best.exists() and r.last.exists()


def test_a_recipe_file_and_python_values(data, tmp_path):
    """cfg= is the first argument, as YOLO(...).train(cfg=...); lists and paths are Python values."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("batch: 4\nnbs: 8\nclose_mosaic: 0\n")
    r = train(recipe, data=data, project=tmp_path, name="recipe", freeze=[0], **{**TINY, "batch": 2})
    assert r.last is not None
    args = (tmp_path / "recipe/args.yaml").read_text()
    assert "batch: 2" in args and "close_mosaic: 0" in args and "freeze:\n- 0" in args


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bacth": 8}, "unknown argument 'bacth'; did you mean 'batch'"),
        ({"batch": "eight"}, "batch='eight' is not an integer or a number"),
        ({"data": None}, "train needs a dataset"),
    ],
)
def test_mistakes_raise_user_error_with_the_clis_message(kwargs, message):
    with pytest.raises(UserError, match=message):
        train(**kwargs)


def test_the_api_is_the_package_front_door():
    assert set(yoloaccum.__all__) >= {"train", "val", "predict", "plan", "UserError", "TrainResult"}
    assert yoloaccum.plan(images=1000, batch=8, nbs=64).accumulate == 8


@pytest.mark.slow
def test_a_notebook_trains_shows_progress_and_survives_a_mistake(data, tmp_path):
    """A real Jupyter kernel (ipykernel, run by nbclient) executes the README's notebook form."""
    import nbformat
    from nbclient import NotebookClient

    cells = [
        "from yoloaccum import train, UserError",
        f"r = train(data={str(data)!r}, project={str(tmp_path)!r}, name='nb', **{TINY!r})\n"
        "print('mAP50-95', r.metrics['metrics/mAP50-95(B)'], r.best)",
        "train(bacth=8)",
        "print('alive', 1 + 1)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    where = {"metadata": {"path": str(REPO)}}
    client = NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True, resources=where)
    client.execute(env=offline_env())

    def text(cell) -> str:
        return "".join(o.get("text", "") + json.dumps(o.get("data", {})) for o in cell.outputs)

    trained, mistake, after = nb.cells[1], nb.cells[2], nb.cells[3]
    assert not any(o.output_type == "error" for o in trained.outputs), text(trained)
    assert "epoch 1/1" in text(trained) and "mAP50-95 " in text(trained)  # progress and the result
    (error,) = [o for o in mistake.outputs if o.output_type == "error"]
    assert error.ename == "UserError" and "did you mean 'batch'" in error.evalue
    assert "alive 2" in text(after)  # the kernel is alive after the error


def test_only_the_train_command_imports_the_trainer():
    """The trainer sits under the train command (and so under the API): no other module imports it, for typing or
    otherwise (issue 48; tests/test_layout.py checks the folders' order as a whole)."""
    import re

    package = Path(yoloaccum.__file__).parent
    pattern = re.compile(
        r"^\s*(from yoloaccum\.training(\.trainer\b| import [^\n]*\btrainer\b)|import yoloaccum\.training\.trainer)",
        re.M,
    )
    importers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if pattern.search(p.read_text()))
    assert importers == ["commands/train.py"], importers
