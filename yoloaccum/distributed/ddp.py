"""Devices and processes: pick the device, join torchrun's process group, and wrap the model in DDP.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without them this is one process and DDP is never used.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from yoloaccum.config.devices import cuda_ids, world_size  # noqa: F401  (parsed without torch, for plan; used here)
from yoloaccum.errors import Stalled, UserError

# Seconds NCCL's watchdog waits beyond ddp_timeout before it aborts a collective by itself: long enough for the
# window's own wait to time out first and name the hung rank.
NCCL_WATCHDOG_MARGIN_S = 60


@dataclass(frozen=True)
class Context:
    """Where this process runs: its rank among world_size processes, and its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    timeout_s: float = 1800  # ddp_timeout

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str | None) -> str:
    """device= as Ultralytics takes it, made explicit: empty gives the first CUDA device where one is available, else
    the CPU; each -1 one of the least busy CUDA devices (the most free memory). Other values are returned as given."""
    text = str(device or "").strip()
    if not text:
        if not torch.cuda.is_available():
            return "cpu"
        # Under torchrun each process of this machine takes its own device, as Ultralytics' DDP does.
        return ",".join(map(str, range(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    ids = cuda_ids(text)
    if ids and ids[0] == -1:
        if "WORLD_SIZE" in os.environ:
            raise UserError(
                f"device={device} under torchrun: list the devices (device=0,1), since each rank "
                "would see another device as the least busy"
            )
        return ",".join(map(str, least_busy(len(ids))))
    return text


def least_busy(count: int) -> list[int]:
    """The `count` CUDA devices with the most free memory, in index order."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count > available:
        raise UserError(f"device={','.join(['-1'] * count)} asks for {count} CUDA device(s), {available} are visible")
    free = sorted(range(available), key=lambda i: -torch.cuda.mem_get_info(i)[0])
    return sorted(free[:count])


def select_device(device: str | None, local_rank: int = 0) -> torch.device:
    """The torch device for this process; asking for CUDA where there is none is an error, not a silent CPU run."""
    ids = cuda_ids(resolve_device(device))
    if not ids:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"device={device} asks for CUDA, but no CUDA device is available; use device=cpu")
    if max(ids) >= torch.cuda.device_count():
        raise UserError(f"device={device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", rank_device(ids, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def rank_device(ids: list[int], local_rank: int, local_world_size: int) -> int:
    """The CUDA index of this machine's local_rank-th process: the local_rank-th listed id, as Ultralytics takes it.

    Ids are torch's indices, so they count within an existing CUDA_VISIBLE_DEVICES, as torch users expect.
    """
    if len(ids) < local_world_size:
        raise UserError(
            f"device={','.join(map(str, ids))} lists {len(ids)} device(s) for {local_world_size} processes on this "
            f"machine; list one device per process (e.g. device={','.join(map(str, range(local_world_size)))})"
        )
    return ids[local_rank]


def visible_devices(ids: list[int], visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for processes that use torch devices `ids` of this one: the same physical devices, also
    when this process already sees a subset (CUDA_VISIBLE_DEVICES=4,5,6,7 with device=0,1 keeps 4,5)."""
    if not visible:
        return ",".join(map(str, ids))
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if max(ids) >= len(listed):
        raise UserError(
            f"device={','.join(map(str, ids))}: CUDA_VISIBLE_DEVICES={visible} makes only "
            f"{len(listed)} device(s) visible"
        )
    return ",".join(listed[i] for i in ids)


def setup(device: str | None, timeout_s: float = 1800) -> Context:
    """Join torchrun's process group when launched by it (nccl on CUDA, gloo on the CPU).

    timeout_s (ddp_timeout) bounds every collective: a rank that hangs ends the job after it (see bounded()), so it
    must also cover the others' wait while rank 0 saves, and the slowest rank's share of a validation. A rank that
    dies is noticed by torchrun at once, which then ends the others.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = select_device(device, local_rank)
    if dev.type == "cuda":  # also in one process on device=N: else the loader's pinning thread and torch.cuda's
        torch.cuda.set_device(dev)  # current-device calls (RNG states among them) would make a context on GPU 0
    if world > 1 and not dist.is_initialized():
        # NCCL keeps torch's watchdog and asynchronous error handling (TORCH_NCCL_BLOCKING_WAIT would block the host
        # on every collective, SyncBatchNorm's included). The window's one host-side collective waits with ddp_timeout
        # itself (all_reduce_sum), so a hung rank is named there; the watchdog's own timeout comes a little later.
        pg_timeout = timeout_s + NCCL_WATCHDOG_MARGIN_S if dev.type == "cuda" else timeout_s
        timeout = timedelta(seconds=pg_timeout)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timeout, **restarted_store(rank, world, timeout))
        atexit.register(_collect_before_teardown)
    return Context(rank, local_rank, world, dev, timeout_s)


def restarted_store(rank: int, world: int, timeout: timedelta) -> dict[str, Any]:
    """The rendezvous of a job torchrun --max-restarts restarted: its ranks meet in the agent's store, where the
    failed attempt's process group left its addresses, and without a prefix of their own the new ranks dial the
    dead ones (seen with torch 2.14's --standalone). Each restart gets its own prefix; a first attempt, or another
    launcher, takes init_process_group's own env:// rendezvous."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"yoloaccum/restart_{restart}", store), "rank": rank, "world_size": world}


def _collect_before_teardown() -> None:
    """At exit, while the interpreter is still whole (atexit runs before it starts to tear itself down), collect the
    garbage DDP's training left in reference cycles. Left to the teardown, it aborted a rank now and then ("terminate
    called without an active exception", exit -6) and torchrun failed a job that had finished: 5 of 54 runs of a
    two-rank gloo test job under load, none of 40 with this collection (docs/distributed.md). Runs on an error's way
    out too."""
    gc.collect()


def wrap(model: nn.Module, ctx: Context, bn: str) -> nn.Module:
    """DDP around the model when there are several processes; SyncBatchNorm first with bn=sync."""
    if bn == "sync":
        if ctx.device.type != "cuda" or ctx.world_size < 2:
            raise UserError("bn=sync needs several CUDA devices under DDP; use bn=batch or bn=frozen here")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if ctx.world_size < 2:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # Buffers are not broadcast from rank 0 at each forward: that would be a second collective per window, on top of
    # the gradient all-reduce. Each rank keeps its own BatchNorm statistics, as Ultralytics does.
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, **no_buffer_sync())


def no_buffer_sync(ddp: type = nn.parallel.DistributedDataParallel) -> dict[str, bool]:
    """DDP's switch for broadcasting buffers at each forward, off, by the name this torch takes: torch 2.13 renamed
    broadcast_buffers to forward_sync_buffers (the old name is a deprecated alias there, and all earlier ones know
    only it)."""
    name = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters else None
    return {name or "broadcast_buffers": False}


def no_sync(model: nn.Module, skip: bool):
    """DDP's no_sync() on every micro-batch of a window but the last: gradients all-reduce once per window."""
    if skip and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def all_reduce_sum(t: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Sum t over ranks in place. On NCCL the host waits for it at most ddp_timeout, and a timeout raises here, in
    this thread, where bounded() names the rank that did not come (gloo raises by itself)."""
    if ctx.world_size > 1:
        work = dist.all_reduce(t, async_op=True)
        if ctx.device.type == "cuda":
            work.wait(timeout=timedelta(seconds=ctx.timeout_s))
        else:
            work.wait()
    return t


def gather_to_main(obj: Any, ctx: Context) -> list[Any] | None:
    """Every rank's obj, in rank order, on rank 0 (None on the others). Pickled: for host-side state."""
    if ctx.world_size == 1:
        return [obj]
    gathered = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def min_over_ranks(value: int, ctx: Context) -> int:
    """The smallest of every rank's `value` (a size they must agree on), on every rank."""
    if ctx.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def from_main(obj: Any, ctx: Context) -> Any:
    """Rank 0's obj on every rank (what it decided, or computed once). Pickled: for host-side values."""
    if ctx.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_buffers(module: nn.Module, ctx: Context) -> None:
    """Every rank's buffers (BatchNorm's running statistics) made rank 0's, in place: one broadcast per dtype of a
    flat copy, not one per buffer."""
    if ctx.world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in module.buffers():
        by_dtype.setdefault(b.dtype, []).append(b)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        buffers = by_dtype[dtype]
        flat = torch.cat([b.detach().reshape(-1) for b in buffers]).to(ctx.device)
        dist.broadcast(flat, src=0)
        for b, value in zip(buffers, flat.split([b.numel() for b in buffers])):
            b.copy_(value.view_as(b))


def every_rank_ok(error: str | None, ctx: Context) -> None:
    """A step every rank takes that may fail on some (a path only some machines see): the first rank's error, if
    any rank had one, raised as a UserError on every rank, so none waits in a collective for a rank that stopped."""
    if ctx.world_size == 1:
        if error:
            raise UserError(error)
        return
    errors = [None] * ctx.world_size
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        rank, first = failed[0]
        raise UserError(f"{first} (on rank {rank})")


def arrive(ctx: Context, ni: int) -> None:
    """Post, in torchrun's store, that this rank reached the collectives of iteration ni's window: a rank that then
    waits in vain can name the ones that did not come. One small message per window, to the store's host."""
    if ctx.world_size > 1:
        dist.distributed_c10d._get_default_store().set(f"yoloaccum/at/{ctx.rank}", str(ni))


@contextlib.contextmanager
def bounded(ctx: Context, iteration: Callable[[], int], timeout_s: float):
    """Turn a collective that timed out (a rank hung) into one line naming the rank(s) and the iteration."""
    try:
        yield
    except RuntimeError as e:
        if ctx.world_size < 2 or not re.search(r"timed out|timeout|timing out", str(e), re.IGNORECASE):
            raise
        raise stalled(ctx, iteration(), timeout_s) from e


def stalled(ctx: Context, ni: int, timeout_s: float) -> Stalled:
    store = dist.distributed_c10d._get_default_store()  # still answers: it is not the collectives' connection
    keys = {r: f"yoloaccum/at/{r}" for r in range(ctx.world_size)}
    seen = {r: int(store.get(k)) if store.check([k]) else -1 for r, k in keys.items()}
    behind = [f"rank {r} (last at iteration {at})" for r, at in seen.items() if at < ni]
    who = ", ".join(behind) or "a rank (rank 0 saving, or a slow share of a validation?)"
    return Stalled(
        f"{who} did not reach iteration {ni} within ddp_timeout={timeout_s:g}s, so the job stops (rank {ctx.rank} "
        "waited there); last.pt holds the last completed save. Check that rank's machine, or raise ddp_timeout if it "
        "was only slow"
    )


@contextlib.contextmanager
def main_first(ctx: Context):
    """Rank 0 runs the block first (it may write files, like a dataset's label cache), then the other ranks."""
    if not ctx.is_main:
        barrier(ctx)
    yield
    if ctx.is_main:
        barrier(ctx)


def barrier(ctx: Context) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
