"""Run under torchrun by tests/test_precise_bn.py: precise BatchNorm statistics over several ranks.

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/ddp_precise_bn.py OUT.pt

Each rank takes every N-th image of test_precise_bn's images, in micro-batches of 2; rank 0 saves every layer's
recomputed running statistics.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_precise_bn import images, make_model  # noqa: E402

from yoloaccum.batchnorm import precise as precise_bn
from yoloaccum.distributed import ddp as distributed  # noqa: E402


def main(out: str) -> None:
    ctx = distributed.setup("cpu")
    model = make_model()
    mine = images()[ctx.rank :: ctx.world_size]
    precise_bn.recompute(model, mine.split(2), ctx)
    if ctx.is_main:
        torch.save([(m.running_mean, m.running_var) for m in precise_bn.bn_layers(model)], out)
    distributed.cleanup()


if __name__ == "__main__":
    main(sys.argv[1])
