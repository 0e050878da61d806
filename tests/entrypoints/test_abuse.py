"""The real server against hostile and careless clients, and against lost processes.

No request may take the server down: out-of-range seeds, wrong types, huge or
deeply nested bodies all get their 4xx while good requests keep completing with
exact token counts. A rank that dies makes the server say so and exit non-zero;
a server that is killed takes no rank process with it into orphanhood.
"""

import asyncio
import json
import os
import re
import signal
import socket
import time

import httpx
import pytest

from atom.kv_transfer.peer import HttpPeer, PeerError
from tests.entrypoints.server_helpers import Server
from tests.process_helpers import (
    command_line,
    descendant_pids,
    is_loopback,
    listening_addresses,
    rank_pids,
    survivors,
)

MODEL = "tiny-kimi-k3"
API_KEY = "abuse-test-key"
DEFAULT_BODY_LIMIT = 8 * 1024 * 1024
GOOD = {"prompt": "Count: one, two,", "max_tokens": 6, "temperature": 0}
GOOD |= {"ignore_eos": True}
# Bounds for processes to react, generous for a loaded 2-core machine; the server
# reacts at once (it waits on process sentinels), these only keep a hang finite.
REACTION_DEADLINE_S = 30
EXIT_DEADLINE_S = 60
DEAD_RANK = re.compile(r"rank \d \(pp_rank \d, tp_rank \d\) exited with code -9")

