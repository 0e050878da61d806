"""`atom serve` at the reference layout (pp2 x tp4, DSpark, T=7) on the tiny models.

The server runs as a real subprocess with its eight rank processes. Its greedy
completions, plain and streamed chat, must equal the offline pp1 engine without
speculation; its metrics must report the drafter; its log must carry the start-up
markers the accuracy gate counts (4 relay and 8 KDA rollback lines, as ROCm/ATOM
PR #3023 saw at this layout) and no missing-weight line; SIGTERM must stop it
cleanly, rank processes included.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from atom.distributed.rank_process import free_port
from atom.sampling_params import SamplingParams
from scripts.ci.server_log import scan_log
from tests.e2e.pp_probe import make_engine
from tests.process_helpers import descendant_pids, survivors

PROMPT = "List all prime numbers below 30."
MESSAGES = [{"role": "user", "content": "1+2+3=?"}]
MAX_TOKENS = 12
STARTUP_TIMEOUT_S = 300
SHUTDOWN_TIMEOUT_S = 60
# The resource tracker notices its parent is gone on its own schedule.
ORPHAN_EXIT_DEADLINE_S = 30


def serve_command(port: int) -> list[str]:
    script = shutil.which("atom")
    head = [script] if script else [sys.executable, "-m", "atom.entrypoints.cli"]
    return head + [
        "serve", "--model", "tiny-kimi-k3", "-pp", "2", "-tp", "4",
        "--method", "dspark", "--draft-model", "tiny-kimi-k3-dspark",
        "--num-speculative-tokens", "7", "--server-port", str(port),
        "--host", "127.0.0.1", "--device", "cpu",
    ]  # fmt: skip


def wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"server exited ({proc.returncode}):\n{log.read_text()}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"server not healthy in {STARTUP_TIMEOUT_S} s")


pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(scope="module")
def offline():
    """Greedy pp1 x tp1 texts without speculation."""
    engine = make_engine("tiny-kimi-k3")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chat_prompt = engine.apply_chat_template(MESSAGES)
    texts = [r["text"] for r in engine.generate([PROMPT, chat_prompt], params)]
    engine.close()
    assert all(texts)
    return texts


@pytest.mark.slow
def test_serve_pp2_tp4_dspark_answers_like_offline_pp1(offline, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            serve_command(port), stdout=out, stderr=subprocess.STDOUT, env=os.environ
        )
    try:
        wait_healthy(proc, url, log)
        ranks = descendant_pids(proc.pid)
        with httpx.Client(base_url=url, timeout=120) as client:
            completion = client.post(
                "/v1/completions",
                json={"model": "tiny-kimi-k3", "prompt": PROMPT,
                      "max_tokens": MAX_TOKENS, "temperature": 0},
            )  # fmt: skip
            assert completion.status_code == 200, completion.text
            assert completion.json()["choices"][0]["text"] == offline[0]

            pieces = []
            request = {"model": "tiny-kimi-k3", "messages": MESSAGES, "stream": True,
                       "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
            with client.stream("POST", "/v1/chat/completions", json=request) as stream:
                assert stream.status_code == 200
                for line in stream.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[len("data: ") :])["choices"]:
                        pieces.append(choice["delta"].get("content", ""))
            assert len(pieces) > 1 and "".join(pieces) == offline[1]

            stats = client.get("/debug/mtp_stats").json()
            metrics = client.get("/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert stats["enabled"] and stats["num_verify_steps"] > 0
    assert stats["total_draft_tokens"] >= 7 * stats["num_verify_steps"] // 2
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert (
        f'vllm:spec_decode_num_draft_tokens_total{{model_name="tiny-kimi-k3"}} '
        f'{float(stats["total_draft_tokens"])}'
    ) in metrics
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in metrics
    assert code == 0, log.read_text()[-3000:]
    scan = scan_log(log.read_text())
    assert scan.marker_counts() == {"relay": 4, "kda_rollback": 8}
    assert scan.missing_weight_lines == []
    # The cumulative line logged at shutdown matches the counters served above.
    assert (scan.acceptance.accepted, scan.acceptance.drafted) == (
        stats["total_accepted_tokens"],
        stats["total_draft_tokens"],
    )
    assert len(ranks) >= 8  # the eight rank processes (plus any helper)
    assert survivors(ranks, ORPHAN_EXIT_DEADLINE_S) == []
