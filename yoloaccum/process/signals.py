"""Ctrl-C and SIGTERM during training: the first asks the loop to stop at the next window boundary, a second stops
at once. Checkpoints are written atomically, so stopping at once never leaves a truncated file."""

from __future__ import annotations

import signal
import threading
from types import FrameType

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # the shell's 128 + signal number


class Interrupted(Exception):
    """Training stopped at a window boundary on a signal; last.pt holds the state to resume from."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = EXIT_CODES.get(signum, 1)


class GracefulStop:
    """A context manager that records the first SIGINT/SIGTERM in `signum` instead of raising."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            for s in EXIT_CODES:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def __call__(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second one: stop now
            raise KeyboardInterrupt
        self.signum = signum
        name = signal.Signals(signum).name
        print(f"\n{name}: stopping at the end of this accumulation window (again to stop at once)", flush=True)
