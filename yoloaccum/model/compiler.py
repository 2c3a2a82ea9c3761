"""compile=: torch.compile (inductor) of the model's forward, the part of a micro-step that runs on fixed shapes.

What is compiled: the training model's forward, and with it the backward that AOTAutograd derives from it. The loss
is not: its target assignment works on as many boxes as each micro-batch holds, so its shapes change every time
(dynamo would recompile or break its graph). Validation runs the EMA, uncompiled (docs/compile.md says why).

Shapes: training images all have imgsz × imgsz pixels, so only the batch dimension varies: the micro-batch, and the
shorter last micro-batch of an epoch, which yoloaccum trains rather than drops. `dynamic=False` compiles one graph
per size and `dynamic=True` one graph with a symbolic batch dimension; both are compiled up front, before the first
epoch, so that the compile time is reported on its own and no micro-batch recompiles in the middle of a window.

The compiled forward is installed on the module itself (nn.Module.compile), so the parameters, the state_dict and
the checkpoints are those of the plain model, and DDP, no_sync and the EMA see the module they would see in eager.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from yoloaccum.config.settings import Config
from yoloaccum.core import backoff, precision, schedule
from yoloaccum.core.buffers import kept
from yoloaccum.data import batches
from yoloaccum.distributed import ddp as distributed
from yoloaccum.errors import UserError
from yoloaccum.model import build as model_
from yoloaccum.process import rng

# One graph per micro-batch size (False), or one with a dynamic batch dimension (True): see docs/compile.md for
# the measurement that chose it. A module setting rather than a key: users choose a mode, not a tracing strategy.
DYNAMIC = False


# Modes that record CUDA graphs on CUDA. Gradient accumulation meets them in ways never run here: gradients that alias
# graph outputs, BatchNorm buffers mutated inside a graph, graph memory pools that the back-off's empty_cache() cannot
# free. On the CPU inductor records no graphs, and these modes compile as the others do.
CUDA_GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})


def check(cfg: Config) -> None:
    """Refuse, before anything is built, a compile mode that would record CUDA graphs."""
    mode = mode_of(cfg.compile)
    if mode in CUDA_GRAPH_MODES and distributed.cuda_ids(cfg.device):
        raise UserError(
            f"compile={mode} records CUDA graphs, which yoloaccum does not combine with gradient "
            "accumulation; use compile=True or compile=max-autotune-no-cudagraphs"
        )


def mode_of(value: bool | str) -> str | None:
    """Ultralytics' meaning of compile=: False off, True "default", or a torch.compile mode name (config checks it)."""
    return "default" if value is True else value or None


@dataclass(frozen=True)
class Compiled:
    """A model whose forward was compiled and warmed up: the mode, the batch sizes compiled, and how long it took."""

    mode: str
    dynamic: bool
    batch_sizes: tuple[int, ...]
    seconds: float

    def describe(self) -> str:
        sizes = " and ".join(map(str, self.batch_sizes))
        shape = "one graph with a dynamic batch size" if self.dynamic else "one graph per batch size"
        return f"compiled ({self.mode}, {shape}) for micro-batches of {sizes} in {self.seconds:.1f} s"


def for_run(
    cfg: Config, engine, num_images: int, say: Callable[[str], None], bn: str, frozen: tuple[str, ...] = ()
) -> Compiled | None:
    """compile= for a run: the engine's model compiled before the first epoch, in the modes it trains in, for every
    micro-batch size any rank will run: the loader's (the same list on all ranks, so that collectives inside the
    forward, such as SyncBatchNorm's, stay matched), cut as a resumed out-of-memory back-off cuts them. All ranks
    compile, or none does. Prints what it did with `say`."""

    def warn(line: str) -> None:
        say(f"[yellow]warning:[/] {line}")

    mode, ctx, model = mode_of(cfg.compile), engine.ctx, engine.raw_model
    if cfg.grad_checkpointing:  # dynamo cannot trace its checkpoints, which restore BatchNorm's buffers
        warn(
            f"compile={mode} does not combine with grad_checkpointing=True (torch.compile cannot trace its "
            "checkpoints); training without compilation"
        )
        return None
    loader_sizes = batches.micro_batch_sizes(num_images, engine.schedule.micro_batch, ctx.world_size)
    sizes = sorted({p for n in loader_sizes for p in schedule.cut_sizes(n, engine.split)}, reverse=True)
    say(f"compile={mode}: compiling the model for micro-batches of {' and '.join(map(str, sizes))}...")
    engine.model.train()  # BatchNorm's mode is part of the graph: compile the one that trains
    model_.set_bn_mode(engine.model, bn, frozen)  # the mode in force (bn=auto resolved), as train_epoch sets it
    try:
        with rng.rng_kept():  # compiling draws no training random numbers: make sure of it
            compiled = compile_model(model, mode, sizes, cfg.imgsz, ctx.device, engine.autocast_dtype, warn)
    except RuntimeError as e:
        if not backoff.is_out_of_memory(e):
            raise
        raise UserError(
            f"compile={mode} ran out of device memory compiling micro-batches of {sizes[0]}; train "
            "with compile=False (which backs off by itself) or a smaller batch"
        ) from e
    compiled_ranks = torch.tensor([float(compiled is not None)], device=ctx.device)
    if distributed.all_reduce_sum(compiled_ranks, ctx).item() < ctx.world_size:
        uncompile(model)
        if compiled is not None:
            warn(f"compile={mode} failed on another rank; all ranks train without compilation")
        return None
    say(f"compile: {compiled.describe()}")
    return compiled


