"""Shared pieces of the benchmarks: the data, engines on batches held in memory, the bare limit and the two trainers'
epochs. The functions a benchmark runs in a fresh process return JSON-able values."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import yaml

import yoloaccum.config.ultra  # noqa: F401  (ultralytics offline before it is imported)
from yoloaccum.config import settings as config
from yoloaccum.config.ultra import ultralytics_args
from yoloaccum.core import schedule
from yoloaccum.core.engine import Engine
from yoloaccum.core.loss import WindowLoss
from yoloaccum.core.micro_batch import model_input
from yoloaccum.data.batches import build_loader, loader_workers
from yoloaccum.distributed import ddp as distributed
from yoloaccum.model import freeze as freeze_
from yoloaccum.process import memory, rng

REPO = Path(__file__).resolve().parents[1]
SHAPES_YAML = "datasets/shapes.yaml"
# The tests' cut-down YOLO26, which trains and compiles in seconds: every benchmark's --smoke model
TINY_MODEL = str(REPO / "tests/models/tiny26.yaml")
BACKBONE = 11  # yolo26's backbone is layers 0-10: freeze=11 trains the neck and head on its features
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if CUDA else torch.device("cpu")
CTX = distributed.Context(0, 0, 1, DEVICE)
AMP = CUDA  # (f): AMP on CUDA; on the CPU both trainers run fp32
# What both trainers are given, besides model, data, imgsz and epochs. warmup_epochs=0: the measured epoch is steady
# state, at the full accumulate (a warmup ramps accumulate from 1, hence more optimizer steps per image). cache=ram:
# images are decoded once, not every epoch, as one would run a set this small (decoding is a quarter to a third
# of the pipeline's CPU time, which it takes from training on these two cores).
TRAIN_ARGS = dict(
    batch=8,
    nbs=64,
    workers=2,
    cache="ram",
    close_mosaic=0,
    warmup_epochs=0,
    val=False,
    plots=False,
    amp=AMP,
    device="0" if CUDA else "cpu",
)


def shapes_data(folder: str | None, smoke: bool, counts: dict | None = None) -> Path:
    """The shapes set as an absolute-path YAML (Ultralytics resolves relative paths elsewhere); small for --smoke,
    or made with the given generator counts."""
    from yoloaccum.data import shapes

    root = Path(folder) / "shapes" if folder else REPO / "datasets/shapes"
    recipe = yaml.safe_load((REPO / SHAPES_YAML).read_text())["yoloaccum_generate"]
    counts = counts or ({"num_train": 48, "num_val": 8, "imgsz": 64, "seed": 0} if smoke else recipe)
    shapes.ensure(root, **counts)
    spec = {"path": str(root), "train": "images/train", "val": "images/val", "names": dict(enumerate(shapes.CLASSES))}
    path = Path(tempfile.mkdtemp()) / "shapes.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def absolute_yaml(data: Path, folder: Path | None = None) -> Path:
    """A copy of a dataset YAML with its `path` made absolute, in `folder` (a temporary one by default): Ultralytics
    resolves a relative one against its own datasets folder, yoloaccum against the YAML's."""
    spec = yaml.safe_load(data.read_text())
    spec["path"] = str((data.parent / spec.get("path", ".")).resolve())
    path = Path(folder or tempfile.mkdtemp()) / data.name
    path.write_text(yaml.safe_dump(spec))
    return path


def make_batches(n: int, micro: int, imgsz: int, seed: int = 0) -> list[dict]:
    """n synthetic micro-batches, 1 to 4 objects an image, already in memory."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        per_image = torch.randint(1, 5, (micro,), generator=g)
        k = int(per_image.sum())
        xy, wh = torch.rand(k, 2, generator=g) * 0.6 + 0.2, torch.rand(k, 2, generator=g) * 0.2 + 0.1
        out.append(
            {
                "img": torch.rand(micro, 3, imgsz, imgsz, generator=g),
                "batch_idx": torch.repeat_interleave(torch.arange(micro), per_image).float(),
                "cls": torch.randint(0, 4, (k, 1), generator=g).float(),
                "bboxes": torch.cat([xy, wh], 1),
            }
        )
    return out


def real_batches(data: str | Path, imgsz: int, micro: int, n: int) -> list[dict]:
    """The first n micro-batches of the training loader (mosaic and all augmentation, the trainers' cache setting,
    which also decides where mosaic draws its other images from), held in memory."""
    from yoloaccum.data import datasets as data_

    cfg = config.resolve(
        overrides=dict(data=str(data), imgsz=imgsz, batch=micro, workers=0, close_mosaic=0, cache=TRAIN_ARGS["cache"])
    )
    dataset = data_.build_dataset(cfg, data_.load_spec(cfg.data), "train")
    batches = []
    while len(batches) < n:  # a small set (--smoke) may need more than one pass
        batches += [b for _, b in zip(range(n - len(batches)), build_loader(dataset, cfg, micro, 0, 1, DEVICE))]
    return batches


def engine_for(
    model: str,
    imgsz: int,
    batch: int,
    nbs: int,
    num_batches: int,
    epochs: int = 1,
    grad_checkpointing: bool = False,
    freeze: int | None = None,
) -> Engine:
    """yoloaccum's engine around a fresh model as the trainer sets it up (channels-last, AMP on CUDA, an EMA,
    grad_checkpointing, and freeze='s layers without gradients), with a schedule of num_batches micro-batches an
    epoch and no warmup. Whoever calls model.train() sets BatchNorm's mode after it (model.set_bn_mode)."""
    from ultralytics.nn.tasks import DetectionModel
    from ultralytics.utils.torch_utils import ModelEMA

    from yoloaccum.model.build import checkpoint_blocks

    memory.keep_freed_memory()  # as the trainer does, so that the memory and accumulation probes see its allocator
    cfg = config.resolve(
        overrides=dict(batch=batch, nbs=nbs, epochs=epochs, warmup_epochs=0, imgsz=imgsz, optimizer="SGD")
    )
    s = schedule.build(cfg, num_images=batch * num_batches, nc=4)
    torch.manual_seed(0)
    raw = DetectionModel(model, nc=4, verbose=False).to(DEVICE, memory_format=torch.channels_last)
    raw.args = ultralytics_args(cfg)
    raw.train()
    frozen = freeze_.apply(raw, freeze)
    ema = ModelEMA(raw)
    if frozen:
        freeze_.keep_in_ema(ema, raw, frozen)
    if grad_checkpointing:
        checkpoint_blocks(raw)
    return Engine.build(raw, WindowLoss(raw, "window"), s, CTX, amp=AMP, ema=ema)


def on_device(batches: list[dict]) -> list[dict]:
    """Batches moved to the device and their images made float in [0, 1]: what the model eats."""
    out = []
    for b in batches:
        b = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        out.append({**b, "img": model_input(b["img"], DEVICE)})
    return out


def synchronize() -> None:
    if CUDA:
        torch.cuda.synchronize()


def bare_pass(model: torch.nn.Module, loss, batches: list[dict]) -> float:
    """(b) The fastest any trainer could go: the model's forward + loss + backward on batches already on the device.
    No data loading, no logging, no optimizer. Images/s; the first two batches warm up and are not counted.

    It leaves the model as it found it: no gradients (as at a window's end) and BatchNorm's running statistics
    restored, so that training can go on undisturbed."""
    from yoloaccum.core.buffers import kept

    with kept(model):
        for i, b in enumerate(batches):
            if i == 2:
                synchronize()
                start = time.perf_counter()
            with torch.autocast(DEVICE.type, enabled=AMP):
                value = loss(model(b["img"]), b)[0]
            value.backward()
        synchronize()
        images_per_second = (len(batches) - 2) * batches[0]["img"].shape[0] / (time.perf_counter() - start)
    for p in model.parameters():
        p.grad = None
    return images_per_second


def train_from_memory(model: str, imgsz: int, batch: int, nbs: int, steps: int) -> float | None:
    """The memory probe: `steps` micro-batches (whole windows) through the engine; on CUDA, the peak bytes allocated."""
    accumulate = max(round(nbs / batch), 1)
    n = max(steps // accumulate, 1) * accumulate
    engine_for(model, imgsz, batch, nbs, n).train_epoch(0, on_device(make_batches(n, batch, imgsz)))
    return torch.cuda.max_memory_allocated() if CUDA else None


def checkpointing_probe(model: str, imgsz: int, batch: int, steps: int, grad_checkpointing: bool) -> dict:
    """(g) One micro-batch to warm up, then `steps` windows of one micro-batch each through the engine, with or
    without grad_checkpointing: images/s of the timed ones and, on CUDA, the peak bytes allocated (on the CPU the
    parent reads the process's max RSS)."""
    engine = engine_for(model, imgsz, batch, batch, steps, epochs=2, grad_checkpointing=grad_checkpointing)
    # Each micro-batch is made when the engine asks for it, so that memory holds one, as a loader's would.
    batches = (on_device(make_batches(1, batch, imgsz, seed=k))[0] for k in range(steps + 1))
    engine.train_epoch(0, [next(batches)], start=steps - 1)  # the first epoch's last micro-batch: the warm-up
    synchronize()
    start = time.perf_counter()
    engine.train_epoch(1, batches)
    synchronize()
    img_s = steps * batch / (time.perf_counter() - start)
    return {"img_s": img_s, "cuda_bytes": torch.cuda.max_memory_allocated() if CUDA else None}


def yoloaccum_and_bare_limit(model: str, data: str, imgsz: int, epochs: int, fraction: float, iterations: int) -> dict:
    """(a) and (b) in one process. yoloaccum's trainer, as `yoloaccum train` builds and runs it: images/s of its last
    epoch, as it logs them in results.csv. And the bare limit on the trainer's own model, at each epoch's end, on
    `iterations` of the training loader's batches held on the device: the mean of the passes just before and just
    after the last epoch. Side by side in one process, the two share the machine's speed of the moment, the memory
    layout and the threads, which fresh processes do not (these machines vary by 10-20% between runs)."""
    from yoloaccum.training import trainer

    project = tempfile.mkdtemp()
    args = {**TRAIN_ARGS, "model": model, "data": data, "imgsz": imgsz, "epochs": epochs, "fraction": fraction}
    cfg = config.resolve([f"{k}={v}" for k, v in args.items()] + ["verbose=False", f"project={project}", "name=bench"])
    batches = on_device(real_batches(data, imgsz, cfg.batch, iterations + 2))
    img_s, bare = [], []

    run = trainer.Trainer.from_config(cfg)

    def with_bare_limit(end, decided):  # an end-of-epoch step of its own, first: before validation and saving
        img_s.append(end.images_per_second)
        bare.append(bare_pass(run.parts.raw_model, run.parts.loss, batches))
        return decided

    run.epoch_end.insert(0, with_bare_limit)
    run.train()
    workers = loader_workers(TRAIN_ARGS["workers"], DEVICE)  # what its loader ran with
    return {
        "img_s": img_s[-1],
        "bare_limit_img_s": (bare[-2] + bare[-1]) / 2,
        "threads": torch.get_num_threads(),
        "workers": workers,
    }


def bare_limit(model: str, data: str, imgsz: int, micro: int, iterations: int) -> dict:
    """The bare limit alone, in its own process: a fresh model's forward, loss and backward at micro-batch `micro`
    on `iterations` real training batches held on the device (AMP on CUDA, deterministic kernels), as the trainer
    sets the model up. What the GPU check sets beside the two trainers' images per second at the same micro-batch."""
    rng.seed_everything(0, deterministic=True)  # as the trainers it is set beside (deterministic=True)
    engine = engine_for(model, imgsz, micro, 64, iterations)
    batches = on_device(real_batches(data, imgsz, micro, iterations + 2))
    bare_pass(engine.raw_model, engine.loss, batches[:4])  # kernels chosen and memory pooled before it counts
    return {"micro_batch": micro, "imgsz": imgsz, "bare_limit_img_s": bare_pass(engine.raw_model, engine.loss, batches)}


def ultralytics_images_per_second(
    model: str, data: str, imgsz: int, epochs: int, fraction: float, compile: bool = False
) -> dict:
    """Ultralytics' own trainer (YOLO.train) on the same settings: images/s of its last epoch's batch loop, and of
    each epoch ("epochs_img_s"), counting the images it trained (with compile=True it drops each epoch's last batch).

    Also what it ran with: on the CPU its trainer sets workers=0 and torch's threads to cores - 1, whatever it is told.
    """
    from ultralytics import YOLO

    marks, epoch_img_s = {}, []

    def epoch_end(t):
        loader = t.train_loader
        images = len(loader) * loader.batch_size if loader.drop_last else len(loader.dataset)
        epoch_img_s.append(images / (time.perf_counter() - marks["start"]))
        marks.update(workers=loader.num_workers, threads=torch.get_num_threads(), images=images)

    yolo = YOLO(model)
    yolo.add_callback("on_train_epoch_start", lambda t: marks.__setitem__("start", time.perf_counter()))
    yolo.add_callback("on_train_epoch_end", epoch_end)
    yolo.train(
        **TRAIN_ARGS,
        data=data,
        imgsz=imgsz,
        epochs=epochs,
        fraction=fraction,
        project=tempfile.mkdtemp(),
        name="bench",
        pretrained=False,
        verbose=False,
        compile=compile,
    )
    return {
        "img_s": epoch_img_s[-1],
        "epochs_img_s": epoch_img_s,
        "images": marks["images"],
        "threads": marks["threads"],
        "workers": marks["workers"],
    }


def yoloaccum_compiled(
    model: str, data: str, imgsz: int, epochs: int, fraction: float, compile: bool, dynamic: bool = False
) -> dict:
    """yoloaccum's trainer as `yoloaccum train` runs it, eager or with compile=True (one graph per batch size, or
    with dynamic, one with a dynamic batch size): images/s of each epoch as results.csv has them, and the compile
    time, which the trainer spends before its first epoch."""
    from yoloaccum.model import compiler
    from yoloaccum.training import trainer

    compiler.DYNAMIC = dynamic
    args = {
        **TRAIN_ARGS,
        "model": model,
        "data": data,
        "imgsz": imgsz,
        "epochs": epochs,
        "fraction": fraction,
        "compile": compile,
    }
    cfg = config.resolve([f"{k}={v}" for k, v in args.items()] + ["verbose=False", f"project={tempfile.mkdtemp()}"])
    img_s = []

    run = trainer.Trainer.from_config(cfg)
    run.add_step(lambda end, decided: img_s.append(end.images_per_second) or decided)
    run.train()
    if compile and run.compiled is None:
        raise RuntimeError("compile=True fell back to eager, with the warning printed above")
    return {
        "img_s": img_s[-1],
        "epochs_img_s": img_s,
        "compile_s": run.compiled.seconds if compile else 0.0,
        "images": len(run.parts.train_set),
    }
