"""A fork server for `run_cli`: `python -m yoloaccum ...` without paying for a fresh interpreter's imports each time.

A training run's process spends 3 to 5 s of CPU importing torch, torch._dynamo, Ultralytics and matplotlib before it
reads its first argument, and the suite starts about a hundred of them. This server imports all of that once, then
for each request forks a child that becomes what `python -m yoloaccum ...` would be: its own process, environment,
working directory, arguments, stdin /dev/null, stdout and stderr into files, `yoloaccum/__main__.py` run as
`__main__`, threads joined and exit handlers run at the end, and its exit status (a signal's too) the process'.

The server itself only imports: nothing in it computes, so no thread pool (OpenMP's among them) exists to be broken
by the fork. What a fresh interpreter reads from its environment while importing cannot be changed after the fact,
so the client (tests/conftest.py) forks only requests whose environment is the one the server started with, but for
variables read while the run runs (`RUN_TIME`); anything else goes to a fresh interpreter.

Protocol, one JSON object per line: the client writes {"argv", "env", "cwd", "out", "err"} on stdin; the server
answers {"pid": ...} once the child is started and {"status": ...} once it has ended (os.waitstatus_to_exitcode).
It says {"ready": true} once its imports are done.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import os
import runpy
import signal
import sys
import threading
import traceback

# Variables the code under test reads while it runs, never while importing: a request may differ from the server's
# environment in these and still be forked. yoloaccum/training/faults.py reads YOLOACCUM_FAULT when a run installs its
# faults; yoloaccum/cli.py reads YOLOACCUM_DEBUG when it reports an error.
# PYTEST_CURRENT_TEST, pytest's name for the running test, is read by nothing here.
RUN_TIME = frozenset({"YOLOACCUM_FAULT", "YOLOACCUM_DEBUG", "PYTEST_CURRENT_TEST"})

# What a `yoloaccum train` (or val, predict, plan) process imports before it trains.
PRELOAD = (
    "yoloaccum.cli",
    "yoloaccum.training.trainer",
    "yoloaccum.evaluation.validate",
    "yoloaccum.commands.predict",
    "yoloaccum.commands.plan",
    "yoloaccum.evaluation.plots",
    "yoloaccum.data.shapes",
    "torch.optim",
    "matplotlib.pyplot",
)


def _exit_status(e: SystemExit) -> int:
    """What the interpreter makes of an uncaught SystemExit (Python/pythonrun.c: handle_system_exit)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def _become(request: dict) -> None:
    """In the forked child: turn into `python -m yoloaccum *argv` as a fresh interpreter would run it, then exit.
    The environment is the server's, as its imports left it (cv2, for one, appends to LD_LIBRARY_PATH), with the
    request's values of the variables read only while running."""
    for key in RUN_TIME:
        os.environ.pop(key, None)
    os.environ.update({k: v for k, v in request["env"].items() if k in RUN_TIME})
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    fds = (
        os.open(os.devnull, os.O_RDONLY),
        *(os.open(request[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for k in ("out", "err")),
    )
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # a run that crashes (SIGSEGV, SIGABRT) leaves its Python stack in its stderr, then dies of the signal as before
    faulthandler.enable()
    sys.argv = ["-m", *request["argv"]]
    status = 0
    try:
        runpy.run_module("yoloaccum", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        status = _exit_status(e)
    except KeyboardInterrupt:
        traceback.print_exc()
        status = -signal.SIGINT  # the interpreter ends itself with SIGINT, so that its parent sees the signal
    except BaseException:
        traceback.print_exc()
        status = 1
    threading._shutdown()  # as the interpreter does at its end: wait for threads that are not daemons, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # a stray print while importing must not reach the replies
    sys.path[0] = os.getcwd()
    for module in PRELOAD:
        __import__(module)
    gc.freeze()  # what the imports made is never collected in a child, so its pages are not copied on write
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                replies.close()
                _become(request)
            finally:
                os._exit(70)  # _become exits itself; reaching here is a bug in this file
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