# (field, value): each must be refused with 400 naming the field.
BAD_FIELDS = [
    ("seed", 2**64),
    ("seed", 2**63),
    ("seed", -1),
    ("seed", "1"),
    ("seed", True),
    ("seed", 1.5),
    ("max_tokens", "5"),
    ("max_tokens", True),
    ("max_tokens", 5.0),
    ("n", "1"),
    ("n", True),
    ("top_k", "5"),
    ("top_k", True),
    ("temperature", True),
    ("temperature", "0.5"),
    ("top_p", True),
    ("top_p", "1"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One rank, default host and limits, the API key from the environment."""
    log_path = tmp_path_factory.mktemp("abuse") / "server.log"
    running = Server(
        ["--model", MODEL], log_path, env={"ATOM_API_KEY": API_KEY}, api_key=API_KEY
    ).wait_healthy()
    yield running
    running.stop()


def error_message(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"]
    return error["message"]


def chat_body(field: str, value) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | {
        field: value
    }


@pytest.mark.parametrize("field, value", BAD_FIELDS)
def test_bad_sampling_field_is_400_naming_it(server, field, value):
    body = {"prompt": "x", "max_tokens": 2} | {field: value}
    assert field in error_message(server.post("/v1/completions", body), 400)
    chat = server.post("/v1/chat/completions", chat_body(field, value))
    assert field in error_message(chat, 400)


def test_seed_rule_is_stated_and_its_bounds_are_served(server):
    message = error_message(server.post("/v1/completions", GOOD | {"seed": 2**64}), 400)
    assert "[0, 2**63 - 1]" in message
    for seed in (0, 2**63 - 1):
        for temperature in (0, 1.0):
            body = GOOD | {"seed": seed, "temperature": temperature}
            response = server.post("/v1/completions", body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 6
    assert server.get("/health").json() == {"status": "ok"}


def test_completions_default_to_16_tokens(server):
    body = {"prompt": "Tell a story:", "temperature": 0, "ignore_eos": True}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16


# Every route the server has but /health: the API docs and the stats describe the
# server, so they need the key as much as the API does.
GUARDED_ROUTES = [
    ("GET", "/v1/models"),
    ("GET", f"/v1/models/{MODEL}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/redoc"),
    ("GET", "/debug/mtp_stats"),
    ("GET", "/metrics"),
    ("GET", "/server_info"),
]


@pytest.mark.parametrize("method, path", GUARDED_ROUTES)
@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]
)
def test_api_key_guards_every_route_but_health(server, method, path, headers):
    body = GOOD if path == "/v1/completions" else chat_body("max_tokens", 2)
    response = httpx.request(
        method, server.base_url + path, json=body, headers=headers, timeout=30
    )
    assert "API key" in error_message(response, 401)
    assert response.headers["www-authenticate"] == "Bearer"
    with_key = httpx.request(
        method, server.base_url + path, json=body, headers=server.headers, timeout=60
    )
    assert with_key.status_code == 200, with_key.text
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def test_without_the_key_an_unknown_path_is_401_not_404(server):
    response = httpx.get(server.base_url + "/v1/nowhere", timeout=30)
    assert "API key" in error_message(response, 401)
    assert server.get("/v1/nowhere").status_code == 404


def test_the_pd_side_channel_presents_the_key(server):
    """A consumer's side channel to a keyed server: refused by name without the
    key; with it, the server answers (that it is no producer)."""
    with pytest.raises(PeerError, match="ATOM_API_KEY"):
        HttpPeer(timeout_s=30).layout(server.base_url)
    with pytest.raises(PeerError, match="is not a P/D producer"):
        HttpPeer(timeout_s=30, api_key=API_KEY).layout(server.base_url)


def test_server_listens_on_loopback_by_default(server):
    addresses = listening_addresses(server.process.pid)
    assert addresses and all(is_loopback(a) for a in addresses), addresses


def raw_post(server: Server, declared_length: int, sent: bytes) -> bytes:
    """Send a POST that declares `declared_length` body bytes but sends only
    `sent`, and return what the server answers meanwhile."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared_length}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(REACTION_DEADLINE_S)
        sock.sendall(head + sent)
        try:
            return sock.recv(65536)
        except TimeoutError:
            return b"(no answer: the server waits for the rest of the body)"


def test_big_bodies_are_413(server):
    # Declared too large: answered before the body is sent at all.
    answer = raw_post(server, 64 * DEFAULT_BODY_LIMIT, b'{"prompt": "')
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    # Sent in full, or chunked without a declared length: refused as well.
    whole = server.post("/v1/completions", b"x" * (DEFAULT_BODY_LIMIT + 1))
    assert "--max-request-body-bytes" in error_message(whole, 413)

    def chunks():
        for _ in range(DEFAULT_BODY_LIMIT // 65536 + 2):
            yield b" " * 65536

    chunked = httpx.post(
        server.base_url + "/v1/completions",
        content=chunks(),
        headers=server.headers,
        timeout=120,
    )
    assert "--max-request-body-bytes" in error_message(chunked, 413)
    assert server.post("/v1/completions", GOOD).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        "[" * 100_000,
        '{"prompt": "x", "tools": ' + "[" * 50_000 + "]" * 50_000 + "}",
    ],
)
def test_deep_nesting_is_400(server, body):
    assert "nested too deeply" in error_message(
        server.post("/v1/completions", body), 400
    )


def test_good_requests_complete_among_bad_ones(server):
    bad = [
        (body, 400)
        for field, value in BAD_FIELDS
        for body in ({"prompt": "x", "max_tokens": 2} | {field: value},)
    ]
    bad += [("[" * 100_000, 400), ("{not json", 400)]

    async def drive():
        async with server.client() as client:

            async def send(body):
                if isinstance(body, str):
                    return await client.post("/v1/completions", content=body)
                return await client.post("/v1/completions", json=body)

            goods = [send(GOOD) for _ in range(6)]
            stranger = httpx.AsyncClient(base_url=server.base_url, timeout=120)
            async with stranger:
                responses = await asyncio.gather(
                    *goods,
                    *(send(body) for body, _ in bad),
                    stranger.post("/v1/completions", json=GOOD),
                )
        return responses[:6], responses[6:-1], responses[-1]

    goods, bads, unauthenticated = asyncio.run(drive())
    for response in goods:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 6
    assert len({r.json()["choices"][0]["text"] for r in goods}) == 1
    for response, (_, status) in zip(bads, bad, strict=True):
        error_message(response, status)
    error_message(unauthenticated, 401)
    assert server.get("/health").json() == {"status": "ok"}
    assert "Traceback" not in server.log()


@pytest.fixture
def two_rank_server(tmp_path):
    running = Server(["--model", MODEL, "-tp", "2"], tmp_path / "server.log")
    yield running.wait_healthy()
    running.stop()  # and whatever it left behind, should a test have failed


@pytest.mark.slow
def test_rank_killed_at_idle_fails_health_and_exits_non_zero(two_rank_server):
    server = two_rank_server
    below = descendant_pids(server.process.pid)
    ranks = rank_pids(server.process.pid)
    assert len(ranks) == 2, [command_line(pid) for pid in below]
    os.kill(ranks[-1], signal.SIGKILL)
    health = poll_health_until_bad(server)
    if isinstance(health, httpx.Response):
        assert health.status_code == 503
        assert DEAD_RANK.search(health.json()["reason"]), health.text
    code = server.process.wait(timeout=EXIT_DEADLINE_S)
    assert code != 0, server.log()
    assert DEAD_RANK.search(server.log()), server.log()[-3000:]
    assert survivors(below, REACTION_DEADLINE_S) == []


def poll_health_until_bad(server: Server) -> httpx.Response | str:
    """The first /health answer that is not 200, or "gone" once the server has
    stopped listening; fails if it still says ok after REACTION_DEADLINE_S."""
    deadline = time.monotonic() + REACTION_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            response = server.get("/health")
        except httpx.TransportError:
            return "gone"
        if response.status_code != 200:
            return response
        time.sleep(0.1)
    raise AssertionError(f"/health still ok after a rank died:\n{server.log()}")


@pytest.mark.slow
def test_no_process_outlives_a_killed_server(two_rank_server):
    server = two_rank_server
    below = descendant_pids(server.process.pid)
    assert len(rank_pids(server.process.pid)) == 2
    listening = {
        pid: (command_line(pid), listening_addresses(pid))
        for pid in [server.process.pid, *below]
    }
    server.process.kill()  # SIGKILL, as the OOM killer does
    server.process.wait()
    left = survivors(below, REACTION_DEADLINE_S)
    assert left == [], [command_line(pid) for pid in left]
    # While it ran, the server and its ranks (store, gloo) listened on loopback only.
    for command, addresses in listening.values():
        assert all(is_loopback(a) for a in addresses), (command, addresses)


@pytest.mark.slow
def test_rank_killed_mid_request_fails_it_with_503(two_rank_server):
    server = two_rank_server
    body = {"prompt": "Go on:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    frames = []
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not frames:  # generating: now a rank dies under it
                    os.kill(rank_pids(server.process.pid)[0], signal.SIGKILL)
                frames.append(line[len("data: ") :])
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == 503 and DEAD_RANK.search(error["message"]), error
    assert server.process.wait(timeout=EXIT_DEADLINE_S) != 0
