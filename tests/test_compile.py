"""compile=: the compiled model trains as the eager one, the short last micro-batch included, without recompiling
during training; checkpoints stay plain; resume works; a missing or failing compiler falls back to eager.

The model is tests/models/tiny26.yaml, a cut-down YOLO26 that inductor compiles in under a minute on two cores
(yolo26n takes several). Every test compiles the same graphs (micro-batches of 8 and 4 at 64 px, 4 classes), so after
the first, inductor's on-disk cache answers. The speed-up itself is measured by `make bench` (section h), not here.
"""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    SERIAL,
    TINY_MODEL,
    final_weights,
    global_settings_kept,
    offline_env,
    relative_difference,
    shapes_yaml,
)

from yoloaccum.config import settings as config
from yoloaccum.core import micro_batch, schedule
from yoloaccum.data import batches
from yoloaccum.errors import UserError
from yoloaccum.model import compiler
from yoloaccum.process import rng

sys.path.insert(0, str(REPO / "benchmarks"))
from common import CTX, engine_for, make_batches  # noqa: E402

# 20 images at batch 8: micro-batches of 8, 8 and a short one of 4, which yoloaccum trains rather than drops.
RUN = (
    "model=" + TINY_MODEL,
    "imgsz=64",
    "batch=8",
    "nbs=16",
    "workers=0",
    "plots=False",
    "exist_ok=True",
    "compile=True",
    "warmup_epochs=0",
    "seed=0",
    "deterministic=True",
)


@pytest.mark.parametrize(("value", "mode"), [(False, None), (True, "default"), ("max-autotune", "max-autotune")])
def test_compile_takes_ultralytics_values(value, mode):
    cfg = config.resolve(overrides={"compile": value})
    assert compiler.mode_of(cfg.compile) == mode


def test_an_unknown_compile_mode_is_refused():
    with pytest.raises(UserError, match="compile=fast is not true/false or one of default, reduce-overhead"):
        config.resolve(["compile=fast"])


@pytest.mark.parametrize(
    ("images", "micro", "world", "sizes"),
    [
        (20, 8, 1, (8, 4)),  # a short last micro-batch
        (24, 8, 1, (8,)),  # none
        (42, 8, 2, (8, 5)),  # the last global batch of 10 split over 2 ranks
        (43, 8, 2, (8, 6, 5)),  # 11: 5 and 6
        (5, 8, 1, (5,)),  # fewer images than one micro-batch
    ],
)
def test_micro_batch_sizes_are_those_the_sampler_gives(images, micro, world, sizes):
    assert batches.micro_batch_sizes(images, micro, world) == sizes
    given = set()
    for rank in range(world):
        sampler = batches.EpochBatchSampler(images, micro * world, rank, world)
        given |= {len(b) for b in sampler}
    assert given == set(sizes)


def test_after_an_out_of_memory_back_off_the_halved_sizes_are_compiled():
    """A run resumed after a back-off cuts each loader batch in engine.split parts: those are the sizes that run."""
    assert schedule.cut_sizes(8, 1) == {8}
    assert schedule.cut_sizes(8, 2) == {4}
    assert schedule.cut_sizes(3, 2) == {1, 2}
    assert schedule.cut_sizes(1, 4) == {1}  # no empty parts
    for n, parts in [(8, 1), (8, 2), (3, 2), (1, 4)]:  # the sizes split_batch() really cuts
        cut = micro_batch.split_batch({"img": torch.zeros(n, 1)}, parts)
        assert {len(c["img"]) for c in cut} == schedule.cut_sizes(n, parts)


@pytest.mark.numerics
def test_a_compiled_window_equals_the_eager_one_and_compiling_changes_nothing():
    """One window of a full and a short micro-batch: the same step to float tolerance, BatchNorm statistics and EMA
    included. And the warm-up that compiles leaves the weights, buffers and gradients as they were.

    Under the settings `yoloaccum train` makes (seed_everything, deterministic=True): they are part of inductor's cache
    key, so the graphs compiled here are those of a compiled run at bn=batch, and the next compile of them (the
    benchmark smoke's) reads them from the cache instead of compiling again."""
    with global_settings_kept():
        rng.seed_everything(0, deterministic=True)
        compiled_window_equals_eager()


