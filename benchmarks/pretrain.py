"""The pretrained checkpoint the fine-tuning study starts from: yolo26n trained on hardhat with a real batch of 64.

    python benchmarks/pretrain.py            # if missing, restore it from git history or train it; print its path
    python benchmarks/pretrain.py --force    # make it again
    python benchmarks/pretrain.py --check    # print its path and record; exit 1 if it is missing or altered

COCO weights cannot be had on these machines (nothing downloads), so hardhat's 4,916 photographs of construction
sites stand in for COCO: real photographs, a different domain from the fine-tuning sets (blood smears, aquariums),
and enough images for BatchNorm's running statistics to settle. The checkpoint is best.pt of that run, Ultralytics'
stripped half-precision layout, as a user's yolo26n.pt is. It lives in benchmarks/pretrained/ (or
$YOLOACCUM_PRETRAINED), outside git's tree, beside a JSON record with its SHA-256, recipe and hardhat val mAP and
its results.csv, which git keeps. The study checks the hash before every run, so it never fine-tunes from a file that
changed underneath it. The recipe does not give the same file twice (the code it trains with changes, and the file
holds its date), so a missing checkpoint is first looked for in git's history, where commit 7735957 kept the
study's, and restored from there when its hash is the recorded one; only then is it trained anew. A run stopped
before its end (a session's time is up) resumes from its work folder there (not in git) at the next `make pretrain`.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HARDHAT_YAML = REPO.parent / "shared/datasets/hardhat.yaml"
NAME = "yolo26n-hardhat-224"
# A real batch of 64 at 224 px, long enough for val mAP to level off; warmup and close_mosaic as the fidelity recipe.
RECIPE = {
    "model": "yolo26n.yaml",
    "imgsz": 224,
    "batch": 64,
    "nbs": 64,
    "epochs": 30,
    "warmup_epochs": 1,
    "close_mosaic": 5,
    "cache": "ram",
    "seed": 0,
    "plots": False,
    "device": "cpu",
}


def home() -> Path:
    return Path(os.environ.get("YOLOACCUM_PRETRAINED") or HERE / "pretrained")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def record() -> dict | None:
    """The checkpoint's record, if the checkpoint is there and its hash is the one recorded."""
    weights, meta = home() / f"{NAME}.pt", home() / f"{NAME}.json"
    if not (weights.is_file() and meta.is_file()):
        return None
    saved = json.loads(meta.read_text())
    return saved if saved.get("sha256") == sha256(weights) else None


def ensure(force: bool = False) -> Path:
    """The checkpoint's path; where it is missing or altered, restored from git's history, else trained (as it is
    when force is set)."""
    if not force and (record() is not None or restore()):
        return home() / f"{NAME}.pt"
    if not HARDHAT_YAML.is_file():
        raise SystemExit(f"pretrain: {HARDHAT_YAML} is not here; the pretrained checkpoint is made from it")
    return make()


def restore() -> bool:
    """Put the recorded checkpoint back from git's history (a fresh clone, a new machine) if a commit there holds a
    file with the recorded hash; False, and nothing written, where none does."""
    meta = home() / f"{NAME}.json"
    if not meta.is_file():
        return False
    wanted = json.loads(meta.read_text()).get("sha256")
    path = (HERE / "pretrained" / f"{NAME}.pt").relative_to(REPO).as_posix()
    revisions = git("rev-list", "HEAD", "--", path).split()
    for rev in revisions:
        blob = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, cwd=REPO).stdout
        if blob and hashlib.sha256(blob).hexdigest() == wanted:
            (home() / f"{NAME}.pt").write_bytes(blob)
            print(f"pretrain: restored {NAME}.pt from commit {rev[:7]} of git's history", flush=True)
            return True
    return False


def make() -> Path:
    """Train the checkpoint in a work folder beside it, resuming a run an earlier session left there (a session on
    these machines ends after 3 hours, and the run takes about one), then keep best.pt and its record."""
    from common import absolute_yaml

    work = home() / "work"
    last = work / "run/weights/last.pt"
    if last.exists():
        command = [sys.executable, "-m", "yoloaccum", "train", f"resume={last}"]
    else:
        work.mkdir(parents=True, exist_ok=True)
        data = absolute_yaml(HARDHAT_YAML, work)  # beside the run: a resume finds it where the run began
        args = {**RECIPE, "data": str(data), "project": str(work), "name": "run", "exist_ok": True}
        command = [sys.executable, "-m", "yoloaccum", "train", *(f"{k}={v}" for k, v in args.items())]
    print("pretrain:", " ".join(command[2:]), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO)
    minutes = (time.perf_counter() - start) / 60
    run = work / "run"
    with open(run / "results.csv") as f:
        rows = [{k.strip(): v for k, v in row.items()} for row in csv.DictReader(f)]
    best = max(rows, key=lambda r: float(r["metrics/mAP50-95(B)"]))  # fitness, as Ultralytics 8.4 weighs it
    home().mkdir(parents=True, exist_ok=True)
    target = home() / f"{NAME}.pt"
    shutil.copyfile(run / "weights/best.pt", target)
    saved = {
        "file": target.name,
        "sha256": sha256(target),
        "recipe": RECIPE,
        "data": "../shared/datasets/hardhat.yaml (4,916 train, 500 val)",
        "best_epoch": int(best["epoch"]),
        "hardhat_val": {k: float(best[k]) for k in ("metrics/mAP50(B)", "metrics/mAP50-95(B)")},
        "last_epoch_val": {k: float(rows[-1][k]) for k in ("metrics/mAP50(B)", "metrics/mAP50-95(B)")},
        "curve_map50_95": [round(float(r["metrics/mAP50-95(B)"]), 4) for r in rows],
        "minutes_of_the_last_process": round(minutes, 1),
        "made": datetime.date.today().isoformat(),
        "commit": git_head(),
    }
    (home() / f"{NAME}.json").write_text(json.dumps(saved, indent=1) + "\n")
    shutil.copyfile(run / "results.csv", home() / f"{NAME}-results.csv")
    shutil.rmtree(work, ignore_errors=True)  # done: the next make pretrain starts afresh only if this file goes
    print(f"pretrain: {target} ({minutes:.0f} min), hardhat val {saved['hardhat_val']}", flush=True)
    return target


def git(*args: str) -> str:
    """git's output in the repository ("" where git or the repository is missing)."""
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()
    except FileNotFoundError:
        return ""


def git_head() -> str:
    return git("rev-parse", "--short", "HEAD")


def main() -> None:
    sys.path.insert(0, str(HERE))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--force", action="store_true", help="train it again even if it is there")
    p.add_argument("--check", action="store_true", help="only say whether it is there and unaltered")
    a = p.parse_args()
    if a.check:
        saved = record()
        if saved is None:
            print(f"pretrain: {home() / NAME}.pt is missing or altered; make pretrain restores it from git or trains")
            raise SystemExit(1)
        print(home() / f"{NAME}.pt", json.dumps(saved["hardhat_val"]))
        return
    print(ensure(a.force))


if __name__ == "__main__":
    main()
