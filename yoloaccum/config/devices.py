"""device= parsed without importing torch: which CUDA ids a run lists, and how many processes it runs on.

Kept apart from distributed.py so that `yoloaccum plan` and argument checks answer before torch is imported.
"""

from __future__ import annotations

import os

from yoloaccum.errors import UserError


def cuda_ids(device: str | None) -> list[int]:
    """CUDA device ids from a device string, the one parser of device=: '' and 'cpu' give none; '0', '0,1', 'cuda',
    'cuda:1' and 'cuda:0,cuda:1' give ids; each -1 stands for one of the least busy devices, which
    distributed.resolve_device picks (it needs torch). '' means the first CUDA device where there is one: resolved
    there too, so here it lists none."""
    text = str(device or "").strip().lower()
    if text in {"", "cpu"}:
        return []
    if text == "mps" or text.startswith("mps:"):
        raise UserError(
            f"device={device}: yoloaccum trains on CUDA devices or the CPU, not Apple's MPS; use device=cpu"
        )
    items = [d.strip().removeprefix("cuda:") for d in text.split(",") if d.strip()]
    try:
        ids = [0 if d == "cuda" else int(d) for d in items]
    except ValueError:
        raise UserError(f"device={device} is not understood; use cpu, 0, a list such as 0,1,2,3, or -1") from None
    if any(i < -1 for i in ids) or (-1 in ids and any(i != -1 for i in ids)):
        raise UserError(f"device={device}: list device ids (0,1) or -1s for the least busy devices (-1,-1), not both")
    return ids


def world_size(device: str | None) -> int:
    """Devices a run uses: torchrun's WORLD_SIZE when launched by it, else the count of listed CUDA devices (1 for the
    CPU)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return max(len(cuda_ids(device)), 1)