def compiled_window_equals_eager() -> None:
    eager = engine_for(TINY_MODEL, 64, batch=8, nbs=16, num_batches=2)
    compiled = engine_for(TINY_MODEL, 64, batch=8, nbs=16, num_batches=2)
    state = copy.deepcopy(compiled.raw_model.state_dict())
    params = list(compiled.raw_model.parameters())
    open_window = [torch.randn_like(p) for p in params]  # as a window reopened on resume (remainder=carry)
    for p, g in zip(params, open_window):
        p.grad = g.clone()
    done = compiler.compile_model(compiled.raw_model, "default", (8, 4), 64, CTX.device, None, warn=pytest.fail)
    assert done is not None and done.batch_sizes == (8, 4)
    for k, v in compiled.raw_model.state_dict().items():
        assert torch.equal(v, state[k]), f"compiling changed {k}"
    assert all(torch.equal(p.grad, g) for p, g in zip(params, open_window))
    for p in params:
        p.grad = None

    batches = [make_batches(1, 8, 64, seed=1)[0], make_batches(1, 4, 64, seed=2)[0]]
    for engine in (eager, compiled):
        engine.train_epoch(0, [dict(b) for b in batches])
        assert [r.micro_batches for r in engine.history] == [2]  # one step, after both
    for name, a, b in (("weights", eager.raw_model, compiled.raw_model), ("ema", eager.ema.ema, compiled.ema.ema)):
        for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=f"{name} {k}")


