"""Run under torchrun by tests/test_distributed.py: what every rank sees at an epoch's end.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_epoch_end.py DATA MODEL OUT

Trains one epoch with bn=batch (each rank's BatchNorm statistics its own images') and checks, with steps added to
each rank's trainer, whether every rank's EMA buffers are the same before SameBuffers and at validation; then builds
the training set with cache=ram once per machine and checks every rank reads the images a rank decodes itself.
Rank 0 writes OUT (JSON).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import yoloaccum.config.ultra  # noqa: F401  (Ultralytics offline and quiet before it is imported)
from yoloaccum.config import settings as config
from yoloaccum.data import datasets, shared_cache
from yoloaccum.training import epoch_end
from yoloaccum.training.trainer import Trainer


def same_on_every_rank(tensor: torch.Tensor) -> bool:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tensor)
    return all(torch.equal(t, gathered[0]) for t in gathered)


def main(data: str, model: str, out: str) -> None:
    settings = [f"data={data}", f"model={model}", "imgsz=64", "batch=4", "nbs=8", "epochs=1", "warmup_epochs=0"]
    settings += ["bn=batch", "precise_bn=0", "workers=0", "plots=False", f"project={Path(out).parent}", "name=run"]
    trainer = Trainer.from_config(config.resolve(settings))
    ema, seen = trainer.parts.ema, {}

    def look(name):
        def step(end, decided):
            buffers = torch.cat([b.detach().float().flatten() for b in ema.ema.buffers()])
            seen[name] = same_on_every_rank(buffers)
            return decided

        return step

    trainer.add_step(look("before"), before=epoch_end.SameBuffers)
    trainer.add_step(look("at_validation"), before=epoch_end.Validate)
    trainer.train()
    ctx, cfg = trainer.parts.ctx, trainer.parts.cfg
    spec = datasets.load_spec(data)
    dataset = datasets.build_dataset(cfg.replace(cache=False), spec, "train", augment=False)
    shared_cache.cache_once_per_machine(dataset, ctx, "check")
    own = datasets.build_dataset(cfg.replace(cache=False), spec, "train", augment=False)
    identical = all(
        torch.equal(torch.from_numpy(dataset.ims[i]), torch.from_numpy(own.load_image(i)[0])) for i in range(len(own))
    )
    maps = Path("/proc/self/maps").read_text().splitlines()
    mapped = any("yoloaccum-" in line and "-check" in line for line in maps)
    dist.barrier()  # every rank past cache_once_per_machine: the file's name is gone, its mapping stays
    removed = not list(shared_cache.SHM.glob("yoloaccum-*-check*"))
    seen.update(cache=dataset.cache, identical=identical, mapped=mapped and removed)
    seen["every_rank"] = same_on_every_rank(torch.tensor([seen["identical"], seen["mapped"]]))
    if ctx.is_main:
        Path(out).write_text(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:4])
