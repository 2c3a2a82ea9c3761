"""Run under torchrun by tests/test_validate.py: validation shared by the ranks.

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/ddp_validate.py WEIGHTS DATA BATCH OUT

Every rank builds an Evaluator over its share of DATA's validation images and evaluates WEIGHTS with the training
criterion; rank r writes OUT.r.json: the metrics it got and the image files its share held. Without torchrun it is one
process, the reference. With DATA "missing-on-rank-1", rank 1 is given a dataset whose folder does not exist.
"""

import json
import sys
from pathlib import Path

import torch

import yoloaccum.config.ultra  # noqa: F401  (Ultralytics offline and quiet before it is imported)
from yoloaccum.config import settings as config
from yoloaccum.config.ultra import ultralytics_args
from yoloaccum.data import datasets as data
from yoloaccum.distributed import ddp as distributed
from yoloaccum.errors import UserError
from yoloaccum.evaluation.validate import Evaluator
from yoloaccum.model import checkpoint


def main(weights: str, dataset: str, batch: int, out: str) -> None:
    ctx = distributed.setup("cpu")
    if dataset.endswith(":missing-on-rank-1") and ctx.rank == 1:
        dataset = str(Path(dataset.removesuffix(":missing-on-rank-1")).with_name("absent.yaml"))
    dataset = dataset.removesuffix(":missing-on-rank-1")
    cfg = config.resolve([f"data={dataset}", "imgsz=96", f"batch={batch}", "workers=0"])
    model = checkpoint.model_of(checkpoint.load(weights))
    model.args = ultralytics_args(cfg)
    criterion = model.init_criterion()
    try:
        spec = data.load_spec(dataset) if Path(dataset).exists() else None
        error = None if spec else f"{dataset} does not exist"
    except UserError as e:
        spec, error = None, str(e)
    try:
        distributed.every_rank_ok(error, ctx)
        evaluator = Evaluator(cfg, spec, Path(out).parent if ctx.is_main else None, batch, ctx.device, ctx=ctx)
        metrics = evaluator.evaluate(model, criterion)
    except UserError as e:
        print(f"rank {ctx.rank}: {e}", file=sys.stderr)
        sys.exit(2)
    loader = evaluator.validator.dataloader
    files = [loader.dataset.im_files[i] for i in loader.batch_sampler.sampler.indices]  # the ShardBatches
    Path(f"{out}.{ctx.rank}.json").write_text(json.dumps({"metrics": metrics, "files": files}))
    distributed.cleanup()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