def test_compiled_training_through_the_cli(tmp_path: Path, run_cli):
    """Trains every image (the short micro-batch too) without recompiling after the warm-up, writes plain weights
    that Ultralytics opens, reports the compile time on its own, and resumes to the uninterrupted run's weights."""
    from ultralytics import YOLO

    data_yaml = shapes_yaml(tmp_path, num_train=20, num_val=4)
    # bn=frozen: BatchNorm's mode is part of the compiled graph, so the warm-up must compile the one that trains.
    common = (f"data={data_yaml}", f"project={tmp_path}", "epochs=2", "bn=frozen", *RUN)
    # TORCH_LOGS=recompiles: dynamo says each time it compiles a graph again. The warm-up compiles 8, then 4.
    r = run_cli("train", *common, "name=whole", env={**SERIAL, "TORCH_LOGS": "recompiles"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compile: compiled (default, one graph per batch size) for micro-batches of 8 and 4 in" in r.stdout
    assert r.stderr.count("Recompiling function") == 1, r.stderr[-3000:]
    assert "expected 8, actual 4" in r.stderr
    said = " ".join(r.stdout.split())
    assert (
        "BatchNorm: bn=frozen: every BatchNorm layer normalises with its running statistics as initialised (mean 0, "
        "variance 1) and keeps them; its weight and bias train; precise_bn=auto recomputes none" in said
    )
    assert "recomputed over" not in said
    steps = (tmp_path / "whole/schedule.csv").read_text().splitlines()
    assert sum(int(line.split(",")[3]) for line in steps[1:]) == 40  # images stepped over: 2 epochs of 20
    assert steps[0].split(",")[3] == "effective_batch"

    best = torch.load(tmp_path / "whole/weights/best.pt", weights_only=False)
    assert not any("_orig_mod" in k for k in best["model"].state_dict())
    results = YOLO(str(tmp_path / "whole/weights/best.pt")).predict(torch.zeros(1, 3, 64, 64), verbose=False)
    assert len(results) == 1

    stopped = run_cli("train", *common, "name=resumed", env={**SERIAL, "YOLOACCUM_FAULT": "sigint@3"}, timeout=600)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    last = tmp_path / "resumed/weights/last.pt"
    resumed = run_cli("train", f"resume={last}", env=SERIAL, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "compile: compiled" in resumed.stdout
    # The resumed process compiles the same graphs again (from inductor's cache): the same kernels, bitwise.
    assert torch.equal(final_weights(tmp_path / "resumed"), final_weights(tmp_path / "whole"))


@pytest.mark.parametrize("case", ["no compiler", "failing compiler", "grad_checkpointing"])
def test_where_compiling_cannot_work_the_run_trains_eager_with_one_warning(tmp_path: Path, run_cli, case):
    """No C++ compiler at all; one that answers --version and fails every compilation, which inductor only finds out
    while compiling (an empty cache, so that nothing compiled earlier is reused); or grad_checkpointing, whose
    checkpoints dynamo cannot trace."""
    env, extra = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}, ()
    if case == "no compiler":
        env["CXX"] = str(tmp_path / "no-such-compiler")
    elif case == "failing compiler":
        env["CXX"] = str(tmp_path / "g++")
        Path(env["CXX"]).write_text(
            '#!/bin/sh\nif [ "$1" = --version ]; then echo "g++ (fake) 12.0"; exit 0; fi\n'
            'echo "fake g++: cannot compile" >&2; exit 1\n'
        )
        Path(env["CXX"]).chmod(0o755)
    else:
        extra = ("grad_checkpointing=True",)
    data_yaml = shapes_yaml(tmp_path, num_train=20, num_val=4)
    r = run_cli(
        "train",
        f"data={data_yaml}",
        f"project={tmp_path}",
        "name=eager",
        "epochs=1",
        "val=False",
        *RUN,
        *extra,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning: compile=default")]
    assert len(warnings) == 1, r.stdout
    assert warnings[0].endswith("training without compilation")
    reason = {"no compiler": "no C++ compiler", "failing compiler": "failed (", "grad_checkpointing": "grad_check"}
    assert reason[case] in warnings[0]
    assert "compile: compiled" not in r.stdout
    assert (tmp_path / "eager/weights/last.pt").exists()


@pytest.mark.numerics
@pytest.mark.slow
def test_two_compiled_ranks_end_where_two_eager_ranks_do(tmp_path: Path):
    """Under torchrun (gloo): DDP around the compiled model, no_sync on all but a window's last micro-batch. Global
    batch 16 on 2 ranks: micro-batches of 8, and of 4 at the end of the epoch, the graphs compiled above."""
    data_yaml = shapes_yaml(tmp_path, num_train=40, num_val=4)
    for compile_ in (False, True):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "yoloaccum",
            "train",
            f"data={data_yaml}",
            f"project={tmp_path}",
            f"name=compile_{compile_}",
            "epochs=1",
            "val=False",
            *RUN,
            "batch=16",
            "nbs=32",
            f"compile={compile_}",
        ]
        env = offline_env({**SERIAL, "TORCH_LOGS": "recompiles"})
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert r.stderr.count("Recompiling function") == (2 if compile_ else 0)  # each rank's warm-up: 8, then 4
        # every rank compiled, and all of them agree on it (one all-reduce), so the run trains compiled
        assert ("compile: compiled" in r.stdout) == compile_, r.stdout[-2000:]
        assert "failed on another rank" not in r.stdout
    difference = relative_difference(
        final_weights(tmp_path / "compile_True"), final_weights(tmp_path / "compile_False")
    )
    print(f"2 compiled ranks vs 2 eager ranks: {difference:.2e} relative")
    assert difference <= 1e-5


@pytest.mark.slow
def test_sizes_made_by_a_back_off_are_compiled_before_they_run(tmp_path: Path, run_cli):
    """Iteration 1 runs out of memory: micro-batches of 8 (24 images, no short one) become 4. Size 4 is compiled at
    once, as the warm-up compiles (random states and buffers kept), not inside the window it then runs in. Its graphs
    are those the CLI test above compiled (bn=frozen, 4 images), so inductor reads them from its cache; dynamo still
    traces them again, which TORCH_LOGS=recompiles shows."""
    data_yaml = shapes_yaml(tmp_path, num_train=24, num_val=4)
    r = run_cli(
        "train",
        f"data={data_yaml}",
        f"project={tmp_path}",
        "name=oom",
        "epochs=1",
        "bn=frozen",
        "val=False",
        *RUN,
        env={**SERIAL, "YOLOACCUM_FAULT": "oom@1", "TORCH_LOGS": "recompiles"},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "compile: compiled (default, one graph per batch size) for micro-batches of 8 in" in out
    assert "compile: compiled micro-batches of 4 after the back-off in" in out
    assert out.index("iteration 1: out of memory") < out.index("micro-batches of 4 after the back-off")
    assert r.stderr.count("Recompiling function") == 1, r.stderr[-3000:]  # 8 -> 4, after the back-off
