"""The real server as a subprocess, and what tests ask of it and of the processes
below it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from atom.distributed.rank_process import free_port
from tests.process_helpers import descendant_pids, survivors

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300


class Server:
    """`python -m atom.entrypoints.openai_server` with the given flags, or another
    `entrypoint` (`("atom.entrypoints.cli", "serve")`: the `atom serve` command)."""

    def __init__(
        self,
        flags: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        entrypoint: tuple[str, ...] = ("atom.entrypoints.openai_server",),
    ):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.descendants: list[int] = []  # recorded once healthy
        command = [sys.executable, "-m", *entrypoint]
        command += ["--server-port", str(self.port), "--device", "cpu", *flags]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> Server:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"server exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                if self.get("/health").status_code == 200:
                    self.descendants = descendant_pids(self.process.pid)
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"server never became healthy:\n{self.log()}")
            time.sleep(0.5)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.base_url + path, headers=self.headers, timeout=30)

    def post(self, path: str, body: dict | str | bytes) -> httpx.Response:
        if isinstance(body, str | bytes):
            return httpx.post(
                self.base_url + path, content=body, headers=self.headers, timeout=120
            )
        return httpx.post(
            self.base_url + path, json=body, headers=self.headers, timeout=120
        )

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=120
        )

    def metric(self, name: str, **labels: str) -> float:
        """The value of the /metrics sample `name` (`vllm:prompt_tokens_total`,
        `vllm:e2e_request_latency_seconds_count`) whose labels include `labels`."""
        text = self.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return sample.value
        raise AssertionError(f"{name} {labels} missing from /metrics:\n{text}")

    def stop(self) -> None:
        """Kill the server if it still runs, then any process below it once healthy
        that is still running (a test of orphans may have failed)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pid in survivors(self.descendants, deadline_s=0):
            os.kill(pid, signal.SIGKILL)
