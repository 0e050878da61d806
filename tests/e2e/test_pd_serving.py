"""P/D through the router: producer pp2 x tp2 -> consumer tp2, via `pd_proxy`.

Real subprocesses: a DSpark producer split over two pipeline stages (each stage
registers and serves its own layers' regions, the last one the draft's context
rows), a DSpark consumer at tp2, and the router in front, over Mooncake's
`tcp` loopback. Streamed and plain completions through the router must equal the
offline aggregated engine's greedy tokens (and so, by tests/e2e/test_pp_dspark.py,
target-only), each token streamed once; afterwards neither side holds a transfer
or a block. The deployment runs behind one API key (ATOM_API_KEY on all three): the
router refuses a client without it, and presents it to both servers, and the
consumer presents it on its side channel to the producer. With the producer gone,
the router answers 502 naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from atom.distributed.rank_process import free_port
from tests.e2e.pp_probe import PAIRS, T, corpus_prompts, generate_ids, make_engine
from tests.entrypoints.server_helpers import REPO_ROOT, Server

pytest.importorskip("mooncake.engine")

TARGET, DRAFT = PAIRS["k3"]
API_KEY = "pd-deployment-key"
KEYED = {"env": {"ATOM_API_KEY": API_KEY}, "api_key": API_KEY}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = corpus_prompts((26, 45))
MAX_TOKENS = 16
FLAGS = [
    "--model", TARGET, "--method", "dspark", "--draft-model", DRAFT,
    "--num-speculative-tokens", str(T), "--skip-tokenizer-init",
    "--max-model-len", "256", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "32", "--block-size", "16",
]  # fmt: skip


def transfer_config(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_role": role, "protocol": "tcp"})]


def start_proxy(producer: Server, consumer: Server, log_path) -> tuple:
    """(the running router, its URL). The port is picked just before the router
    binds it; if another process took it in between (seen once beside the
    servers' rank processes), the router is started again on a fresh one."""
    for _ in range(3):
        port = free_port()
        with open(log_path, "w") as log:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "atom.entrypoints.pd_proxy",
                 "--prefill", producer.base_url, "--decode", consumer.base_url,
                 "--port", str(port)],
                cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "ATOM_API_KEY": API_KEY},
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            if wait_for_proxy(proxy, url, log_path):
                return proxy, url
        except AssertionError:
            proxy.kill()
            proxy.wait()
            raise
    raise AssertionError(f"the router found no free port:\n{log_path.read_text()}")


def wait_for_proxy(proc: subprocess.Popen, url: str, log_path) -> bool:
    """True once the router is healthy; False if it exited because its port was
    taken; an AssertionError for any other exit or if it never becomes healthy."""
    # The backends are up already; the router starts in well under a minute.
    for _ in range(240):
        if proc.poll() is not None:
            log = log_path.read_text()
            if "address already in use" in log:
                return False
            raise AssertionError(f"router exited:\n{log}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        try:
            proc.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            pass
    raise AssertionError(f"router never became healthy:\n{log_path.read_text()}")


def wait_until(condition, attempts: int = 240) -> None:
    for _ in range(attempts):
        if condition():
            return
        time.sleep(0.25)
    raise AssertionError("condition never held")


def streamed_token_ids(response: httpx.Response) -> list[list[int]]:
    chunks = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                if choice.get("token_ids"):
                    chunks.append(choice["token_ids"])
    return chunks


def blocks_free(server: Server) -> float:
    return server.metric("atom:kv_cache_blocks_free")


@pytest.mark.slow
def test_pd_through_the_router(tmp_path):
    producer = Server(FLAGS + ["-pp", "2", "-tp", "2"] + transfer_config("kv_producer"),
                      tmp_path / "producer.log", **KEYED)  # fmt: skip
    consumer = Server(
        FLAGS + ["-tp", "2"] + transfer_config("kv_consumer"),
        tmp_path / "consumer.log",
        **KEYED,
    )
    proxy_log = tmp_path / "proxy.log"
    proxy = None
    try:
        expected = generate_ids(make_engine(TARGET, DRAFT), PROMPTS)
        producer.wait_healthy(), consumer.wait_healthy()
        start = blocks_free(producer), blocks_free(consumer)
        info = producer.get("/kv_transfer_info").json()
        assert (info["kv_role"], info["pp_size"]) == ("kv_producer", 2)
        # Each stage serves its own layers; the last one also the draft rows.
        names = {
            (rank["pp_rank"], rank["tp_rank"]): {r["name"] for r in rank["regions"]}
            for rank in info["layout"]["ranks"]
        }
        assert len(names) == 4 and names[0, 0] == names[0, 1]
        assert not names[0, 0] & names[1, 0] and "draft.mla.0" in names[1, 1]
        proxy, url = start_proxy(producer, consumer, proxy_log)
        body = {"model": TARGET, "max_tokens": MAX_TOKENS, "temperature": 0}
        keyless = httpx.post(
            url + "/v1/completions", json={**body, "prompt": PROMPTS[0]}, timeout=60
        )
        assert keyless.status_code == 401
        assert "API key" in keyless.json()["error"]["message"]

        with httpx.stream(
            "POST", url + "/v1/completions", timeout=120, headers=AUTH,
            json={**body, "prompt": PROMPTS[0], "stream": True},
        ) as streamed:  # fmt: skip
            assert streamed.status_code == 200
            chunks = streamed_token_ids(streamed)
        assert sum(chunks, []) == expected[0]
        assert chunks[0][0] == expected[0][0]  # the producer's token, once
        plain = httpx.post(
            url + "/v1/completions",
            json={**body, "prompt": PROMPTS[1]},
            headers=AUTH,
            timeout=120,
        )
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["token_ids"] == expected[1]

        for server, key in (
            (producer, "held_transfers"),
            (consumer, "parked_requests"),
        ):
            assert server.get("/kv_transfer_info").json()[key] == 0
        assert (blocks_free(producer), blocks_free(consumer)) == start
        assert "falling back to prefill" not in consumer.log()

        producer.stop()
        gone = httpx.post(
            url + "/v1/completions",
            json={**body, "prompt": PROMPTS[0]},
            headers=AUTH,
            timeout=60,
        )
        assert gone.status_code == 502
        assert producer.base_url in gone.json()["error"]["message"]
    finally:
        if proxy is not None:
            proxy.kill()
            proxy.wait()
        producer.stop()
        consumer.stop()
