"""torchrun --max-restarts: when a rank fails, torch's elastic agent restarts every rank with the same command; the
restarted job continues its run from its last.pt instead of starting a new one.

The agent names the job (TORCHELASTIC_RUN_ID: --rdzv_id, or a fresh id with --standalone) and counts its restarts
(TORCHELASTIC_RESTART_COUNT). The run folder records the job's id when rank 0 makes it; a restarted rank finds the
folder by that id. On several machines the folder must be on a file system they share, as for any resume.
"""

from __future__ import annotations

import os
from pathlib import Path

MARK = "torchelastic_run_id"  # the file in the run folder that holds the job's id


def mark(run: Path) -> None:
    """Record, in a run folder just made by a job torchrun may restart (--max-restarts above 0), the job's id."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        (run / MARK).write_text(run_id)


def restarted_run(project: str | None) -> Path | None:
    """The folder of the run this job made before torchrun restarted it, or None on the job's first attempt (or
    where the first attempt made no folder)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 or not run_id:
        return None
    marks = [m for m in Path(project or "runs/train").glob(f"*/{MARK}") if m.read_text() == run_id]
    return max(marks, key=lambda m: m.stat().st_mtime).parent if marks else None
