"""Validation shared by 2 and 3 ranks under real torchrun and gloo gives one process's figures, each image evaluated
once by one rank; `yoloaccum val` under torchrun too; a dataset one rank cannot see stops every rank with one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SERIAL, offline_env

TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")


def _shared(
    trained, folder, nproc: int, batch: int, data: str | None = None
) -> tuple[subprocess.CompletedProcess, list]:
    """tests/ddp_validate.py on nproc ranks (one: a plain process); each rank's metrics and image files."""
    weights, dataset = trained
    out = folder / f"val_{nproc}_{batch}"
    script = [REPO / "tests/ddp_validate.py", weights, data or dataset, batch, out]
    cmd = [*TORCHRUN, f"--nproc_per_node={nproc}", *script] if nproc > 1 else [sys.executable, *script]
    r = subprocess.run(
        list(map(str, cmd)), cwd=REPO, env=offline_env(SERIAL), capture_output=True, text=True, timeout=600
    )
    ranks = [json.loads(f.read_text()) for f in sorted(folder.glob(f"{out.name}.*.json"))]
    return r, ranks


_ONE_PROCESS: dict[int, dict] = {}


def _one_process(trained, batch: int) -> dict:
    """The reference: tests/ddp_validate.py in this process (no torchrun: one rank), once per batch."""
    if batch not in _ONE_PROCESS:
        import ddp_validate

        weights, dataset = trained
        out = Path(weights).parent / f"one_{batch}"
        ddp_validate.main(str(weights), str(dataset), batch, str(out))
        _ONE_PROCESS[batch] = json.loads(Path(f"{out}.0.json").read_text())
    return _ONE_PROCESS[batch]


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize(
    "nproc, batch",
    [(3, 8), (3, 16), (2, 5)],
    ids=["3 ranks, 32 images not a multiple of 24", "3 ranks, the third holding none", "2 ranks, a short last batch"],
)
def test_validation_shared_by_the_ranks_gives_one_process_figures(trained, tmp_path, nproc, batch):
    """32 images in batches of `batch`: each rank takes a contiguous run of whole batches, none padded or repeated,
    and every rank returns the figures of one process, val losses included, to 1e-6."""
    one = _one_process(trained, batch)
    r, ranks = _shared(trained, tmp_path, nproc, batch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(ranks) == nproc
    assert one["metrics"]["metrics/mAP50(B)"] > 0.02 and one["metrics"]["val/box_loss"] > 0  # not all zero
    for rank in ranks:
        assert rank["metrics"].keys() == one["metrics"].keys()
        for key, value in one["metrics"].items():
            assert rank["metrics"][key] == pytest.approx(value, abs=1e-6, rel=0), key
    shares = [rank["files"] for rank in ranks]
    assert [f for share in shares for f in share] == one["files"]  # each image once, in one process's order
    if batch == 16:
        assert shares[2] == []


def test_a_validation_set_one_rank_cannot_see_stops_every_rank_with_one_line(trained, tmp_path):
    """Rank 1's dataset is not there: both ranks stop with the same line (no rank waits in a collective)."""
    weights, dataset = trained
    r, ranks = _shared(trained, tmp_path, 2, 8, data=f"{dataset}:missing-on-rank-1")
    assert r.returncode != 0 and ranks == []
    assert r.stderr.count("(on rank 1)") == 2 and "absent.yaml does not exist" in r.stderr, r.stderr[-3000:]
    assert "every_rank_ok" not in r.stderr  # the ranks' own lines; torchrun then reports the failed job itself


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("nproc", [2, 3])
def test_val_under_torchrun_equals_the_one_process_val(trained, tmp_path, nproc, run_cli):
    """`yoloaccum val` under torchrun: the same figures as one process; rank 0 alone prints them."""
    from yoloaccum.commands.val import METRICS_OUT

    weights, dataset = trained
    args = ("val", f"model={weights}", f"data={dataset}", "imgsz=96", "batch=8", "device=cpu")
    one = Path(weights).parent / "val_one.json"
    if not one.exists():  # the one-process val, once for both
        r = run_cli(*args, env=offline_env({**SERIAL, METRICS_OUT: str(one)}), timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    shared = tmp_path / "shared.json"
    cmd = [*TORCHRUN, f"--nproc_per_node={nproc}", "-m", "yoloaccum", *args]
    env = offline_env({**SERIAL, METRICS_OUT: str(shared)})
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    expected, got = json.loads(one.read_text()), json.loads(shared.read_text())
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6, rel=0), key
    assert r.stdout.count("per class") == 1  # the figures printed once
