"""End to end: the real server process on tiny-kimi-k3, driven over HTTP."""

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.server_helpers import REPO_ROOT, Server

MODEL = "tiny-kimi-k3"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    flags = ["--model", MODEL, "--host", "127.0.0.1", "--log-stats-interval", "1"]
    running = Server(flags, log_path).wait_healthy()
    yield running
    running.stop()


def sse_payloads(body: str) -> list:
    """Decoded `data:` payloads; every frame must be `data: ...` + a blank line."""
    assert body.endswith("\n\n")
    frames = body[:-2].split("\n\n")
    assert all(frame.startswith("data: ") for frame in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(frame[len("data: ") :]) for frame in frames[:-1]]


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"]
    return error["message"]


def test_health_models_and_server_info(server):
    assert server.get("/health").json() == {"status": "ok"}
    (card,) = server.get("/v1/models").json()["data"]
    assert card["id"] == MODEL and card["owned_by"] == "atom"
    info = server.get("/server_info").json()
    assert info["served_model_name"] == MODEL and info["max_model_len"] > 0
    assert server.get("/debug/mtp_stats").json() == {"enabled": False}


def test_models_retrieve_answers_the_served_id_and_404_otherwise(server):
    # GET /v1/models/{id} is what the openai client's models.retrieve() sends.
    (listed,) = server.get("/v1/models").json()["data"]
    card = server.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200, card.text
    assert card.json() | {"created": 0} == listed | {"created": 0}
    for other in ["gpt-4o", "org/" + MODEL, MODEL + "-x"]:
        message = error_of(server.get(f"/v1/models/{other}"), 404)
        assert other in message and MODEL in message


def test_unknown_routes_and_methods_answer_in_the_error_shape(server):
    missing = server.get("/v1/nowhere")
    assert "/v1/nowhere" in error_of(missing, 404)
    assert missing.json()["error"]["type"] == "not_found_error"
    wrong_method = server.get("/v1/completions")
    assert "GET" in error_of(wrong_method, 405)
    assert wrong_method.headers["allow"] == "POST"
    assert "detail" not in wrong_method.json()