def after_back_off(compiled: Compiled, engine, num_images: int, imgsz: int, say: Callable[[str], None]) -> Compiled:
    """Compile, as the warm-up before the first epoch does (random states and the model's buffers and gradients kept),
    the micro-batch sizes an out-of-memory back-off has just made, so that none compiles inside a window. Returns
    the Compiled with them added."""
    loader_sizes = batches.micro_batch_sizes(num_images, engine.schedule.micro_batch, engine.ctx.world_size)
    new = sorted(
        {p for n in loader_sizes for p in schedule.cut_sizes(n, engine.split)} - set(compiled.batch_sizes), reverse=True
    )
    if not new:
        return compiled
    start = time.perf_counter()
    with rng.rng_kept():
        for size in new:
            warm_up(engine.raw_model, size, imgsz, engine.ctx.device, engine.autocast_dtype)
    seconds = time.perf_counter() - start
    say(f"compile: compiled micro-batches of {' and '.join(map(str, new))} after the back-off in {seconds:.1f} s")
    sizes = tuple(sorted({*compiled.batch_sizes, *new}, reverse=True))
    return dataclasses.replace(compiled, batch_sizes=sizes, seconds=compiled.seconds + seconds)


def compile_model(
    model: nn.Module,
    mode: str,
    batch_sizes: Iterable[int],
    imgsz: int,
    device: torch.device,
    amp: torch.dtype | None,
    warn: Callable[[str], None],
    dynamic: bool | None = None,
) -> Compiled | None:
    """Compile model's forward in place and compile every graph training will need, on blank images of each size.

    Returns None, with one warning, when the backend is missing or compilation fails: the model is left eager and
    unchanged (its BatchNorm statistics and gradients too). A failure of the warm-up that is not the compiler's,
    such as running out of memory, is not caught.
    """
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    missing = missing_backend(device)
    if missing:
        warn(f"compile={mode}: {missing}; training without compilation")
        return None
    sizes = tuple(sorted(set(batch_sizes), reverse=True))
    dynamic = DYNAMIC if dynamic is None else dynamic
    if device.type == "cpu":  # a CUDA build of torch says, at its first compile, that there is no CUDA: we know
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    model.compile(mode=mode, backend="inductor", dynamic=dynamic)
    start = time.perf_counter()
    try:
        for size in sizes:
            warm_up(model, size, imgsz, device, amp)
    except (TorchDynamoException, InductorError) as e:
        uncompile(model)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warn(f"compile={mode} failed ({type(e).__name__}: {reason[:200]}); training without compilation")
        return None
    return Compiled(mode, dynamic, sizes, time.perf_counter() - start)


def uncompile(model: nn.Module) -> None:
    """Undo nn.Module.compile: calls go to the eager forward again."""
    model._compiled_call_impl = None


def missing_backend(device: torch.device) -> str | None:
    """Why inductor cannot compile for this device (no C++ compiler on the CPU, no Triton on CUDA), or None."""
    try:
        if device.type == "cpu":
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        elif device.type == "cuda":
            from torch.utils._triton import has_triton

            if not has_triton():
                return "no working Triton for this GPU"
    except (RuntimeError, OSError) as e:  # get_cpp_compiler raises RuntimeError when no compiler runs
        return f"no C++ compiler for inductor ({str(e).strip().splitlines()[0][:120]})"
    return None


def warm_up(model: nn.Module, batch: int, imgsz: int, device: torch.device, amp: torch.dtype | None) -> None:
    """One forward and backward of `batch` blank images, which compiles both graphs for that size. The model's
    buffers (BatchNorm's running statistics) and gradients are put back as they were, also when compiling the
    backward fails after the forward ran."""
    grads = [p.grad for p in model.parameters()]  # an open window's, on resume: set aside, not added to
    for p in model.parameters():
        p.grad = None
    try:
        with kept(model):
            img = torch.zeros(batch, 3, imgsz, imgsz, device=device)  # NCHW, as the engine feeds them (model_input)
            with precision.autocast(device, amp):
                out = model(img)
            tensors = [t for t in _tensors(out) if t.requires_grad]
            torch.autograd.backward(tensors, [torch.zeros_like(t) for t in tensors])
    finally:
        for p, g in zip(model.parameters(), grads):
            p.grad = g


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []
