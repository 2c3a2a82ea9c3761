"""How fast the command line answers: process start to exit, median of repeated runs, for commands that need no
training (a typo, a plan, the configuration).

    python benchmarks/startup.py             # 7 runs of each command: writes benchmarks/startup.{md,json}
    python benchmarks/startup.py --smoke     # 1 run each, for the test suite
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMANDS = (("train nbs=abc", 2), ("plan images=118287 batch=8", 0), ("cfg", 0))


def seconds(args: str, expected: int) -> float:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "yoloaccum", *args.split()], cwd=HERE.parent, capture_output=True)
    took = time.perf_counter() - start
    assert r.returncode == expected, (args, r.returncode, r.stderr[-500:])
    return took


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    runs = 1 if p.parse_args().smoke else 7
    rows = []
    for args, code in COMMANDS:
        times = [seconds(args, code) for _ in range(runs)]
        rows.append({"command": f"yoloaccum {args}", "median_s": statistics.median(times), "runs": times})
        print(f"yoloaccum {args}: median {rows[-1]['median_s']:.2f} s over {runs} run(s)", flush=True)
    if runs == 1:
        return
    (HERE / "startup.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# Command-line start times (`python benchmarks/startup.py`)",
        "",
        f"Whole process, start to exit, median of {runs} runs, one at a time on the 2-core CPU machine.",
        "",
        "| command | median |",
        "| --- | --- |",
    ]
    lines += [f"| `{r['command']}` | {r['median_s']:.2f} s |" for r in rows]
    (HERE / "startup.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