@pytest.mark.parametrize(
    "body, expected",
    [
        (["a list"], "body: must be a JSON object"),
        ({"prompt": 12}, "prompt: Input should be a valid string or"),
        ({"prompt": "x", "seed": -1}, "seed: seed must be an integer in"),
        ({"prompt": "x", "top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"prompt": "x", "stream_options": {"x": 1}}, "stream_options.x: unknown"),
    ],
)
def test_400_messages_carry_no_library_internals(server, body, expected):
    message = error_of(server.post("/v1/completions", body), 400)
    assert message.startswith(expected), message
    for internal in ("errors.pydantic.dev", "Value error", "list[", "Request", "Sampl"):
        assert internal not in message


def test_greedy_completion_is_repeatable_and_counted(server):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
    body |= {"temperature": 0, "ignore_eos": True}
    first, second = server.post("/v1/completions", body), server.post(
        "/v1/completions", body
    )
    assert first.status_code == second.status_code == 200, first.text
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == second.json()["choices"][0]["text"]
    usage = first.json()["usage"]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8


def test_stream_equals_the_non_streamed_text(server):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    body |= {"ignore_eos": True}
    whole = server.post("/v1/completions", body).json()["choices"][0]["text"]
    streamed = server.post(
        "/v1/completions",
        body | {"stream": True, "stream_options": {"include_usage": True}},
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(streamed.text)
    *chunks, usage_chunk = payloads
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    assert len({p["id"] for p in payloads}) == 1


def test_chat_completion_and_its_stream(server):
    body = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_completion_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert response.json()["usage"]["completion_tokens"] == 6
    payloads = sse_payloads(
        server.post("/v1/chat/completions", body | {"stream": True}).text
    )
    assert payloads[0]["object"] == "chat.completion.chunk"
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads)
    assert text == message["content"]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_token_id_and_batched_prompts(server):
    params = {"max_tokens": 3, "ignore_eos": True, "temperature": 0}
    batch = server.post("/v1/completions", {"prompt": [[5, 6, 7], [8, 9]]} | params)
    assert [c["index"] for c in batch.json()["choices"]] == [0, 1]
    assert batch.json()["usage"]["completion_tokens"] == 6
    single = server.post("/v1/completions", {"prompt": [5, 6, 7]} | params)
    assert single.json()["choices"][0]["text"] == batch.json()["choices"][0]["text"]
    texts = server.post("/v1/completions", {"prompt": ["Hi", "Yo"]} | params)
    assert len(texts.json()["choices"]) == 2


def test_bad_requests_fail_alone_while_others_are_served(server):
    max_model_len = server.get("/server_info").json()["max_model_len"]
    good = {"prompt": "Count: one, two,", "max_tokens": 16, "temperature": 0}
    good |= {"ignore_eos": True}
    bad = [
        ("{not json", 400, "malformed JSON"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "x", "n": 0}, 400, "n: Input should be greater than or equal to 1"),
        ({"prompt": "x", "model": "gpt-4o"}, 404, "gpt-4o"),
        ({"prompt": [7] * (max_model_len + 1)}, 400, str(max_model_len)),
        ({"prompt": [10**7]}, 400, "vocabulary"),
        ({"max_tokens": 3}, 400, "prompt"),
    ]

    async def drive():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:

            async def send(body):
                if isinstance(body, str):
                    return await client.post("/v1/completions", content=body)
                return await client.post("/v1/completions", json=body)

            good_calls = [send(good) for _ in range(3)]
            stream = client.post("/v1/completions", json=good | {"stream": True})
            return await asyncio.gather(
                *good_calls, stream, *(send(body) for body, _, _ in bad)
            )

    responses = asyncio.run(drive())
    goods, streamed, bads = responses[:3], responses[3], responses[4:]
    texts = {r.json()["choices"][0]["text"] for r in goods}
    assert len(texts) == 1  # same greedy text despite the failing neighbours
    assert "".join(
        p["choices"][0]["text"] for p in sse_payloads(streamed.text)
    ) == next(iter(texts))
    for response, (_, status, needle) in zip(bads, bad, strict=True):
        assert needle in error_of(response, status)
    assert server.get("/health").json() == {"status": "ok"}
    after = server.post("/v1/completions", good)
    assert after.json()["choices"][0]["text"] == next(iter(texts))


def test_chat_errors(server):
    assert "messages" in error_of(server.post("/v1/chat/completions", {}), 400)
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    body = {"messages": [{"role": "user", "content": [image]}]}
    assert "text" in error_of(server.post("/v1/chat/completions", body), 400)


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_aborts_the_request(server, n):
    """Every choice of a stream stops when the client leaves."""
    before = server.metric("vllm:generation_tokens_total")
    max_tokens = 4000
    body = {"prompt": "Go on and on:", "max_tokens": max_tokens, "ignore_eos": True}
    body |= {"n": n}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with client.stream(
            "POST", "/v1/completions", json=body | {"stream": True}
        ) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first token arrived; now hang up
    deadline = time.monotonic() + 15
    while (
        server.metric("vllm:num_requests_running")
        + server.metric("vllm:num_requests_waiting")
        > 0
    ):
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.2)
    assert server.metric("vllm:generation_tokens_total") - before < max_tokens


def test_metrics_are_prometheus_text(server):
    response = server.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name, kind in [
        ("vllm:num_requests_running", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:prompt_tokens", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
    ]:
        assert families[name].type == kind
        assert families[name].samples[0].labels["model_name"] == MODEL
    assert server.metric("vllm:generation_tokens_total") > 0
    assert server.metric("atom:kv_cache_blocks_total") > 0
    # Without speculation there is nothing to count.
    assert not [name for name in families if "spec_decode" in name]


def test_benchmark_client_against_the_server(server, tmp_path):
    command = [
        sys.executable,
        "-m",
        "atom.benchmarks.benchmark_serving",
        "--model",
        MODEL,
        "--base-url",
        server.base_url,
        "--dataset-name",
        "random",
        "--random-input-len",
        "16",
        "--random-output-len",
        "4",
        "--num-prompts",
        "6",
        "--max-concurrency",
        "3",
        "--ignore-eos",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
    ]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Serving benchmark" in done.stdout
    (result_file,) = tmp_path.glob("*.json")
    result = json.loads(result_file.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 6 * 4
    assert (
        result["p99_ttft_ms"] > 0 and result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    )


def test_every_log_line_of_the_server_and_its_ranks_has_one_format(server):
    server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    log = server.log()
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) "
    # uvicorn's own access lines, the server's and a rank process's (its ledger).
    assert re.search(
        stamp
        + r'uvicorn\.access: 127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 200',
        log,
        re.M,
    ), log
    assert re.search(stamp + r"atom\.entrypoints\.", log, re.M), log
    assert re.search(stamp + r"atom\.model_engine\.memory_ledger: \[memory", log, re.M)
    # No line in another format: uvicorn's "INFO:     ..." or logging's "INFO:name:".
    assert not re.search(r"^(DEBUG|INFO|WARNING|ERROR):", log, re.M), log


def test_sigterm_shuts_down_cleanly(server):
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0, server.log()
    assert "Application shutdown complete" in server.log()
