"""/metrics through the real server with DSpark: what it counts matches what the
requests were served. Counts only, never durations: the test runs on busy CPUs."""

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.server_helpers import Server

MODEL = "tiny-kimi-k3"
NUM_SPECULATIVE_TOKENS = 3
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    flags = ["--model", MODEL, "--method", "dspark", "--draft-model",
             "tiny-kimi-k3-dspark", "--num-speculative-tokens",
             str(NUM_SPECULATIVE_TOKENS), "--log-stats-interval", "0"]  # fmt: skip
    running = Server(flags, log_path).wait_healthy()
    yield running
    running.stop()


def served_usage(server: Server) -> tuple[int, int, int]:
    """Runs five engine requests (two alone, a batch of two, one chat stream),
    each of at least two output tokens; returns (requests, prompt, output tokens)."""
    usages = []
    for prompt in ["The cat", "Once upon a time"]:
        body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}
        response = server.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        usages.append(response.json()["usage"])
    batch = {"prompt": ["a b c", "one two"], "max_tokens": 4, "ignore_eos": True}
    response = server.post("/v1/completions", batch)
    assert response.status_code == 200, response.text
    usages.append(response.json()["usage"])
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = server.post("/v1/chat/completions", chat)
    assert response.status_code == 200, response.text
    frames = response.text.split("\n\n")
    assert frames[-2] == "data: [DONE]"
    usages.append(json.loads(frames[-3][len("data: ") :])["usage"])
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    output_tokens = sum(u["completion_tokens"] for u in usages)
    return 5, prompt_tokens, output_tokens


def test_metrics_count_the_requests_and_tokens_served(server):
    requests, prompt_tokens, output_tokens = served_usage(server)
    families = {
        family.name: family
        for family in text_string_to_metric_families(server.get("/metrics").text)
    }
    for name in HISTOGRAMS:
        assert families[name].type == "histogram"
        assert server.metric(f"{name}_count") == requests, name
        assert server.metric(f"{name}_bucket", le="+Inf") == requests, name
    assert server.metric("vllm:prompt_tokens_total") == prompt_tokens
    assert server.metric("vllm:generation_tokens_total") == output_tokens
    assert (
        server.metric("vllm:request_success_total", finished_reason="length")
        == requests
    )
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:num_requests_waiting") == 0


def test_spec_decode_counters_add_up(server):
    drafted = server.metric("vllm:spec_decode_num_draft_tokens_total")
    accepted = server.metric("vllm:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and server.metric("vllm:spec_decode_num_drafts_total") > 0
    assert 0 <= accepted <= drafted
    per_position = [
        server.metric(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(k)
        )
        for k in range(NUM_SPECULATIVE_TOKENS)
    ]
    # The k-th draft is accepted only after every earlier one was.
    assert per_position == sorted(per_position, reverse=True)
    assert sum(per_position) == accepted
    stats = server.get("/debug/mtp_stats").json()
    assert (drafted, accepted) == (
        stats["total_draft_tokens"],
        stats["total_accepted_tokens"],
    )


def test_a_request_the_client_leaves_counts_as_aborted(server):
    def aborted() -> float:
        # Absent until the first abort.
        try:
            return server.metric("vllm:request_success_total", finished_reason="abort")
        except AssertionError:
            return 0.0

    before = aborted()
    body = {"prompt": "Go on:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # the first token arrived; now hang up
    # The server notices the hang-up on its next write; generous for busy CPUs.
    deadline = time.monotonic() + 60
    while aborted() == before:
        assert time.monotonic() < deadline, "the abandoned request was not counted"
        time.sleep(0.2)
    assert aborted() == before + 1
