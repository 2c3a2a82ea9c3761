"""bn_adapt= (with bn=frozen): the running statistics adapted to the training data before the first step, then kept.
They equal a precise-BN recompute over the same images, leave freeze='s layers bitwise, reach the EMA, are not
recomputed by a resumed run (which ends bitwise where the uninterrupted one does), and are the same on every rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PLUMBING, REPO, SERIAL, final_weights, offline_env, relative_difference, shapes_yaml

from yoloaccum.batchnorm import precise as precise_bn
from yoloaccum.config import settings as config
from yoloaccum.core.buffers import Kept
from yoloaccum.data import datasets as data_
from yoloaccum.model import checkpoint
from yoloaccum.training.trainer import Trainer

RUN = (*PLUMBING, "imgsz=64", "batch=4", "nbs=8", "epochs=2", "workers=0", "warmup_epochs=0", "bn=frozen")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return shapes_yaml(tmp_path_factory.mktemp("adapt"), num_train=24, num_val=6, seed=7)


def trainer(data: Path, folder: Path, **changes) -> Trainer:
    settings = dict(arg.split("=", 1) for arg in RUN)
    settings.update({"data": str(data), "project": str(folder), "name": "run", "bn_adapt": "16", **changes})
    return Trainer.from_config(config.resolve([f"{k}={v}" for k, v in settings.items()]))


def statistics(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.clone() for m in precise_bn.bn_layers(model) for t in (m.running_mean, m.running_var)]


def test_the_adapted_statistics_are_a_precise_bn_recompute_over_the_same_images_and_reach_the_ema(data, tmp_path):
    t = trainer(data, tmp_path)
    p = t.parts
    before = Kept(p.raw_model)
    t.adapt_batchnorm()
    adapted = statistics(p.raw_model)
    assert all(torch.equal(a, b) for a, b in zip(statistics(p.ema.ema), adapted, strict=True))
    before.put_back()  # the statistics as built, then precise BatchNorm's recompute over the same images
    initial = statistics(p.raw_model)
    precise_bn.recompute_images(p.raw_model, data_.precise_bn_images(p.cfg, p.spec, 16, 0, 1), p.ctx)
    assert all(torch.equal(a, b) for a, b in zip(adapted, statistics(p.raw_model), strict=True))  # bitwise
    assert not all(torch.equal(a, b) for a, b in zip(initial, adapted))  # initialised statistics: 0 and 1


def test_freezes_layers_keep_their_statistics_bitwise(data, tmp_path):
    t = trainer(data, tmp_path, freeze="4")
    p = t.parts
    named = {n: m for n, m in p.raw_model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    before = {n: (m.running_mean.clone(), m.running_var.clone()) for n, m in named.items()}
    t.adapt_batchnorm()
    for name, m in named.items():
        kept = torch.equal(m.running_mean, before[name][0]) and torch.equal(m.running_var, before[name][1])
        frozen = int(name.split(".")[1]) < 4  # model.0 to model.3
        assert kept == frozen, name


def test_bn_adapt_needs_bn_frozen(data, tmp_path, cli_in_process):
    r = cli_in_process("train", f"data={data}", *RUN[:-1], f"project={tmp_path}", "bn_adapt=16")
    assert r.returncode == 2 and "bn_adapt=16 adapts the running statistics that bn=frozen keeps" in r.stderr
    assert not (tmp_path / "exp").exists()


@pytest.mark.numerics
def test_a_run_resumed_after_the_adaptation_ends_bitwise_and_does_not_adapt_again(data, tmp_path, run_cli):
    common = ("train", f"data={data}", *RUN, "bn_adapt=16", f"project={tmp_path}")
    r = run_cli(*common, "name=full", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("BatchNorm: running statistics adapted to this data over 16 training images (") == 1
    r = run_cli(*common, "name=sig", env={**SERIAL, "YOLOACCUM_FAULT": "sigint@8"}, timeout=600)
    assert r.returncode == 130, r.stderr[-2000:]
    r = run_cli("train", f"resume={tmp_path / 'sig/weights/last.pt'}", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "BatchNorm: running statistics adapted" not in r.stdout  # kept from last.pt, not recomputed
    assert relative_difference(final_weights(tmp_path / "sig"), final_weights(tmp_path / "full")) == 0.0
    shipped = checkpoint.load(tmp_path / "full/weights/last.pt")["yoloaccum"]["model"]
    assert any(k.endswith("running_var") and not torch.all(v == 1) for k, v in shipped.items())


def test_under_torchrun_every_rank_adapts_to_the_same_statistics(data, tmp_path):
    out = tmp_path / "ranks"
    r = subprocess.run(
        [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"),
            str(REPO / "tests/ddp_bn_adapt.py"),
            str(data),
            str(tmp_path),
            str(out),
        ],
        capture_output=True,
        text=True,
        env=offline_env(SERIAL),
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rank0, rank1 = (torch.load(out / f"{rank}.pt") for rank in (0, 1))
    assert len(rank0) > 10 and all(torch.equal(a, b) for a, b in zip(rank0, rank1, strict=True))
