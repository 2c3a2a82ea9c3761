"""The benchmark scripts in their reduced form, so they cannot rot: they run and produce numbers (not how fast)."""

import datetime
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, offline_env

pytestmark = pytest.mark.slow


def scratch_env(tmp_path) -> dict[str, str]:
    """The benchmarks keep their run folders in the system's temporary directory (for a look afterwards); here
    they go under the test's own folder, which pytest removes once the test passes. torch.compile's cache stays
    where it was, shared with the compile tests: a cold cache costs this suite minutes."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    return offline_env({"TMPDIR": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": cache})


def test_bench_smoke_produces_every_figure(tmp_path):
    r = subprocess.run(
        [sys.executable, "benchmarks/bench.py", "--smoke"],
        cwd=REPO,
        env=scratch_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # The report is the first JSON object on stdout; Ultralytics may print before it (its image-caching bar).
    report, _ = json.JSONDecoder().raw_decode(r.stdout[r.stdout.index("{\n") :])
    row = report["vs_ultralytics"][0]
    assert row["yoloaccum_img_s"] > 0 and row["ultralytics_img_s"] > 0 and row["fraction_of_bare_limit"] > 0
    assert len(report["memory_mb"]) == 3 and all(v > 0 for v in report["memory_mb"].values())
    assert report["accumulation"]["seconds_per_image_acc1"] > 0 and report["data_pipeline_img_s"] > 0
    checkpointing = report["grad_checkpointing"]
    assert checkpointing["added_ratio"] > 0 and checkpointing["speed_ratio"] > 0
    compiled = report["compile"]  # trained compiled, on the tiny model: no fallback to eager
    assert compiled["static"]["img_s"] > 0 and compiled["static"]["vs_eager"] > 0 and compiled["eager"]["img_s"] > 0
    assert "| static |" in r.stdout


def test_bench_ddp_quick_counts_one_all_reduce_per_window(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "benchmarks/ddp.py",
        "--quick",
    ]
    r = subprocess.run(cmd, cwd=REPO, env=scratch_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(line for line in r.stdout.splitlines() if line.startswith("| 8 |")).split("|")
    with_no_sync, every_micro_batch = float(row[5]), float(row[6])
    assert every_micro_batch == 8 * with_no_sync  # the same buckets, once per micro-batch instead of once per window


def test_fidelity_smoke_writes_the_report_table_and_plot(tmp_path):
    r = subprocess.run(
        [sys.executable, "benchmarks/fidelity.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        env=scratch_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (runs,) = json.loads((tmp_path / "fidelity.json").read_text()).values()
    assert sorted(runs) == ["b64", "ultralytics-b8"] and all(sorted(r) == ["0", "1"] for r in runs.values())
    first = runs["ultralytics-b8"]["0"]
    assert set(first) == {"seconds", "curve", "raw", "precise"} and len(first["curve"]) == 1  # one epoch validated
    table = (tmp_path / "fidelity.md").read_text()
    assert "| ultralytics-b8 | precise |" in table and "| b64 | raw |" in table
    assert (tmp_path / "fidelity.png").stat().st_size > 0


@pytest.mark.parametrize(("script", "expect"), [("bn_window.py", "bn=window"), ("startup.py", "yoloaccum plan")])
def test_small_benchmarks_run(script, expect, tmp_path):
    r = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--smoke"],
        cwd=REPO,
        env=scratch_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert expect in r.stdout
    if script == "bn_window.py":  # every bn=window mode timed its statistics pass
        parts = [float(x) for x in re.findall(r"pass \+(\d+\.\d+)", r.stdout)]
        assert len(parts) == 3 and min(parts) > 0, r.stdout  # and --study's freeze=, at the defaults' bn=window
        assert re.search(r"bn=frozen [\d.]+ img/s \([\d.]+x: no pass\)", r.stdout), r.stdout


def smoke(script: str, tmp_path) -> subprocess.CompletedProcess:
    """`python benchmarks/SCRIPT --smoke`, which must succeed."""
    r = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--smoke"],
        cwd=REPO,
        env=scratch_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_defaults_smoke_times_both_trainers_whole_process_and_per_epoch(tmp_path):
    r = smoke("defaults.py", tmp_path)
    row = next(line for line in r.stdout.splitlines() if line.startswith("| smoke |")).split("|")
    seconds = [float(cell.strip().removesuffix("s")) for cell in (row[3], row[4], row[6], row[7])]
    assert all(s > 0 for s in seconds), row


def test_time_split_smoke_splits_both_trainers_and_measures_its_own_cost(tmp_path):
    r = smoke("time_split.py", tmp_path)
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1] for line in r.stdout.splitlines() if line.startswith("| ")
    }
    for trainer in ("yoloaccum", "ultralytics"):
        forward_backward = float(rows[trainer][4])  # whole process, startup, data, to_device, forward_backward
        assert forward_backward > 0, rows
    assert re.search(r"Speed ratio, whole process, median of 1 repeats: \*\*[\d.]+x\*\*", r.stdout), r.stdout
    assert re.search(r"own cost: .*: [+-][\d.]+% .* The laps' own time: [\d.]+ µs each", r.stdout), r.stdout


def test_fidelity_finetune_smoke_pairs_runs_with_the_reference_and_ultralytics(tmp_path):
    """The fine-tuning study in small: a tiny checkpoint fine-tuned by both trainers, kept under its SHA-256; a
    configuration that resolves as another (b2-window as the default b2 from weights) reuses its runs."""
    from yoloaccum.core.schedule import bn_mode

    twin = f"b2-{bn_mode('auto', 2)}"
    cmd = [sys.executable, "benchmarks/fidelity_finetune.py", "--smoke", "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=REPO, env=scratch_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ((sha, record),) = json.loads((tmp_path / "shapes.json").read_text()).items()
    assert record["sha256"] == sha and sorted(record["runs"]) == sorted(["b2", twin, "b64", "ultralytics-b2"])
    assert r.stdout.count("shapes b2") == 1 and f"shapes {twin}" not in r.stdout  # one run for the two names
    assert record["runs"][twin]["0"]["same_run_as"] == "b2"
    day = datetime.date.fromisoformat(record["runs"]["b64"]["0"]["day"])  # the cost compares one day's runs
    assert datetime.date.today() - day <= datetime.timedelta(days=1)
    table = (tmp_path / f"shapes-{sha[:12]}.md").read_text()  # each checkpoint's report apart
    assert "| b2 | 0 |" in table and "| ultralytics-b2 | 0 |" in table
    assert f"| {twin} (the runs of b2) | 0 |" in table
    judged = (tmp_path / f"targets-{sha[:12]}.md").read_text()  # issue 61's targets, from every set's runs
    assert f"| shapes | 2 | bn={bn_mode('auto', 2)} |" in judged and "the default" in judged


def test_pretrain_finds_its_checkpoint_by_its_hash_and_refuses_an_altered_one(tmp_path, monkeypatch):
    """make pretrain remakes the checkpoint when it is missing or altered: a file whose SHA-256 is not the
    recorded one is not taken."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import pretrain

    monkeypatch.setenv("YOLOACCUM_PRETRAINED", str(tmp_path))
    assert pretrain.record() is None
    weights = tmp_path / f"{pretrain.NAME}.pt"
    weights.write_bytes(b"weights")
    (tmp_path / f"{pretrain.NAME}.json").write_text(json.dumps({"sha256": pretrain.sha256(weights)}))
    assert pretrain.record() is not None and pretrain.ensure() == weights
    weights.write_bytes(b"altered")
    assert pretrain.record() is None


def test_pretrain_restores_the_recorded_checkpoint_from_git_history_and_nothing_else(tmp_path, monkeypatch):
    """The recipe never gives the same file twice, so a fresh clone gets the study's checkpoint back from the commit
    that kept it, checked by its hash; a record no commit matches restores nothing (and ensure would train)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import pretrain

    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    if shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone (or none): the commit that keeps the checkpoint may not be in its history")
    monkeypatch.setenv("YOLOACCUM_PRETRAINED", str(tmp_path))
    weights, meta = tmp_path / f"{pretrain.NAME}.pt", tmp_path / f"{pretrain.NAME}.json"
    meta.write_text(json.dumps({"sha256": "0" * 64}))
    assert not pretrain.restore() and not weights.exists()
    meta.write_text((REPO / "benchmarks/pretrained" / meta.name).read_text())
    assert pretrain.restore() and pretrain.record() is not None
    assert pretrain.sha256(weights) == json.loads(meta.read_text())["sha256"]
