"""Stop signals as a clean exit: SIGTERM and Ctrl-C end a command with status 0."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType


def exit_cleanly(signum: int, frame: FrameType | None) -> None:
    """A signal handler that ends the command with status 0."""
    # SystemExit unwinds through the caller's `finally` blocks, which close the
    # engine and its rank processes, and Python prints no traceback for it.
    raise SystemExit(0)


@contextlib.contextmanager
def exit_cleanly_on(*signums: signal.Signals) -> Iterator[None]:
    """Within the block each of `signums` raises SystemExit(0) in the main thread;
    the handlers found are put back after, for callers that run a command
    in-process (tests, scripts)."""
    previous = {signum: signal.signal(signum, exit_cleanly) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
