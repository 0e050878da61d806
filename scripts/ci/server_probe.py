"""Wait for a starting `atom serve` and warm it up; save one of its GET answers.

  python -m scripts.ci.server_probe wait-ready --url URL --pid PID --model NAME
  python -m scripts.ci.server_probe save --url URL --path /debug/mtp_stats --out F

`wait-ready` polls /health until it answers 200 (exit 3 if the server process
exits first or the timeout passes), then sends a one-token completion until one
succeeds, as ROCm/ATOM's launch step does. Standard library only, so it runs in
any image. A key in ATOM_API_KEY is sent as a bearer token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

POLL_S = 2.0
REPORT_EVERY_S = 60.0


def request(url: str, body: dict | None = None, timeout: float = 30.0) -> bytes:
    headers = {"Content-Type": "application/json"}
    if os.environ.get("ATOM_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['ATOM_API_KEY']}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return response.read()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purpose: its parent (serve.sh) has not reaped it yet.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def wait_until(what: str, attempt, pid: int, timeout_s: float) -> bool:
    start = time.monotonic()
    last_report = start
    while True:
        if not alive(pid):
            print(f"server_probe: the server (pid {pid}) exited during {what}")
            return False
        try:
            attempt()
            print(f"server_probe: {what} done after {time.monotonic() - start:.0f} s")
            return True
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = error
        now = time.monotonic()
        if now - start > timeout_s:
            print(f"server_probe: {what} timed out after {timeout_s:.0f} s ({reason})")
            return False
        if now - last_report > REPORT_EVERY_S:
            print(f"server_probe: still waiting for {what} ({now - start:.0f} s)")
            last_report = now
        time.sleep(POLL_S)


def wait_ready(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")

    def healthy() -> None:
        request(f"{url}/health", timeout=10)

    def warm_up() -> None:
        body = {
            "model": args.model,
            "prompt": "Hello",
            "max_tokens": 1,
            "temperature": 0.0,
        }
        answer = json.loads(request(f"{url}/v1/completions", body, timeout=600))
        if not answer.get("choices"):
            raise ValueError(f"warm-up answer has no choices: {answer}")

    if not wait_until("/health", healthy, args.pid, args.timeout):
        return 3
    if not wait_until("the warm-up request", warm_up, args.pid, args.warmup_timeout):
        return 3
    return 0


def save(args: argparse.Namespace) -> int:
    try:
        body = request(args.url.rstrip("/") + args.path)
    except (urllib.error.URLError, OSError) as error:
        print(f"server_probe: GET {args.path} failed: {error}", file=sys.stderr)
        return 1
    Path(args.out).write_bytes(body)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ready = commands.add_parser("wait-ready")
    ready.add_argument("--url", required=True)
    ready.add_argument("--pid", type=int, required=True)
    ready.add_argument("--model", required=True, help="the served model name")
    ready.add_argument("--timeout", type=float, default=2700.0, help="for /health")
    ready.add_argument("--warmup-timeout", type=float, default=300.0)
    fetch = commands.add_parser("save")
    fetch.add_argument("--url", required=True)
    fetch.add_argument("--path", required=True)
    fetch.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    return wait_ready(args) if args.command == "wait-ready" else save(args)


if __name__ == "__main__":
    sys.exit(main())
