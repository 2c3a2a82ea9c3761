"""Run under torchrun by tests/test_bn_adapt.py: bn_adapt's statistics on every rank.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_bn_adapt.py DATA PROJECT OUT

Each rank builds the run's trainer (bn=frozen, bn_adapt=16), adapts its BatchNorm statistics, as the trainer does
before the first step, and writes them to OUT/RANK.pt.
"""

import sys
from pathlib import Path

import torch

import yoloaccum.config.ultra  # noqa: F401  (Ultralytics offline and quiet before it is imported)
from yoloaccum.batchnorm import precise as precise_bn
from yoloaccum.config import settings as config
from yoloaccum.distributed import ddp as distributed
from yoloaccum.training.trainer import Trainer


def main(data: str, project: str, out: str) -> None:
    tiny = Path(__file__).resolve().parent / "models/tiny26.yaml"
    settings = [f"data={data}", f"model={tiny}", "imgsz=64", "batch=4", "nbs=8", "epochs=1"]
    settings += ["bn=frozen", "bn_adapt=16", "workers=0", "plots=False", f"project={project}", "name=ranks"]
    trainer = Trainer.from_config(config.resolve(settings))
    trainer.adapt_batchnorm()
    layers = precise_bn.bn_layers(trainer.parts.raw_model)
    Path(out).mkdir(exist_ok=True)
    torch.save(
        [t.clone() for m in layers for t in (m.running_mean, m.running_var)], f"{out}/{trainer.parts.ctx.rank}.pt"
    )
    distributed.cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:])
