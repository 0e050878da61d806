"""Run a client command; kill it when the server log shows no progress for a while.

  python -m scripts.ci.watchdog --log server.log --idle 180 --limit 1800 -- lm_eval ...

Progress is a new line matching --pattern in the log, by default the access-log
line of a finished /v1/completions request: a hung engine keeps logging its
periodic stats, so mere growth of the log proves nothing. The command runs in its
own process group, which is killed as a whole (SIGTERM, then SIGKILL after 10 s).
Exit status: the command's; 3 after --idle seconds without progress; 4 after
--limit seconds in all (ROCm/ATOM's watchdog stops a GSM8K run at 30 minutes).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_PROGRESS = r'"POST /v1/completions HTTP/1\.1" 200'
POLL_S = 2.0
KILL_GRACE_S = 10.0
EXIT_NO_PROGRESS = 3
EXIT_TIME_LIMIT = 4


class ProgressCounter:
    """Counts pattern matches in a growing file, reading only what is new."""

    def __init__(self, path: Path, pattern: re.Pattern[str]) -> None:
        self.path = path
        self.pattern = pattern
        self.offset = 0
        self.partial = ""
        self.count = 0

    def poll(self) -> int:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as file:
                file.seek(self.offset)
                chunk = file.read()
                self.offset = file.tell()
        except FileNotFoundError:
            return self.count
        lines = (self.partial + chunk).split("\n")
        self.partial = lines.pop()  # an unfinished last line waits for its end
        self.count += sum(1 for line in lines if self.pattern.search(line))
        return self.count


def stop_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if grace is None:
            proc.wait()
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def watch(
    command: list[str], counter: ProgressCounter, idle_s: float, limit_s: float
) -> int:
    proc = subprocess.Popen(command, start_new_session=True)
    start = last_progress = time.monotonic()
    seen = counter.poll()
    try:
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            count = counter.poll()
            if count != seen:
                seen, last_progress = count, now
            if now - last_progress > idle_s:
                print(
                    f"watchdog: no progress in {counter.path} for {idle_s:.0f} s "
                    f"({seen} requests done); stopping the client",
                    flush=True,
                )
                stop_group(proc)
                return EXIT_NO_PROGRESS
            if now - start > limit_s:
                print(
                    f"watchdog: time limit of {limit_s:.0f} s reached "
                    f"({seen} requests done); stopping the client",
                    flush=True,
                )
                stop_group(proc)
                return EXIT_TIME_LIMIT
    finally:
        if proc.poll() is None:
            stop_group(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True, help="the server log to watch")
    parser.add_argument("--pattern", default=DEFAULT_PROGRESS)
    parser.add_argument("--idle", type=float, default=180.0, help="seconds")
    parser.add_argument("--limit", type=float, default=1800.0, help="seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    counter = ProgressCounter(Path(args.log), re.compile(args.pattern))
    return watch(command, counter, args.idle, args.limit)


if __name__ == "__main__":
    sys.exit(main())
